"""The wire format: file names, the pointer, and the bytes of anchors and deltas.

This is the only module that knows how files in a bucket are laid out; docs/protocol.md
describes every byte of what it writes, and tests pin golden bytes. Both the trainer side
(``_publisher``) and the server side (``_receiver``) go through it.

Files are safetensors. They are written by :func:`_safetensors_bytes`, which produces the
layout the safetensors library writes, with the metadata keys in sorted order so that the
same content always gives the same bytes (the library orders metadata keys at random).
They are read with the safetensors library.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zstandard
from safetensors import SafetensorError
from safetensors.torch import load as _st_load

from ._errors import FormatError

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PARTS_FORMAT_VERSION",
    "CHAIN_FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "POINTER_PATH",
    "HISTORY_PATH",
    "CODECS",
    "ChainEntry",
    "PartEntry",
    "Pointer",
    "Change",
    "FileHeader",
    "anchor_path",
    "delta_path",
    "part_path",
    "encode_anchor",
    "encode_delta",
    "decode_anchor",
    "decode_delta",
    "read_header",
    "parse_header",
    "header_length",
    "tensor_spans",
    "TensorSpan",
    "sha256_hex",
]

FORMAT_NAME = "deltasync"
FORMAT_VERSION = 1
PARTS_FORMAT_VERSION = 2
"""The format version of a version split into several part files (one per sharded writer)."""
CHAIN_FORMAT_VERSION = 3
"""The pointer's format version since anchors are written beside deltas (files keep 1 and 2)."""
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, PARTS_FORMAT_VERSION, CHAIN_FORMAT_VERSION)
"""Pointer format versions a reader implements."""
READABLE_FILE_FORMAT_VERSIONS = (FORMAT_VERSION, PARTS_FORMAT_VERSION)
"""File format versions a reader implements (the files of format 3 buckets are 1 and 2)."""
POINTER_PATH = "latest.json"
HISTORY_PATH = "history.jsonl"
CODECS = ("raw", "zstd")
_INDEX_SUFFIX = ":indices"
_VALUE_SUFFIX = ":values"
_ZSTD_PREFIX = "zstd:"
_STREAMS = ("gap_lo", "gap_hi_mask", "gap_hi", "gap_big", "sym", "esc_lo", "esc_hi")
_INT32_LIMIT = 2**31 - 1
_PATH_RE = re.compile(r"^(anchors|deltas)/\d{8,}(\.part\d+)?\.safetensors$")


def anchor_path(version: int) -> str:
    return f"anchors/{version:08d}.safetensors"


def delta_path(version: int) -> str:
    return f"deltas/{version:08d}.safetensors"


def part_path(kind: str, version: int, part: int) -> str:
    """Part ``part`` of a version written by several writers (format version 2)."""
    return f"{kind}s/{version:08d}.part{part}.safetensors"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------- strict parsing
#
# Everything in a bucket may have been written by someone else: a reader parses it with
# limits (size, nesting, digits), checks each number's type and range before using it, and
# never allocates from a number it has not checked. Anything else is a FormatError that
# names the file and the field.

MAX_POINTER_BYTES = 32 << 20
"""The largest pointer a reader accepts (a 1000-version chain is about 250 KB)."""
MAX_HISTORY_BYTES = 64 << 20
"""The largest history a publisher reads back; a longer one is ignored (it is informative only)."""
MAX_COUNT = 2**50
"""Upper bound of every element count, byte size and version in a bucket."""
_MAX_INT_DIGITS = 16
_MAX_DEPTH = 8
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
# A string (or an unterminated one, up to the end) or a bracket. The string matches at the
# first try, and possessive loops keep no backtracking state (a plain (?:a|b)* costs ~100
# bytes per character).
_TOKEN_RE = re.compile(rb'"[^"\\]*+(?:\\.?[^"\\]*+)*+(?:"|\Z)|[\[\]{}]', re.DOTALL)
_META_INT_RE = re.compile(r"(?:0|[1-9][0-9]{0,15})\Z", re.ASCII)
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{16}\Z", re.ASCII)
_SHA256_RE = re.compile(r"[0-9a-f]{64}\Z", re.ASCII)
_MIN_WINDOW = 1 << 20


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
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text)} digits (at most {_MAX_INT_DIGITS})")
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
    max_depth: int = _MAX_DEPTH,
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


def _check_hex(value: object, pattern: re.Pattern[str], *, where: str, field: str) -> None:
    if not isinstance(value, str) or not pattern.match(value):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        digits = 16 if pattern is _FINGERPRINT_RE else 64
        raise FormatError(f"{where}: {field} must be {digits} lower-case hex digits, got {shown}")


def _check_pointer_body(body: dict[str, Any], where: str) -> None:
    """Types and ranges of the pointer's fields, before anything is built from them."""
    for key in ("format_version", "version", "anchor", "total", "root", "base"):
        if key in body:
            check_int(body[key], where=where, field=key)
    for key in ("fingerprint", "base_fingerprint"):
        if key in body:
            _check_hex(body[key], _FINGERPRINT_RE, where=where, field=key)
    chain = body.get("chain")
    if not isinstance(chain, list):
        raise FormatError(f"{where}: chain must be a list, got {type(chain).__name__}")
    lists = [("chain", chain)]
    version = body.get("version")
    if body.get("format_version") == CHAIN_FORMAT_VERSION:
        anchors = body.get("anchors")
        if not isinstance(anchors, list) or not anchors or len(anchors) > MAX_ANCHORS:
            shown = f"a list of {len(anchors)}" if isinstance(anchors, list) else type(anchors).__name__
            raise FormatError(f"{where}: anchors must be a list of 1 to {MAX_ANCHORS} entries, got {shown}")
        lists.append(("anchors", anchors))
        first = body.get("base")
    else:
        first = body.get("anchor")
        if isinstance(first, int):
            first -= 1  # a format 1/2 chain starts with the anchor itself
    if isinstance(version, int) and isinstance(first, int) and len(chain) != version - first:
        # Checked before anything is built from version - base (which may be 10**15).
        got = [item.get("version") if isinstance(item, dict) else None for item in chain[:20]]
        raise FormatError(
            f"{where}: the chain must list versions {first + 1}..{version} in order, got {got}"
            + (f" and {len(chain) - 20} more" if len(chain) > 20 else "")
        )
    for label, items in lists:
        for i, item in enumerate(items):
            field = f"{label}[{i}]"
            if not isinstance(item, dict):
                raise FormatError(f"{where}: {field} must be an object, got {type(item).__name__}")
            for key in ("version", "nbytes", "changed"):
                if key in item:
                    check_int(item[key], where=where, field=f"{field}.{key}")
            for key in ("kind", "path"):
                if key in item and (not isinstance(item[key], str) or not item[key].isascii()):
                    raise FormatError(f"{where}: {field}.{key} must be an ASCII string, got {item[key]!r:.60}")
            if "sha256" in item:
                _check_hex(item["sha256"], _SHA256_RE, where=where, field=f"{field}.sha256")
            if "fingerprint" in item:
                _check_hex(item["fingerprint"], _FINGERPRINT_RE, where=where, field=f"{field}.fingerprint")
            if "parts" in item:
                _check_part_items(item["parts"], where=where, field=field, version=item.get("version"))
            path, v = item.get("path"), item.get("version")
            if isinstance(path, str) and isinstance(v, int):
                digits = re.match(r"(?:anchors|deltas)/([0-9]{8,16})[.]", path, re.ASCII)
                if digits is None or int(digits.group(1)) != v:
                    raise FormatError(f"{where}: version {v} names an invalid path {path[:80]!r}")


