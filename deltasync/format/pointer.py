"""The pointer (``latest.json``, the commit point) and the paths of the files it names.

docs/protocol.md describes the pointer's fields; a reader checks every one of them
(types and ranges first, then how they fit together) before it builds anything from them.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import FormatError
from .limited_json import FINGERPRINT_RE, SHA256_RE, check_hex, check_int, parse_json
from .versions import (
    CHAIN_FORMAT_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
)

__all__ = [
    "POINTER_PATH",
    "HISTORY_PATH",
    "MAX_POINTER_BYTES",
    "MAX_HISTORY_BYTES",
    "MAX_ANCHORS",
    "MAX_PARTS",
    "DATA_PATH_RE",
    "ChainEntry",
    "PartEntry",
    "Pointer",
    "anchor_path",
    "delta_path",
    "part_path",
    "data_path_version",
    "sha256_hex",
    "VIEWS_PREFIX",
    "VIEW_NAME_RE",
    "view_prefix",
    "view_names",
]

POINTER_PATH = "latest.json"
HISTORY_PATH = "history.jsonl"
MAX_POINTER_BYTES = 32 << 20
"""The largest pointer a reader accepts (a 1000-version chain is about 250 KB)."""
MAX_HISTORY_BYTES = 64 << 20
"""The largest history a publisher reads back; a longer one is ignored (it is informative only)."""

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

_VERSIONED = r"(?:anchors|deltas)/([0-9]{8,16})"
DATA_PATH_RE = re.compile(_VERSIONED + r"(?:\.part[0-9]+)?\.safetensors\Z", re.ASCII)
"""The path of a data file (an anchor or a delta, whole or a part; see :func:`anchor_path`,
:func:`delta_path`, :func:`part_path`): group 1 is its version. Nothing else in a bucket is
an anchor or a delta, and nothing else is ever deleted by retention."""
_VERSIONED_RE = re.compile(_VERSIONED + r"[.]", re.ASCII)
"""The start of a data file's path, up to its version (checked before the whole path)."""


def anchor_path(version: int) -> str:
    return f"anchors/{version:08d}.safetensors"


def delta_path(version: int) -> str:
    return f"deltas/{version:08d}.safetensors"


def part_path(kind: str, version: int, part: int) -> str:
    """Part ``part`` of a version written by several writers (format version 2)."""
    return f"{kind}s/{version:08d}.part{part}.safetensors"


def data_path_version(path: str) -> int | None:
    """The version of a data file (:data:`DATA_PATH_RE`); None for any other path."""
    match = DATA_PATH_RE.match(path)
    return None if match is None else int(match.group(1))


VIEWS_PREFIX = "views/"
"""The folder of the bucket that holds one folder per view (``views/FP8_DYNAMIC/``)."""
VIEW_NAME_RE = re.compile(r"[A-Z0-9_]{1,64}\Z", re.ASCII)
"""A view's name: a compressed-tensors preset scheme name."""


def view_prefix(name: str) -> str:
    """The folder of view ``name`` in a bucket."""
    if not isinstance(name, str) or not VIEW_NAME_RE.match(name):
        raise FormatError(f"view name {name!r} is not a scheme name (upper-case letters, digits and '_')")
    return f"{VIEWS_PREFIX}{name}/"


