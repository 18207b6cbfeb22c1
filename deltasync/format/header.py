"""The header every anchor and delta carries in its safetensors metadata, and how a reader
parses it: the file's length prefix, its tensor table, then each metadata key."""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from .codecs import CODECS
from .container import MAX_HEADER_BYTES, check_tensor_table
from .limited_json import FINGERPRINT_RE, MAX_INT_DIGITS, SHA256_RE, check_hex, parse_json
from .versions import FORMAT_NAME, FORMAT_VERSION, PARTS_FORMAT_VERSION, READABLE_FILE_FORMAT_VERSIONS

__all__ = [
    "MAX_SLICES_BYTES",
    "FileHeader",
    "check_metadata",
    "header_length",
    "parse_header",
    "read_header",
    "read_metadata",
    "with_extra_metadata",
]

_META_INT_RE = re.compile(r"(?:0|[1-9][0-9]{0,15})\Z", re.ASCII)


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
    """Deltas of a codec that lists them (zstd): the changed parameters, in the order their
    elements are stored."""
    part: int | None = None
    """A split version (format version 2): this file's part number, ``0 .. parts - 1``."""
    parts: int | None = None
    """A split version: how many parts it has."""
    slices: tuple[tuple[str, tuple[int, ...], int, int], ...] | None = None
    """An anchor part: ``(name, full shape, begin, end)`` per parameter of the state, in name
    order; the part holds flat elements ``begin .. end - 1`` of each."""
    manifest: str | None = None
    """The digest of the state's names, shapes and dtypes (see :mod:`deltasync.format.manifest`);
    None in files written before format version 4 of the pointer."""

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
        if self.manifest is not None:
            meta["manifest"] = self.manifest
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
        check_metadata(meta, where)
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
                    meta["names"], where=where, what="metadata names", max_bytes=MAX_HEADER_BYTES, max_depth=1
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
                manifest=meta.get("manifest"),
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


def check_metadata(meta: Mapping[str, str], where: str) -> None:
    """Metadata integers are plain ASCII decimals (no sign, spaces, '_' or leading zeros)."""
    for key in ("version", "anchor", "params", "changed", "total", "base", "part", "parts"):
        value = meta.get(key)
        if value is None or (key == "base" and value == "none"):
            continue
        if not isinstance(value, str) or not _META_INT_RE.match(value):
            raise FormatError(
                f"{where}: invalid metadata ({key}={value!r:.60} is not a plain decimal integer "
                f"below 10**{MAX_INT_DIGITS})"
            )
    for key in ("fingerprint", "base_fingerprint"):
        if key in meta:
            check_hex(meta[key], FINGERPRINT_RE, where=where, field=f"metadata {key}")
    if "manifest" in meta:
        check_hex(meta["manifest"], SHA256_RE, where=where, field="metadata manifest")
    if "changed" in meta and "total" in meta and int(meta["changed"]) > int(meta["total"]):
        raise FormatError(f"{where}: metadata changed={meta['changed']} exceeds total={meta['total']}")


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
    if length > MAX_HEADER_BYTES:
        raise FormatError(f"{where}: the safetensors header is {length} bytes, more than {MAX_HEADER_BYTES}")
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
            data[8 : 8 + length], where=where, what="the safetensors header", max_bytes=MAX_HEADER_BYTES, max_depth=3
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
    check_tensor_table(table, size - 8 - length, where)
    return table, FileHeader.from_metadata(meta, where=where)


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