#: At most this many anchors in a pointer (``keep_anchors`` is bounded by it).
MAX_ANCHORS = 1024


#: At most this many parts per version (one per trainer rank that writes).
MAX_PARTS = 65536


def _check_part_items(parts: Any, *, where: str, field: str, version: Any) -> None:
    """Types and ranges of a split version's part list, before anything is built from it."""
    if not isinstance(parts, list) or len(parts) > MAX_PARTS:
        kind = f"a list of {len(parts)} items" if isinstance(parts, list) else type(parts).__name__
        raise FormatError(f"{where}: {field}.parts must be a list of at most {MAX_PARTS} parts, got {kind}")
    for j, part in enumerate(parts):
        pfield = f"{field}.parts[{j}]"
        if not isinstance(part, dict):
            raise FormatError(f"{where}: {pfield} must be an object, got {type(part).__name__}")
        for key in ("nbytes", "changed"):
            if key in part:
                check_int(part[key], where=where, field=f"{pfield}.{key}")
        path = part.get("path")
        if path is not None and (not isinstance(path, str) or not path.isascii()):
            raise FormatError(f"{where}: {pfield}.path must be an ASCII string, got {path!r:.60}")
        if "sha256" in part:
            _check_hex(part["sha256"], _SHA256_RE, where=where, field=f"{pfield}.sha256")
        if isinstance(path, str) and isinstance(version, int):
            digits = re.match(r"(?:anchors|deltas)/([0-9]{8,16})[.]", path, re.ASCII)
            if digits is None or int(digits.group(1)) != version:
                raise FormatError(f"{where}: version {version} names an invalid part path {path[:80]!r}")


def _check_metadata(meta: Mapping[str, str], where: str) -> None:
    """Metadata integers are plain ASCII decimals (no sign, spaces, '_' or leading zeros)."""
    for key in ("version", "anchor", "params", "changed", "total", "base", "part", "parts"):
        value = meta.get(key)
        if value is None or (key == "base" and value == "none"):
            continue
        if not isinstance(value, str) or not _META_INT_RE.match(value):
            raise FormatError(
                f"{where}: invalid metadata ({key}={value!r:.60} is not a plain decimal integer "
                f"below 10**{_MAX_INT_DIGITS})"
            )
    for key in ("fingerprint", "base_fingerprint"):
        if key in meta:
            _check_hex(meta[key], _FINGERPRINT_RE, where=where, field=f"metadata {key}")
    if "changed" in meta and "total" in meta and int(meta["changed"]) > int(meta["total"]):
        raise FormatError(f"{where}: metadata changed={meta['changed']} exceeds total={meta['total']}")


_ST_DTYPES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1, "I8": 1, "BOOL": 1}


def _check_tensor_table(table: Mapping[str, Any], data_bytes: int, where: str) -> None:
    """Every tensor's dtype, shape and offsets, checked before the safetensors library sees them."""

    def bad(field: str, problem: str) -> FormatError:
        return FormatError(f"{where}: not a readable safetensors file ({field} {problem})")

    for name, info in table.items():
        if name == "__metadata__":
            continue
        field = f"tensor {name[:80]!r}"
        if not isinstance(info, dict):
            raise bad(field, "must be an object in the safetensors header")
        dtype = info.get("dtype")
        itemsize = _ST_DTYPES.get(dtype) if isinstance(dtype, str) else None
        if itemsize is None:
            raise bad(field, f"has an unsupported dtype {dtype!r:.40}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or len(shape) > 8:
            raise bad(field, "has an invalid shape (a list of at most 8 sizes)")
        numel = 1
        for dim in shape:
            numel *= check_int(dim, where=where, field=f"{field} shape")
            if numel > MAX_COUNT:
                raise bad(field, f"claims more than {MAX_COUNT} elements")
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise bad(field, "has invalid data_offsets")
        begin = check_int(offsets[0], where=where, field=f"{field} data_offsets")
        end = check_int(offsets[1], where=where, field=f"{field} data_offsets")
        if not begin <= end <= data_bytes or end - begin != numel * itemsize:
            raise bad(field, f"data_offsets {offsets} do not fit its shape {shape} or the {data_bytes} data bytes of the file")


def _bounded_decompress(blob: bytes, expected: int) -> bytes:
    """Decompress at most ``expected + 1`` bytes, whatever the frame header claims.

    The one-shot API trusts a frame's declared content size (a 1 KB frame can ask for a
    terabyte). Streaming with a bounded window keeps memory at ``expected`` plus a constant.
    """
    window = max(_MIN_WINDOW, 1 << max(expected - 1, 1).bit_length())
    dctx = zstandard.ZstdDecompressor(max_window_size=window)
    out = bytearray()
    with dctx.stream_reader(io.BytesIO(blob), read_across_frames=False) as reader:
        while len(out) <= expected:
            chunk = reader.read(expected + 1 - len(out))
            if not chunk:
                break
            out += chunk
    return bytes(out)


# --------------------------------------------------------------------------- the pointer


@dataclass(frozen=True, kw_only=True)
class PartEntry:
    """One file of a committed version: where it is and what its bytes must be."""

    path: str
    nbytes: int
    sha256: str
    changed: int
    """Elements this file sets."""

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "nbytes": self.nbytes, "sha256": self.sha256, "changed": self.changed}


@dataclass(frozen=True, kw_only=True)
class ChainEntry:
    """One committed version that a reader on the newest anchor may need."""

    version: int
    """The version this file brings the state to."""
    kind: str
    """"anchor" or "delta"."""
    path: str
    """The file's path in the bucket."""
    nbytes: int
    """The file's exact size; a reader refuses a file of another size."""
    sha256: str
    """SHA-256 of the file's bytes, hex; a reader refuses a file that does not match."""
    fingerprint: str
    """Fingerprint of the full state after this version."""
    changed: int
    """Elements changed by this version (for an anchor: every element)."""
    parts: tuple[PartEntry, ...] = ()
    """A version written by several writers: its part files, in part order. ``path`` and
    ``sha256`` are then empty and ``nbytes`` is the sum over the parts."""

    @property
    def files(self) -> tuple[PartEntry, ...]:
        """The files of this version: its parts, or its one file."""
        if self.parts:
            return self.parts
        return (PartEntry(path=self.path, nbytes=self.nbytes, sha256=self.sha256, changed=self.changed),)

    def to_json(self) -> dict[str, Any]:
        if self.parts:
            return {
                "version": self.version,
                "kind": self.kind,
                "nbytes": self.nbytes,
                "fingerprint": self.fingerprint,
                "changed": self.changed,
                "parts": [part.to_json() for part in self.parts],
            }
        return {
            "version": self.version,
            "kind": self.kind,
            "path": self.path,
            "nbytes": self.nbytes,
            "sha256": self.sha256,
            "fingerprint": self.fingerprint,
            "changed": self.changed,
        }


