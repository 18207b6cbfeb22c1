"""The pointer (``latest.json``, the commit point).

docs/protocol.md describes the pointer's fields; a reader checks every one of them (types and
ranges first, :mod:`~deltasync.format.pointer_checks`, then how they fit together, here)
before it builds anything from them. The entries of the files it names live in
:mod:`~deltasync.format.entries`, its writer record in :mod:`~deltasync.format.writer_record`
and the paths of the files in :mod:`~deltasync.format.paths`; those modules' names are
importable from here too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import FormatError
from .entries import ChainEntry, PartEntry, _chain_entry, _check_parts, sha256_hex
from .limited_json import parse_json
from .paths import (
    DATA_PATH_RE,
    HISTORY_PATH,
    CLAIM_PATH,
    POINTER_PATH,
    VIEW_NAME_RE,
    VIEWS_PREFIX,
    anchor_path,
    data_path_version,
    delta_path,
    part_path,
    view_names,
    view_prefix,
)
from .pointer_checks import (
    _SLACK,  # noqa: F401  (importable from here, as benchmarks/hostile_pointer.py does of every version)
    BYTES_PER_COMMA,  # noqa: F401  (as _SLACK)
    BYTES_PER_CONTAINER,  # noqa: F401  (as _SLACK)
    MAX_ANCHORS,
    MAX_PARTS,
    MAX_POINTER_BYTES,
    check_density,
    check_pointer_body,
)
from .versions import (
    CHAIN_FORMAT_VERSION,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_FORMAT_VERSION,
    READABLE_FORMAT_VERSIONS,
)
from .writer_record import WriterRecord

__all__ = [
    "POINTER_PATH",
    "HISTORY_PATH",
    "CLAIM_PATH",
    "MAX_POINTER_BYTES",
    "MAX_HISTORY_BYTES",
    "MAX_ANCHORS",
    "MAX_PARTS",
    "DATA_PATH_RE",
    "ChainEntry",
    "PartEntry",
    "Pointer",
    "WriterRecord",
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

MAX_HISTORY_BYTES = 64 << 20
"""The largest history a publisher reads back; a longer one is ignored (it is informative only)."""


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
    view: dict[str, str] | None = None
    """A view's chain: what identifies it (:class:`deltasync.views.identity.ViewIdentity`'s
    fields: scheme, codes, scales, scale_layout); None for the bf16 chain and for views written
    before views named themselves."""
    writer: WriterRecord | None = None
    """Who committed this pointer (optional, any format version: readers ignore it); None in
    pointers of writers that predate it."""

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
    def start(
        cls, anchor: ChainEntry, *, total: int, manifest: str | None = None, view: dict[str, str] | None = None
    ) -> Pointer:
        """The pointer of a chain's first version, which has an anchor and no delta."""
        return cls(
            version=anchor.version, fingerprint=anchor.fingerprint, total=total, root=anchor.version,
            base=anchor.version, base_fingerprint=anchor.fingerprint, anchors=(anchor,), manifest=manifest,
            view=view,
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
        if self.view is not None:
            body["view"] = dict(self.view)
        if self.writer is not None:
            body["writer"] = self.writer.to_json()
        return (json.dumps(body, sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str = POINTER_PATH) -> Pointer:
        check_density(data, where)
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
        check_pointer_body(body, where)
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
                    view=_view(body.get("view"), where) if body["format_version"] == MANIFEST_FORMAT_VERSION else None,
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
        if "writer" in body:
            pointer = replace(pointer, writer=WriterRecord.from_json(body["writer"], where))
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


_VIEW_KEYS = ("codes", "scale_layout", "scales", "scheme")
_VIEW_VALUE_RE = re.compile(r"[A-Za-z0-9_:]{1,64}\Z", re.ASCII)


def _view(value: Any, where: str) -> dict[str, str] | None:
    """The pointer's ``view`` object (a view chain's identity), checked for shape only: which
    identity a reader accepts is the reader's to say."""
    if value is None:
        return None
    if (
        not isinstance(value, dict)
        or sorted(value) != list(_VIEW_KEYS)
        or not all(isinstance(v, str) and _VIEW_VALUE_RE.match(v) for v in value.values())
    ):
        raise FormatError(
            f"{where}: view must be an object of the strings {', '.join(_VIEW_KEYS)} (letters, digits, '_' and ':'), "
            f"got {str(value)[:120]!r}"
        )
    return dict(value)