def view_names(store: Any) -> list[str]:
    """The views a bucket holds (those with a committed pointer), sorted."""
    found = set()
    for path in store.list(VIEWS_PREFIX):
        parts = path[len(VIEWS_PREFIX) :].split("/")
        if len(parts) == 2 and parts[1] == POINTER_PATH and VIEW_NAME_RE.match(parts[0]):
            found.add(parts[0])
    return sorted(found)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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

    @classmethod
    def of_files(cls, kind: str, version: int, fingerprint: str, files: Sequence[PartEntry], split: bool) -> ChainEntry:
        """The entry of a version from its written files: one, or (``split``) one per part, in
        any order (they are listed in part order)."""
        if split:
            ordered = sorted(files, key=lambda item: int(item.path.rsplit(".part", 1)[1].split(".")[0]))
            return cls(
                version=version, kind=kind, path="", nbytes=sum(f.nbytes for f in ordered), sha256="",
                fingerprint=fingerprint, changed=sum(f.changed for f in ordered), parts=tuple(ordered),
            )
        (only,) = files
        return cls(
            version=version, kind=kind, path=only.path, nbytes=only.nbytes, sha256=only.sha256,
            fingerprint=fingerprint, changed=only.changed,
        )

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
    manifest: str | None = None
    """The digest of the state's names, shapes and dtypes (:mod:`deltasync.format.manifest`),
    the same at every version of the chain; None in pointers before format version 4."""

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
    def start(cls, anchor: ChainEntry, *, total: int, manifest: str | None = None) -> Pointer:
        """The pointer of a chain's first version, which has an anchor and no delta."""
        return cls(
            version=anchor.version, fingerprint=anchor.fingerprint, total=total, root=anchor.version,
            base=anchor.version, base_fingerprint=anchor.fingerprint, anchors=(anchor,), manifest=manifest,
        )

    def stale(self, paths: Sequence[str]) -> list[str]:
        """Of ``paths`` (a listing of ``anchors/`` and ``deltas/``), the data files this pointer
        no longer needs: anchors older than its oldest anchor, deltas at or below its base.
        Nothing but a data file (:data:`DATA_PATH_RE`) is ever among them."""
        oldest = self.anchors[0].version
        return [
            path
            for path in paths
            if (found := data_path_version(path)) is not None
            and (found < oldest if path.startswith("anchors/") else found <= self.base)
        ]

    def with_anchor(self, entry: ChainEntry, keep_anchors: int) -> Pointer:
        """This pointer with a newly complete anchor ``entry``, keeping the newest
        ``keep_anchors`` anchors and the deltas from the anchor before the kept ones: a
        follower up to one anchor interval behind still catches up with deltas alone."""
        anchors = (*self.anchors, entry)
        keep = anchors[-keep_anchors:]
        base = self.base
        if len(anchors) > len(keep):
            base = max(base, anchors[-len(keep) - 1].version)
        fp = self.fingerprint_at(base)
        assert fp is not None
        chain = tuple(item for item in self.chain if item.version > base)
        return replace(self, anchors=keep, base=base, base_fingerprint=fp, chain=chain)

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": CHAIN_FORMAT_VERSION if self.manifest is None else MANIFEST_FORMAT_VERSION,
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
        if self.manifest is not None:
            body["manifest"] = self.manifest
        return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = POINTER_PATH) -> Pointer:
        _check_density(data, where)
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
            if body["format_version"] in (CHAIN_FORMAT_VERSION, MANIFEST_FORMAT_VERSION):
                pointer = cls(
                    version=int(body["version"]),
                    fingerprint=str(body["fingerprint"]),
                    total=int(body["total"]),
                    root=int(body["root"]),
                    base=int(body["base"]),
                    base_fingerprint=str(body["base_fingerprint"]),
                    anchors=tuple(_chain_entry(item) for item in body["anchors"]),
                    chain=chain,
                    manifest=body["manifest"] if body["format_version"] == MANIFEST_FORMAT_VERSION else None,
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
                elif not DATA_PATH_RE.match(item.path) or not item.path.startswith(kind + "s/"):
                    raise FormatError(f"{where}: version {item.version} names an invalid path {item.path!r}")
        for item in self.anchors:
            if self.fingerprint_at(item.version) not in (None, item.fingerprint):
                raise FormatError(f"{where}: the anchor of version {item.version} disagrees with the chain's fingerprint")
        if self.fingerprint_at(self.version) != self.fingerprint:
            raise FormatError(f"{where}: the pointer's fingerprint disagrees with its last chain entry")


def _check_density(data: bytes, where: str) -> None:
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


def _check_pointer_body(body: dict[str, Any], where: str) -> None:
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
                digits = _VERSIONED_RE.match(path)
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
            digits = _VERSIONED_RE.match(path)
            if digits is None or int(digits.group(1)) != version:
                raise FormatError(f"{where}: version {version} names an invalid part path {path[:80]!r}")