@dataclass(frozen=True, kw_only=True)
class Pointer:
    """The commit point: the newest committed version, the deltas that lead to it, and the
    complete anchors a reader without a usable state starts from.

    ``chain`` holds the deltas of versions ``base + 1 .. version``; a reader whose state is at
    one of the versions ``base .. version`` with that version's fingerprint replays deltas
    only. ``anchors`` are the complete anchors kept (ascending, each at a version in
    ``base .. version``); a reader without a usable state loads the newest one at or below its
    target and replays the deltas after it. ``root`` is the version the chain grew from (the
    first version a writer published: it has an anchor and no delta), which every delta names
    as its ``anchor`` in its metadata.
    """

    version: int
    fingerprint: str
    total: int
    """Elements in the full state."""
    root: int
    base: int
    base_fingerprint: str
    """Fingerprint of the state at ``base``."""
    anchors: tuple[ChainEntry, ...]
    chain: tuple[ChainEntry, ...] = field(default_factory=tuple)
    """Delta entries of versions ``base + 1 .. version``."""

    @property
    def anchor(self) -> int:
        """The newest complete anchor's version."""
        return self.anchors[-1].version

    def delta(self, version: int) -> ChainEntry:
        """The delta entry of ``version`` (``KeyError`` if the chain does not hold it)."""
        index = version - self.base - 1
        if 0 <= index < len(self.chain):
            return self.chain[index]
        raise KeyError(version)

    def entry(self, version: int) -> ChainEntry:
        """The delta of ``version`` if the chain holds it, else its anchor (``KeyError`` if neither)."""
        try:
            return self.delta(version)
        except KeyError:
            for item in self.anchors:
                if item.version == version:
                    return item
            raise

    def fingerprint_at(self, version: int) -> str | None:
        """The fingerprint of the state at ``version``, if the pointer knows it (``base .. version``)."""
        if version == self.base:
            return self.base_fingerprint
        try:
            return self.delta(version).fingerprint
        except KeyError:
            return None

    def replays_from(self, version: int | None, fingerprint: str | None) -> bool:
        """Whether a state at ``version`` with ``fingerprint`` reaches every newer version by deltas."""
        return version is not None and fingerprint is not None and self.fingerprint_at(version) == fingerprint

    def anchor_for(self, target: int) -> ChainEntry | None:
        """The newest complete anchor at or below ``target``, or None."""
        found = None
        for item in self.anchors:
            if item.version <= target:
                found = item
        return found

    @classmethod
    def from_chain(
        cls, *, version: int, anchor: int, fingerprint: str, total: int, chain: Sequence[ChainEntry],
        where: str = POINTER_PATH,
    ) -> Pointer:
        """A pointer as formats 1 and 2 lay it out: one chain, the anchor first, then the deltas."""
        if not chain or chain[0].version != anchor:
            raise FormatError(
                f"{where}: the chain must list versions {anchor}..{version} in order, "
                f"got {[item.version for item in chain[:20]]}"
            )
        if chain[0].kind != "anchor":
            raise FormatError(f"{where}: version {anchor} should be an anchor, not {chain[0].kind!r}")
        return cls(
            version=version, fingerprint=fingerprint, total=total, root=anchor, base=anchor,
            base_fingerprint=chain[0].fingerprint, anchors=tuple(chain[:1]), chain=tuple(chain[1:]),
        )

    @classmethod
    def start(cls, anchor: ChainEntry, *, total: int) -> Pointer:
        """The pointer of a chain's first version, which has an anchor and no delta."""
        return cls(
            version=anchor.version, fingerprint=anchor.fingerprint, total=total, root=anchor.version,
            base=anchor.version, base_fingerprint=anchor.fingerprint, anchors=(anchor,),
        )

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "format_version": CHAIN_FORMAT_VERSION,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "total": self.total,
            "root": self.root,
            "base": self.base,
            "base_fingerprint": self.base_fingerprint,
            "anchor": self.anchor,
            "anchors": [item.to_json() for item in self.anchors],
            "chain": [item.to_json() for item in self.chain],
        }
        return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = POINTER_PATH) -> Pointer:
        try:
            body = parse_json(data, where=where, what="the pointer", max_bytes=MAX_POINTER_BYTES)
        except FormatError as exc:
            if exc.__cause__ is None:  # a limit, already worded
                raise
            raise FormatError(f"{where}: not a deltasync pointer (invalid JSON: {exc.__cause__})") from exc
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not a deltasync pointer (format is not {FORMAT_NAME!r})")
        if body.get("format_version") not in READABLE_FORMAT_VERSIONS:
            raise FormatError(
                f"{where}: format_version {body.get('format_version')!r} is not supported "
                f"(this deltasync reads {', '.join(map(str, READABLE_FORMAT_VERSIONS))}); upgrade deltasync"
            )
        _check_pointer_body(body, where)
        try:
            chain = tuple(_chain_entry(item) for item in body["chain"])
            if body["format_version"] == CHAIN_FORMAT_VERSION:
                pointer = cls(
                    version=int(body["version"]),
                    fingerprint=str(body["fingerprint"]),
                    total=int(body["total"]),
                    root=int(body["root"]),
                    base=int(body["base"]),
                    base_fingerprint=str(body["base_fingerprint"]),
                    anchors=tuple(_chain_entry(item) for item in body["anchors"]),
                    chain=chain,
                )
                if int(body["anchor"]) != pointer.anchor:
                    raise FormatError(f"{where}: anchor {body['anchor']} is not the newest of its anchors ({pointer.anchor})")
            else:
                pointer = cls.from_chain(
                    version=int(body["version"]),
                    anchor=int(body["anchor"]),
                    fingerprint=str(body["fingerprint"]),
                    total=int(body["total"]),
                    chain=chain,
                    where=where,
                )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: malformed pointer ({exc!r})") from exc
        pointer._check(where)
        if body["format_version"] == FORMAT_VERSION and any(item.parts for item in (*pointer.anchors, *pointer.chain)):
            raise FormatError(f"{where}: a format_version 1 pointer cannot list part files (that needs version 2)")
        return pointer

    def _check(self, where: str) -> None:
        if not self.root <= self.base <= self.version:
            raise FormatError(f"{where}: root {self.root}, base {self.base} and version {self.version} are out of order")
        expected = list(range(self.base + 1, self.version + 1))
        if [item.version for item in self.chain] != expected:
            raise FormatError(
                f"{where}: the chain must list versions {self.base + 1}..{self.version} in order, "
                f"got {[item.version for item in self.chain][:20]}"
            )
        versions = [item.version for item in self.anchors]
        if not versions or versions != sorted(set(versions)) or versions[0] < self.base or versions[-1] > self.version:
            raise FormatError(
                f"{where}: anchors must be distinct ascending versions within {self.base}..{self.version}, got {versions[:20]}"
            )
        for kind, items in (("anchor", self.anchors), ("delta", self.chain)):
            for item in items:
                if item.kind != kind:
                    article = "an" if kind == "anchor" else "a"
                    raise FormatError(f"{where}: version {item.version} should be {article} {kind}, not {item.kind!r}")
                if item.parts:
                    _check_parts(item, where)
                elif not _PATH_RE.match(item.path) or not item.path.startswith(kind + "s/"):
                    raise FormatError(f"{where}: version {item.version} names an invalid path {item.path!r}")
        for item in self.anchors:
            if self.fingerprint_at(item.version) not in (None, item.fingerprint):
                raise FormatError(f"{where}: the anchor of version {item.version} disagrees with the chain's fingerprint")
        if self.fingerprint_at(self.version) != self.fingerprint:
            raise FormatError(f"{where}: the pointer's fingerprint disagrees with its last chain entry")


