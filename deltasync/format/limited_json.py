"""Strict parsing of untrusted JSON and of the numbers and hex strings in it.

Everything in a bucket may have been written by someone else: a reader parses it with
limits (size, nesting, digits), checks each number's type and range before using it, and
never allocates from a number it has not checked. Anything else is a FormatError that
names the file and the field.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from ..errors import FormatError

__all__ = [
    "MAX_COUNT",
    "MAX_DEPTH",
    "MAX_INT_DIGITS",
    "FINGERPRINT_RE",
    "SHA256_RE",
    "parse_json",
    "check_int",
    "check_hex",
]

MAX_COUNT = 2**50
"""Upper bound of every element count, byte size and version in a bucket."""
MAX_INT_DIGITS = 16
"""The most digits of an integer a reader parses."""
MAX_DEPTH = 8
"""The deepest nesting :func:`parse_json` accepts unless told otherwise."""
# A string (or an unterminated one, up to the end) or a bracket. The string matches at the
# first try, and possessive loops keep no backtracking state (a plain (?:a|b)* costs ~100
# bytes per character).
_TOKEN_RE = re.compile(rb'"[^"\\]*+(?:\\.?[^"\\]*+)*+(?:"|\Z)|[\[\]{}]', re.DOTALL)
FINGERPRINT_RE = re.compile(r"[0-9a-f]{16}\Z", re.ASCII)
SHA256_RE = re.compile(r"[0-9a-f]{64}\Z", re.ASCII)


class _Refused(ValueError):
    """A JSON value outside the limits (raised from inside the parser's hooks)."""


def _json_depth(data: bytes, limit: int) -> int:
    """The nesting of ``[``/``{`` outside strings, counted up to the first level past ``limit``."""
    level = 0
    for token in _TOKEN_RE.finditer(data):
        char = data[token.start()]
        if char in b"[{":
            level += 1
            if level > limit:
                return level
        elif char in b"]}":
            level -= 1
    return 0


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _json_float(text: str) -> float:
    value = float(text) if len(text) <= 40 else float("inf")
    if not np.isfinite(value):
        raise _Refused(f"the number {text[:40]} is out of range")
    return value


def _no_float(text: str) -> float:
    raise _Refused(f"a fractional number ({text[:40]}) where only integers are allowed")


def _no_constant(text: str) -> Any:
    raise _Refused(f"{text} is not JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Refused(f"the key {dup[:80]!r} appears twice")
    return out


def parse_json(
    data: bytes | str,
    *,
    where: str,
    what: str,
    max_bytes: int,
    max_depth: int = MAX_DEPTH,
    floats: bool = False,
) -> Any:
    """Parse untrusted JSON with limits on size, nesting and digits; no NaN/Infinity.

    Raises :class:`FormatError` naming ``where`` and ``what`` for anything outside them.
    """
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise FormatError(f"{where}: {what} is {len(raw)} bytes, more than the {max_bytes} a reader accepts")
    if _json_depth(raw, max_depth) > max_depth:
        raise FormatError(f"{where}: {what} nests more than {max_depth} levels deep")
    try:
        return json.loads(
            raw.decode("utf-8"),
            parse_int=_json_int,
            parse_float=_json_float if floats else _no_float,
            parse_constant=_no_constant,
            object_pairs_hook=_unique_keys,
        )
    except (UnicodeDecodeError, json.JSONDecodeError, _Refused, RecursionError) as exc:
        raise FormatError(f"{where}: {what} is not valid JSON within limits ({exc})") from exc


def check_int(value: object, *, where: str, field: str, lo: int = 0, hi: int = MAX_COUNT) -> int:
    """``value`` if it is an int (not a bool) in ``lo..hi``, else a FormatError naming ``field``."""
    if type(value) is not int or not lo <= value <= hi:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise FormatError(f"{where}: {field} must be an integer in {lo}..{hi}, got {shown}")
    return value


def check_hex(value: object, pattern: re.Pattern[str], *, where: str, field: str) -> None:
    """A FormatError naming ``field`` unless ``value`` is a string :data:`FINGERPRINT_RE` or
    :data:`SHA256_RE` (``pattern``) matches."""
    if not isinstance(value, str) or not pattern.match(value):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        digits = 16 if pattern is FINGERPRINT_RE else 64
        raise FormatError(f"{where}: {field} must be {digits} lower-case hex digits, got {shown}")
