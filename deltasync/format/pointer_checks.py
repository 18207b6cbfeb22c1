"""The pointer's JSON checked before anything is built from it, and the limits that bound what a
hostile pointer costs a reader.

:meth:`~deltasync.format.pointer.Pointer.from_bytes` runs these checks in two steps: the raw
bytes first (:func:`check_density`: no more JSON objects, arrays and commas than a pointer of
that size can hold, counted before any is parsed), then the parsed body's types and ranges
(:func:`check_pointer_body`), so that a pointer filled with ``{}`` or with a chain of
10**15 versions is refused at a cost of a few times its size.
"""

from __future__ import annotations

from typing import Any

from ..errors import FormatError
from .limited_json import FINGERPRINT_RE, SHA256_RE, check_hex, check_int
from .paths import VERSIONED_PATH_RE
from .versions import CHAIN_FORMAT_VERSION, MANIFEST_FORMAT_VERSION

__all__ = [
    "MAX_POINTER_BYTES",
    "MAX_ANCHORS",
    "MAX_PARTS",
    "BYTES_PER_CONTAINER",
    "BYTES_PER_COMMA",
    "check_density",
    "check_pointer_body",
]

MAX_POINTER_BYTES = 32 << 20
"""The largest pointer a reader accepts (a 1000-version chain is about 250 KB)."""

#: The fewest bytes a pointer spends per JSON object or array, and per comma (checked before
#: parsing, so that a pointer filled with ``{}`` or ``0`` costs a reader no more than a few
#: times its size): an entry takes about 180 bytes (a part 140) with one object and 6 commas,
#: so a real pointer has one object per 140 bytes and one comma per 25.
BYTES_PER_CONTAINER = 96
BYTES_PER_COMMA = 16
_SLACK = 64

#: At most this many anchors in a pointer (``keep_anchors`` is bounded by it).
MAX_ANCHORS = 1024

#: At most this many parts per version (one per trainer rank that writes).
MAX_PARTS = 65536


def check_density(data: bytes, where: str) -> None:
    """Refuse a pointer with more JSON objects, arrays or commas than its size allows a real one,
    before any of them is parsed into an object (counted over the raw bytes: a real pointer has
    none of these characters inside its strings)."""
    size = len(data)
    if size > MAX_POINTER_BYTES:
        return  # parse_json refuses it, naming the size
    for chars, per, what in (((b"{", b"["), BYTES_PER_CONTAINER, "objects and arrays ('{' and '[')"),
                             ((b",",), BYTES_PER_COMMA, "commas")):  # fmt: skip
        count = sum(data.count(c) for c in chars)
        limit = _SLACK + size // per
        if count > limit:
            raise FormatError(
                f"{where}: not a deltasync pointer ({count} {what} in {size} bytes, more than the {limit} "
                f"a pointer of that size can hold: one per {per} bytes)"
            )


def check_pointer_body(body: dict[str, Any], where: str) -> None:
    """Types and ranges of the pointer's fields, before anything is built from them."""
    for key in ("format_version", "version", "anchor", "total", "root", "base"):
        if key in body:
            check_int(body[key], where=where, field=key)
    for key in ("fingerprint", "base_fingerprint"):
        if key in body:
            check_hex(body[key], FINGERPRINT_RE, where=where, field=key)
    if body.get("format_version") == MANIFEST_FORMAT_VERSION:
        if "manifest" not in body:
            raise FormatError(f"{where}: a format_version {MANIFEST_FORMAT_VERSION} pointer must name its manifest")
        check_hex(body["manifest"], SHA256_RE, where=where, field="manifest")
    chain = body.get("chain")
    if not isinstance(chain, list):
        raise FormatError(f"{where}: chain must be a list, got {type(chain).__name__}")
    lists = [("chain", chain)]
    version = body.get("version")
    if body.get("format_version") in (CHAIN_FORMAT_VERSION, MANIFEST_FORMAT_VERSION):
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
                check_hex(item["sha256"], SHA256_RE, where=where, field=f"{field}.sha256")
            if "fingerprint" in item:
                check_hex(item["fingerprint"], FINGERPRINT_RE, where=where, field=f"{field}.fingerprint")
            if "parts" in item:
                _check_part_items(item["parts"], where=where, field=field, version=item.get("version"))
            path, v = item.get("path"), item.get("version")
            if isinstance(path, str) and isinstance(v, int):
                digits = VERSIONED_PATH_RE.match(path)
                if digits is None or int(digits.group(1)) != v:
                    raise FormatError(f"{where}: version {v} names an invalid path {path[:80]!r}")


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
            check_hex(part["sha256"], SHA256_RE, where=where, field=f"{pfield}.sha256")
        if isinstance(path, str) and isinstance(version, int):
            digits = VERSIONED_PATH_RE.match(path)
            if digits is None or int(digits.group(1)) != version:
                raise FormatError(f"{where}: version {version} names an invalid part path {path[:80]!r}")