def _chain_entry(item: dict[str, Any]) -> ChainEntry:
    if isinstance(item, dict) and "parts" in item:
        return _multi_part_entry(item)
    return ChainEntry(
        version=int(item["version"]),
        kind=str(item["kind"]),
        path=str(item["path"]),
        nbytes=int(item["nbytes"]),
        sha256=str(item["sha256"]),
        fingerprint=str(item["fingerprint"]),
        changed=int(item["changed"]),
    )


def _multi_part_entry(item: dict[str, Any]) -> ChainEntry:
    parts = tuple(
        PartEntry(
            path=str(part["path"]),
            nbytes=int(part["nbytes"]),
            sha256=str(part["sha256"]),
            changed=int(part["changed"]),
        )
        for part in item["parts"]
    )
    return ChainEntry(
        version=int(item["version"]),
        kind=str(item["kind"]),
        path="",
        nbytes=int(item["nbytes"]),
        sha256="",
        fingerprint=str(item["fingerprint"]),
        changed=int(item["changed"]),
        parts=parts,
    )


def _check_parts(item: ChainEntry, where: str) -> None:
    if len(item.parts) < 2:
        raise FormatError(f"{where}: version {item.version} lists {len(item.parts)} part(s); a split version has at least 2")
    for number, part in enumerate(item.parts):
        expected = part_path(item.kind, item.version, number)
        if part.path != expected:
            raise FormatError(
                f"{where}: part {number} of version {item.version} is named {part.path!r}, expected {expected!r}"
            )
    if sum(part.nbytes for part in item.parts) != item.nbytes:
        raise FormatError(f"{where}: version {item.version}'s nbytes is not the sum of its parts' sizes")
    if sum(part.changed for part in item.parts) != item.changed:
        raise FormatError(f"{where}: version {item.version}'s changed count is not the sum of its parts'")


# --------------------------------------------------------------------------- file headers


@dataclass(frozen=True, kw_only=True)
class FileHeader:
    """The metadata every anchor and delta carries."""

    kind: str
    version: int
    base: int | None
    """The version a delta applies to (version - 1); None for an anchor."""
    anchor: int
    """The anchor this file descends from (an anchor names itself)."""
    codec: str
    params: int
    """Parameters in the file."""
    changed: int
    """Elements in the file (for an anchor: every element)."""
    total: int
    """Elements in the full state."""
    fingerprint: str
    """Fingerprint of the full state after applying the file."""
    base_fingerprint: str | None = None
    """Fingerprint of the state a delta applies to."""
    names: tuple[str, ...] | None = None
    """zstd deltas: the changed parameters, in the order their elements are stored."""
    part: int | None = None
    """A split version (format version 2): this file's part number, ``0 .. parts - 1``."""
    parts: int | None = None
    """A split version: how many parts it has."""
    slices: tuple[tuple[str, tuple[int, ...], int, int], ...] | None = None
    """An anchor part: ``(name, full shape, begin, end)`` per parameter of the state, in name
    order; the part holds flat elements ``begin .. end - 1`` of each."""

    def to_metadata(self) -> dict[str, str]:
        meta = {
            "format": FORMAT_NAME,
            "format_version": str(FORMAT_VERSION if self.parts is None else PARTS_FORMAT_VERSION),
            "kind": self.kind,
            "version": str(self.version),
            "base": "none" if self.base is None else str(self.base),
            "anchor": str(self.anchor),
            "codec": self.codec,
            "params": str(self.params),
            "changed": str(self.changed),
            "total": str(self.total),
            "fingerprint": self.fingerprint,
        }
        if self.base_fingerprint is not None:
            meta["base_fingerprint"] = self.base_fingerprint
        if self.names is not None:
            meta["names"] = json.dumps(list(self.names), separators=(",", ":"))
        if self.parts is not None:
            meta["part"] = str(self.part)
            meta["parts"] = str(self.parts)
        if self.slices is not None:
            meta["slices"] = json.dumps([[n, list(s), b, e] for n, s, b, e in self.slices], separators=(",", ":"))
        return meta

    @classmethod
    def from_metadata(cls, meta: Mapping[str, str] | None, *, where: str) -> FileHeader:
        if not meta or meta.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not a deltasync file (its metadata has no format={FORMAT_NAME!r})")
        if meta.get("format_version") not in {str(v) for v in READABLE_FILE_FORMAT_VERSIONS}:
            raise FormatError(
                f"{where}: format_version {meta.get('format_version')!r} is not supported "
                f"(this deltasync reads files of {', '.join(map(str, READABLE_FILE_FORMAT_VERSIONS))}); upgrade deltasync"
            )
        _check_metadata(meta, where)
        split = meta["format_version"] == str(PARTS_FORMAT_VERSION)
        try:
            kind = meta["kind"]
            if kind not in ("anchor", "delta"):
                raise ValueError(f"kind {kind!r} is neither 'anchor' nor 'delta'")
            codec = meta["codec"]
            if codec not in CODECS:
                raise ValueError(f"codec {codec!r} is unknown (known: {', '.join(CODECS)})")
            names = None
            if "names" in meta:
                names = parse_json(
                    meta["names"], where=where, what="metadata names", max_bytes=_MAX_HEADER_BYTES, max_depth=1
                )
                if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                    raise ValueError("'names' is not a JSON list of strings")
                names = tuple(names)
            header = cls(
                kind=kind,
                version=int(meta["version"]),
                base=None if meta["base"] == "none" else int(meta["base"]),
                anchor=int(meta["anchor"]),
                codec=codec,
                params=int(meta["params"]),
                changed=int(meta["changed"]),
                total=int(meta["total"]),
                fingerprint=meta["fingerprint"],
                base_fingerprint=meta.get("base_fingerprint"),
                names=names,
                **(_part_fields(meta, kind, where) if split else {}),
            )
        except KeyError as exc:
            raise FormatError(f"{where}: metadata lacks the key {exc}") from exc
        except (ValueError, TypeError) as exc:
            raise FormatError(f"{where}: invalid metadata ({exc})") from exc
        if kind == "delta" and header.base_fingerprint is None:
            raise FormatError(f"{where}: a delta must name its base_fingerprint")
        if kind == "delta" and header.base != header.version - 1:
            raise FormatError(f"{where}: delta {header.version} names base {header.base}, expected {header.version - 1}")
        if kind == "anchor" and (header.base is not None or header.anchor != header.version):
            raise FormatError(f"{where}: anchor {header.version} must name itself as anchor and no base")
        return header


#: Largest 'slices' metadata value a reader parses (an anchor part lists each parameter once).
MAX_SLICES_BYTES = 64 << 20


def _part_fields(meta: Mapping[str, str], kind: str, where: str) -> dict[str, Any]:
    """The metadata keys only a part of a split version (format version 2) carries."""
    part, parts = int(meta["part"]), int(meta["parts"])
    if not 0 <= part < parts:
        raise ValueError(f"part {part} is outside 0..{parts - 1}")
    fields: dict[str, Any] = {"part": part, "parts": parts}
    if kind == "anchor":
        raw = parse_json(meta["slices"], where=where, what="'slices'", max_bytes=MAX_SLICES_BYTES)
        if not isinstance(raw, list):
            raise ValueError("'slices' is not a JSON list")
        slices = []
        for item in raw:
            if not isinstance(item, list) or len(item) != 4:
                raise ValueError(f"'slices' entry {item!r:.80} is not [name, shape, begin, end]")
            name, shape, begin, end = item
            if (
                not isinstance(name, str)
                or not isinstance(shape, list)
                or len(shape) > 8
                or not all(type(d) is int and d >= 0 for d in shape)
                or type(begin) is not int
                or type(end) is not int
                or not 0 <= begin <= end <= math.prod(shape)
            ):
                raise ValueError(f"'slices' entry {item!r} is not [name, shape, begin, end] within the shape")
            slices.append((name, tuple(shape), begin, end))
        fields["slices"] = tuple(slices)
    return fields


# --------------------------------------------------------------------------- container


_DTYPES = {
    torch.float64: ("F64", 8),
    torch.int64: ("I64", 8),
    torch.float32: ("F32", 4),
    torch.int32: ("I32", 4),
    torch.bfloat16: ("BF16", 2),
    torch.float16: ("F16", 2),
    torch.int16: ("I16", 2),
    torch.uint8: ("U8", 1),
    torch.int8: ("I8", 1),
    torch.bool: ("BOOL", 1),
}


def _safetensors_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """Serialize like ``safetensors.torch.save``, with metadata keys sorted (deterministic)."""
    items = [
        TensorChunks(name, t.dtype, tuple(t.shape), lambda t=t: (t.detach().reshape(-1),)) for name, t in tensors.items()
    ]
    return b"".join(safetensors_stream(items, metadata))


@dataclass(frozen=True)
class TensorChunks:
    """A tensor to serialize, given by its flat values in consecutive chunks (so that no
    serializer ever needs the whole tensor, or the whole file, in memory at once)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[torch.Tensor]]
    """Yields 1-D tensors of ``dtype`` that together hold the flat values, in order."""


def safetensors_stream(tensors: Sequence[TensorChunks], metadata: Mapping[str, str]) -> Iterator[memoryview]:
    """The bytes of a safetensors file, header first, then each tensor's data chunk by chunk.

    The layout is the safetensors library's (tensors ordered by alignment, then name; the
    header padded with spaces to 8 bytes), with metadata keys sorted. A chunk may be a view of
    the caller's memory: it is valid until the next one is asked for.
    """
    order = sorted(tensors, key=lambda t: (-_DTYPES[t.dtype][1], t.name))
    header: dict[str, Any] = {"__metadata__": {key: metadata[key] for key in sorted(metadata)}}
    offset = 0
    for item in order:
        nbytes = math.prod(item.shape) * _DTYPES[item.dtype][1]
        header[item.name] = {"dtype": _DTYPES[item.dtype][0], "shape": list(item.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield memoryview(struct.pack("<Q", len(text)) + text)
    for item in order:
        expected, written = header[item.name]["data_offsets"][1] - header[item.name]["data_offsets"][0], 0
        for chunk in item.chunks():
            if chunk.dtype != item.dtype:
                raise FormatError(f"{item.name!r}: a chunk of {chunk.dtype} in a {item.dtype} tensor")
            if not chunk.numel():
                continue
            data = chunk.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
            written += data.nbytes
            if written > expected:
                break
            yield memoryview(data)
        if written != expected:
            raise FormatError(f"{item.name!r}: its chunks hold {written} bytes, its shape {list(item.shape)} needs {expected}")


def read_header(data: bytes, *, where: str) -> FileHeader:
    """Parse only the header of a file (cheap: the tensors are not decoded)."""
    return parse_header(data, where=where)[1]


def header_length(prefix: bytes, *, where: str, file_bytes: int) -> int:
    """The length of the JSON header a file of ``file_bytes`` bytes announces in its first 8
    bytes (``prefix``), checked against the file and the safetensors library's limit."""
    if file_bytes < 8 or len(prefix) < 8:
        raise FormatError(f"{where}: truncated ({file_bytes} bytes; a safetensors file has at least 8)")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length > file_bytes - 8:
        raise FormatError(f"{where}: truncated (header says {length} bytes, file has {file_bytes - 8} after it)")
    if length > _MAX_HEADER_BYTES:
        raise FormatError(f"{where}: the safetensors header is {length} bytes, more than {_MAX_HEADER_BYTES}")
    return length


def parse_header(data: bytes, *, where: str, file_bytes: int | None = None) -> tuple[dict[str, Any], FileHeader]:
    """The checked tensor table and the header of a file. ``data`` is the whole file, or, with
    ``file_bytes`` (the file's size), at least its first ``8 +`` :func:`header_length` bytes."""
    size = len(data) if file_bytes is None else file_bytes
    length = header_length(data, where=where, file_bytes=size)
    if len(data) < 8 + length:
        raise FormatError(f"{where}: truncated (header says {length} bytes, {len(data) - 8} were read)")
    try:
        table = parse_json(
            data[8 : 8 + length], where=where, what="the safetensors header", max_bytes=_MAX_HEADER_BYTES, max_depth=3
        )
    except FormatError as exc:
        if exc.__cause__ is None:  # a limit, already worded
            raise
        raise FormatError(f"{where}: unreadable safetensors header ({exc.__cause__})") from exc
    if not isinstance(table, dict):
        raise FormatError(f"{where}: unreadable safetensors header (not a JSON object)")
    meta = table.get("__metadata__")
    if meta is not None and (
        not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())
    ):
        raise FormatError(f"{where}: unreadable safetensors header (__metadata__ is not an object of strings)")
    _check_tensor_table(table, size - 8 - length, where)
    return table, FileHeader.from_metadata(meta, where=where)


@dataclass(frozen=True)
class TensorSpan:
    """Where a tensor's bytes lie in a file's data section (after the header)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def tensor_spans(table: Mapping[str, Any], *, where: str, data_bytes: int) -> list[TensorSpan]:
    """The tensors of a table :func:`parse_header` checked, in data order; they must tile the
    ``data_bytes`` data bytes exactly (no overlap, no gap, nothing after the last)."""
    spans = sorted(
        (
            TensorSpan(name, _TORCH_DTYPES[info["dtype"]], tuple(info["shape"]), *info["data_offsets"])
            for name, info in table.items()
            if name != "__metadata__"
        ),
        key=lambda span: (span.begin, span.end),
    )
    position = 0
    for span in spans:
        if span.begin != position:
            raise FormatError(
                f"{where}: not a readable safetensors file (tensor {span.name[:80]!r} starts at data byte {span.begin}, "
                f"the tensors before it end at {position}: overlapping or with gaps)"
            )
        position = span.end
    if position != data_bytes:
        raise FormatError(f"{where}: not a readable safetensors file ({data_bytes - position} bytes after the last tensor)")
    return spans


def _load(data: bytes, *, where: str) -> dict[str, torch.Tensor]:
    try:
        return _st_load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise FormatError(f"{where}: not a readable safetensors file ({exc})") from exc


_TORCH_DTYPES = {code: dtype for dtype, (code, _) in _DTYPES.items()}


def load_tensors(data: bytes | bytearray, *, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a file whose header :func:`read_header` accepted.

    From a ``bytearray`` they are views of it (no copy); the buffer must then be left alone.
    From ``bytes`` the safetensors library copies them out.
    """
    if not isinstance(data, bytearray):
        return _load(data, where=where)
    (length,) = struct.unpack("<Q", data[:8])
    start = 8 + length
    spans = tensor_spans(json.loads(bytes(data[8:start])), where=where, data_bytes=len(data) - start)
    out: dict[str, torch.Tensor] = {}
    for span in spans:
        itemsize = _DTYPES[span.dtype][1]
        if (start + span.begin) % itemsize:
            return _load(data, where=where)  # misaligned: let the library copy it
        if span.end > span.begin:
            count = (span.end - span.begin) // itemsize
            out[span.name] = torch.frombuffer(data, dtype=span.dtype, count=count, offset=start + span.begin).view(span.shape)
        else:
            out[span.name] = torch.empty(span.shape, dtype=span.dtype)
    return out


# --------------------------------------------------------------------------- anchors


def encode_anchor(
    state: Mapping[str, torch.Tensor],
    *,
    version: int,
    fingerprint: str,
    extra_metadata: Mapping[str, str] | None = None,
) -> bytes:
    """An anchor: every parameter, in bf16, under its checkpoint name.

    ``extra_metadata``: further metadata keys, each starting with ``x-`` (e.g. the PEFT
    adapter config of an adapter bucket, see :mod:`deltasync._lora`); readers that do not
    know a key ignore it."""
    for name, tensor in state.items():
        if tensor.dtype != torch.bfloat16:
            raise FormatError(f"anchor {version}: parameter {name!r} is {tensor.dtype}, anchors hold bfloat16")
    sources = [
        AnchorSource(name, tuple(t.shape), 0, t.numel(), lambda t=t: (t.detach().reshape(-1),)) for name, t in state.items()
    ]
    total = sum(t.numel() for t in state.values())
    return b"".join(anchor_stream(sources, version=version, fingerprint=fingerprint, total=total, extra_metadata=extra_metadata))


@dataclass(frozen=True)
class AnchorSource:
    """Flat elements ``begin .. end - 1`` of parameter ``name`` (full shape ``shape``), given
    as consecutive bf16 chunks, for :func:`anchor_stream`."""

    name: str
    shape: tuple[int, ...]
    begin: int
    end: int
    chunks: Callable[[], Iterable[torch.Tensor]]


def anchor_stream(
    sources: Sequence[AnchorSource],
    *,
    version: int,
    fingerprint: str,
    total: int,
    part: int | None = None,
    parts: int | None = None,
    extra_metadata: Mapping[str, str] | None = None,
) -> Iterator[memoryview]:
    """The bytes of an anchor (or of part ``part`` of ``parts`` of a split anchor), chunk by chunk.

    A single-file anchor holds every parameter whole, in its shape; a part holds a 1-D slice
    of each parameter (format version 2). The bytes are those :func:`encode_anchor` and
    :func:`~deltasync._parts.encode_anchor_part` give, without the whole file in memory.
    """
    ordered = sorted(sources, key=lambda s: s.name)
    if parts is None and any(s.begin != 0 or s.end != math.prod(s.shape) for s in ordered):
        raise FormatError(f"anchor {version}: a single-file anchor holds every parameter whole")
    header = FileHeader(
        kind="anchor",
        version=version,
        base=None,
        anchor=version,
        codec="raw",
        params=len(ordered),
        changed=sum(s.end - s.begin for s in ordered),
        total=total,
        fingerprint=fingerprint,
        part=part,
        parts=parts,
        slices=None if parts is None else tuple((s.name, tuple(s.shape), s.begin, s.end) for s in ordered),
    )
    meta = with_extra_metadata(header.to_metadata(), extra_metadata, f"anchor {version}")
    tensors = [
        TensorChunks(s.name, torch.bfloat16, s.shape if parts is None else (s.end - s.begin,), s.chunks) for s in ordered
    ]
    return safetensors_stream(tensors, meta)


def with_extra_metadata(metadata: dict[str, str], extra: Mapping[str, str] | None, where: str) -> dict[str, str]:
    """``metadata`` with the ``x-`` keys of ``extra`` added (anything else is a :class:`FormatError`)."""
    for key, value in (extra or {}).items():
        if not key.startswith("x-") or not isinstance(value, str):
            raise FormatError(f"{where}: extra metadata key {key!r} must start with 'x-' and map to a string")
        metadata[key] = value
    return metadata


def read_metadata(data: bytes, *, where: str) -> dict[str, str]:
    """Every metadata key of a file (the header fields and any ``x-`` keys), unvalidated."""
    read_header(data, where=where)  # a deltasync file, or a FormatError
    (length,) = struct.unpack("<Q", data[:8])
    return dict(json.loads(data[8 : 8 + length].decode())["__metadata__"])


def decode_anchor(data: bytes | bytearray, *, where: str) -> tuple[FileHeader, dict[str, torch.Tensor]]:
    """An anchor's header and tensors. From a ``bytearray`` (what stores' ``read_buffer``
    gives) the tensors are views of it: the file and its tensors are never both in memory."""
    header = read_header(data, where=where)
    if header.kind != "anchor":
        raise FormatError(f"{where}: expected an anchor, found a {header.kind}")
    tensors = load_tensors(data, where=where)
    total = 0
    for name, tensor in tensors.items():
        if tensor.dtype != torch.bfloat16:
            raise FormatError(f"{where}: parameter {name!r} is {tensor.dtype}, anchors hold bfloat16")
        total += tensor.numel()
    if len(tensors) != header.params or total != header.total:
        raise FormatError(
            f"{where}: holds {len(tensors)} parameters / {total} elements, "
            f"its metadata says {header.params} / {header.total}"
        )
    return header, tensors


# --------------------------------------------------------------------------- deltas


@dataclass(frozen=True)
class Change:
    """The changed elements of one parameter: sorted flat indices and their new values."""

    index: torch.Tensor
    """int64, 1-D, strictly increasing."""
    new: torch.Tensor
    """bf16, 1-D, the new values."""
    old: torch.Tensor | None = None
    """bf16, 1-D, the values they replace (needed to encode with the zstd codec)."""


def encode_delta(
    changes: Mapping[str, Change],
    *,
    version: int,
    anchor: int,
    codec: str,
    total: int,
    fingerprint: str,
    base_fingerprint: str,
    level: int = 3,
    numels: Mapping[str, int] | None = None,
    part: tuple[int, int] | None = None,
) -> bytes:
    """A delta from ``version - 1`` to ``version``. Parameters with no change are left out.

    ``part=(number, count)`` writes part ``number`` of a version split over ``count`` writers
    (format version 2); its indices are still flat indices of the full parameters.
    """
    if codec not in CODECS:
        raise FormatError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")
    items = [(name, change) for name, change in changes.items() if change.index.numel()]
    changed = sum(change.index.numel() for _, change in items)
    header = FileHeader(
        kind="delta",
        version=version,
        base=version - 1,
        anchor=anchor,
        codec=codec,
        params=len(items),
        changed=changed,
        total=total,
        fingerprint=fingerprint,
        base_fingerprint=base_fingerprint,
        names=tuple(name for name, _ in items) if codec == "zstd" else None,
        part=None if part is None else part[0],
        parts=None if part is None else part[1],
    )
    meta = header.to_metadata()
    if codec == "raw":
        tensors: dict[str, torch.Tensor] = {}
        for name, change in items:
            wide = (numels is not None and numels[name] > _INT32_LIMIT) or int(change.index[-1]) > _INT32_LIMIT
            tensors[name + _INDEX_SUFFIX] = change.index.to(torch.int64 if wide else torch.int32)
            tensors[name + _VALUE_SUFFIX] = change.new.to(torch.bfloat16)
        return _safetensors_bytes(tensors, meta)
    streams, counts = _zstd_streams(items)
    compressor = zstandard.ZstdCompressor(level=level, write_content_size=True)
    tensors = {
        _ZSTD_PREFIX + key: torch.frombuffer(bytearray(compressor.compress(raw)), dtype=torch.uint8)
        if raw
        else torch.zeros(0, dtype=torch.uint8)
        for key, raw in streams.items()
    }
    tensors[_ZSTD_PREFIX + "counts"] = torch.tensor(counts, dtype=torch.int64)
    return _safetensors_bytes(tensors, meta)


_ENCODE_CHUNK = 1 << 16
"""Elements of a parameter's changes that the zstd codec transforms at a time: its wide
temporaries (int64 gaps, int32 differences) stay a few MiB however big the version is."""


def _zstd_streams(items: list[tuple[str, Change]]) -> tuple[dict[str, bytes], list[int]]:
    counts = [change.index.numel() for _, change in items]
    pieces: dict[str, list[np.ndarray]] = {key: [] for key in ("lo", "hi_nz", "hi", "big", "sym", "esc")}
    for name, change in items:
        if change.old is None:
            raise FormatError(f"parameter {name!r}: the zstd codec needs the previous values")
        for start in range(0, change.index.numel(), _ENCODE_CHUNK):
            stop = min(start + _ENCODE_CHUNK, change.index.numel())
            index = change.index[start:stop].to(torch.int64).cpu()
            gap = torch.empty_like(index)
            gap[0] = index[0] if start == 0 else index[0] - int(change.index[start - 1]) - 1
            gap[1:] = index[1:] - index[:-1] - 1
            g = gap.numpy().astype(np.uint64)
            pieces["lo"].append((g & np.uint64(0xFF)).astype(np.uint8))
            hi = g >> np.uint64(8)
            hi_nz = hi != 0
            hv = hi[hi_nz]
            pieces["hi_nz"].append(hi_nz)
            pieces["big"].append(hv[hv >= 255].astype("<u8"))
            pieces["hi"].append(np.minimum(hv, 255).astype(np.uint8))
            # New minus old ordered bit pattern modulo 2**16, as a signed 16-bit number,
            # zigzag-mapped: -1 -> 1, +1 -> 2, -2 -> 3, +2 -> 4, ... Symbols 0..2 stand for
            # zigzag 1..3; 3 escapes.
            d = ((_ordered(change.new[start:stop]) - _ordered(change.old[start:stop])) & 0xFFFF).numpy().astype(np.int32)
            d = np.where(d >= 0x8000, d - 0x10000, d)
            zig = ((d << 1) ^ (d >> 31)).astype(np.uint32)
            if (zig == 0).any():
                raise FormatError("a delta lists changed elements only, but an element's new value equals its old one")
            pieces["sym"].append(np.where(zig <= 3, zig - 1, 3).astype(np.uint8))
            pieces["esc"].append(zig[zig > 3])
    if not items:
        return {key: b"" for key in _STREAMS}, counts
    sym = np.concatenate(pieces["sym"])
    padded = np.zeros(-(-sym.size // 4) * 4, dtype=np.uint8)
    padded[: sym.size] = sym
    quads = padded.reshape(-1, 4)
    packed = (quads[:, 0] | (quads[:, 1] << 2) | (quads[:, 2] << 4) | (quads[:, 3] << 6)).astype(np.uint8)
    esc = np.concatenate(pieces["esc"])
    streams = {
        "gap_lo": np.concatenate(pieces["lo"]).tobytes(),
        "gap_hi_mask": np.packbits(np.concatenate(pieces["hi_nz"]), bitorder="little").tobytes(),
        "gap_hi": np.concatenate(pieces["hi"]).tobytes(),
        "gap_big": np.concatenate(pieces["big"]).tobytes(),
        "sym": packed.tobytes(),
        "esc_lo": (esc & 0xFF).astype(np.uint8).tobytes(),
        "esc_hi": (esc >> 8).astype(np.uint8).tobytes(),
    }
    return streams, counts


def _ordered(values: torch.Tensor) -> torch.Tensor:
    """bf16 -> int32 in [-32768, 32767], monotone in the value: the ordered bit pattern.

    Positive patterns map to themselves, negative ones (sign bit set) to ``0x7FFF - bits``,
    so -0.0 is -1 and +0.0 is 0. Neighbouring bf16 values, across zero too, differ by one.
    """
    bits = values.to(torch.bfloat16).cpu().contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(bits >= 0x8000, 0x7FFF - bits, bits)


def _from_ordered(ordered: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_ordered`, taken modulo 2**16."""
    o = ((ordered + 0x8000) & 0xFFFF) - 0x8000
    bits = torch.where(o < 0, 0x7FFF - o, o)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


BaseLookup = Callable[[str, torch.Tensor], torch.Tensor]
"""(parameter name, int64 indices) -> the receiver's current bf16 values there."""


def decode_delta(
    data: bytes,
    *,
    where: str,
    numels: Mapping[str, int],
    base_values: BaseLookup,
) -> tuple[FileHeader, dict[str, Change]]:
    """Decode and validate a delta against the receiver's parameter sizes.

    ``numels`` maps every parameter the receiver holds to its element count; a name not in it
    is an unknown parameter. ``base_values`` gives current values (the zstd codec stores new
    values relative to them). Nothing outside the returned objects is changed.
    """
    header = read_header(data, where=where)
    if header.kind != "delta":
        raise FormatError(f"{where}: expected a delta, found an {header.kind}")
    tensors = _load(data, where=where)
    if header.codec == "raw":
        changes = _decode_raw(tensors, where=where, numels=numels)
    else:
        changes = _decode_zstd(tensors, header, where=where, numels=numels, base_values=base_values)
    changed = sum(change.index.numel() for change in changes.values())
    if len(changes) != header.params or changed != header.changed:
        raise FormatError(
            f"{where}: holds {len(changes)} parameters / {changed} changed elements, "
            f"its metadata says {header.params} / {header.changed}"
        )
    return header, changes


def _check_index(index: torch.Tensor, name: str, numel: int, where: str) -> None:
    if index.numel() == 0:
        return
    if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
        raise FormatError(f"{where}: indices of parameter {name!r} are not strictly increasing")
    if int(index[0]) < 0 or int(index[-1]) >= numel:
        bad = int(index[-1]) if int(index[-1]) >= numel else int(index[0])
        raise FormatError(
            f"{where}: index {bad} of parameter {name!r} is out of range (it has {numel} elements)"
        )


def _known(name: str, numels: Mapping[str, int], where: str) -> int:
    if name not in numels:
        raise FormatError(f"{where}: unknown parameter {name!r} (not in the receiver's state)")
    return numels[name]


def _decode_raw(
    tensors: Mapping[str, torch.Tensor], *, where: str, numels: Mapping[str, int]
) -> dict[str, Change]:
    changes: dict[str, Change] = {}
    for key in sorted(tensors):
        if key.endswith(_INDEX_SUFFIX):
            name = key[: -len(_INDEX_SUFFIX)]
        elif key.endswith(_VALUE_SUFFIX):
            name = key[: -len(_VALUE_SUFFIX)]
            if name + _INDEX_SUFFIX not in tensors:
                raise FormatError(f"{where}: parameter {name!r} has values but no indices")
            continue
        else:
            raise FormatError(f"{where}: unexpected tensor {key!r} in a raw delta")
        numel = _known(name, numels, where)
        index = tensors[key]
        values = tensors.get(name + _VALUE_SUFFIX)
        if values is None:
            raise FormatError(f"{where}: parameter {name!r} has indices but no values")
        if index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
            raise FormatError(f"{where}: indices of parameter {name!r} must be a 1-D int32/int64 tensor, got {index.dtype} {tuple(index.shape)}")
        if values.dtype != torch.bfloat16 or values.dim() != 1:
            raise FormatError(f"{where}: values of parameter {name!r} must be a 1-D bfloat16 tensor, got {values.dtype} {tuple(values.shape)}")
        if values.numel() != index.numel():
            raise FormatError(f"{where}: parameter {name!r} has {index.numel()} indices but {values.numel()} values")
        index = index.to(torch.int64)
        _check_index(index, name, numel, where)
        changes[name] = Change(index=index, new=values)
    return changes


def _decompress(blob: torch.Tensor, expected: int, key: str, where: str) -> bytes:
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise FormatError(f"{where}: stream {key!r} must be a 1-D uint8 tensor")
    if expected == 0:
        if blob.numel():
            raise FormatError(f"{where}: stream {key!r} should be empty")
        return b""
    data = blob.numpy().tobytes()
    try:
        declared = zstandard.frame_content_size(data)
        if declared not in (-1, expected):  # -1: the frame does not say
            raise FormatError(f"{where}: stream {key!r} decodes to {declared} bytes, expected {expected}")
        raw = _bounded_decompress(data, expected)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{where}: stream {key!r} is not valid zstd data ({exc})") from exc
    if len(raw) != expected:
        got = f"more than {expected}" if len(raw) > expected else str(len(raw))
        raise FormatError(
            f"{where}: stream {key!r} is not valid zstd data (it decodes to {got} bytes, expected {expected})"
        )
    return raw


def _decode_zstd(
    tensors: Mapping[str, torch.Tensor],
    header: FileHeader,
    *,
    where: str,
    numels: Mapping[str, int],
    base_values: BaseLookup,
) -> dict[str, Change]:
    expected_keys = {_ZSTD_PREFIX + key for key in (*_STREAMS, "counts")}
    if set(tensors) != expected_keys:
        extra = sorted(set(tensors) - expected_keys)
        missing = sorted(expected_keys - set(tensors))
        raise FormatError(f"{where}: zstd delta has unexpected tensors {extra} / lacks {missing}")
    if header.names is None:
        raise FormatError(f"{where}: a zstd delta needs the metadata key 'names'")
    names = list(header.names)
    counts_t = tensors[_ZSTD_PREFIX + "counts"]
    if counts_t.dtype != torch.int64 or counts_t.dim() != 1 or counts_t.numel() != len(names):
        raise FormatError(f"{where}: 'zstd:counts' must be int64 with one entry per name ({len(names)})")
    counts = counts_t.tolist()
    for name, count in zip(names, counts):
        numel = _known(name, numels, where)
        if count <= 0 or count > numel:
            raise FormatError(f"{where}: parameter {name!r} claims {count} changes (it has {numel} elements)")
    if len(set(names)) != len(names):
        raise FormatError(f"{where}: a parameter is listed twice in 'names'")
    n = sum(counts)
    if n != header.changed:
        raise FormatError(f"{where}: counts add up to {n}, metadata says {header.changed} changed")
    lo = np.frombuffer(_decompress(tensors["zstd:gap_lo"], n, "gap_lo", where), dtype=np.uint8)
    mask_raw = _decompress(tensors["zstd:gap_hi_mask"], -(-n // 8), "gap_hi_mask", where)
    hi_nz = np.unpackbits(np.frombuffer(mask_raw, dtype=np.uint8), bitorder="little")[:n].astype(bool)
    n_hi = int(hi_nz.sum())
    hv = np.frombuffer(_decompress(tensors["zstd:gap_hi"], n_hi, "gap_hi", where), dtype=np.uint8).astype(np.uint64)
    n_big = int((hv == 255).sum())
    big = np.frombuffer(_decompress(tensors["zstd:gap_big"], 8 * n_big, "gap_big", where), dtype="<u8")
    if n_big and (int(big.min()) < 255 or int(big.max()) >= 2**55):
        raise FormatError(f"{where}: stream 'gap_big' holds a value outside 255..2**55-1")
    hv[hv == 255] = big
    hi = np.zeros(n, dtype=np.uint64)
    hi[hi_nz] = hv
    gaps = torch.from_numpy(((hi << np.uint64(8)) | lo.astype(np.uint64)).astype(np.int64))
    packed = np.frombuffer(_decompress(tensors["zstd:sym"], -(-n // 4), "sym", where), dtype=np.uint8)
    sym = np.stack([(packed >> shift) & 3 for shift in (0, 2, 4, 6)], axis=1).reshape(-1)[:n]
    is_esc = sym == 3
    n_esc = int(is_esc.sum())
    esc_lo = np.frombuffer(_decompress(tensors["zstd:esc_lo"], n_esc, "esc_lo", where), dtype=np.uint8)
    esc_hi = np.frombuffer(_decompress(tensors["zstd:esc_hi"], n_esc, "esc_hi", where), dtype=np.uint8)
    esc = (esc_hi.astype(np.uint32) << 8) | esc_lo
    if n_esc and int(esc.min()) <= 3:
        raise FormatError(f"{where}: the escape streams hold a value that has its own symbol")
    zig = sym.astype(np.uint32) + 1
    zig[is_esc] = esc
    diff = ((zig >> 1) ^ (-(zig & 1).astype(np.int64)).astype(np.uint32)) & 0xFFFF
    diff_t = torch.from_numpy(diff.astype(np.int32))
    changes: dict[str, Change] = {}
    start = 0
    for name, count in zip(names, counts):
        gap = gaps[start : start + count]
        if int(gap.max()) >= numels[name]:
            raise FormatError(
                f"{where}: a gap of {int(gap.max())} in parameter {name!r} is out of range "
                f"(it has {numels[name]} elements)"
            )
        index = torch.cumsum(gap + 1, dim=0) - 1
        if int(index[-1]) >= numels[name] or (count > 1 and not bool((index[1:] > index[:-1]).all())):
            raise FormatError(
                f"{where}: index {int(index[-1])} of parameter {name!r} is out of range "
                f"(it has {numels[name]} elements)"
            )
        new = _from_ordered(_ordered(base_values(name, index)) + diff_t[start : start + count])
        changes[name] = Change(index=index, new=new)
        start += count
    return changes

