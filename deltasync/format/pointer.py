"""The pointer (``latest.json``, the commit point) and the entries of the files it names.

docs/protocol.md describes the pointer's fields; a reader checks every one of them (types and
ranges first, :mod:`~deltasync.format.pointer_checks`, then how they fit together, here)
before it builds anything from them. The paths of the files live in
:mod:`~deltasync.format.paths`; both modules' names are importable from here too.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import FormatError
from .limited_json import check_int, parse_json
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


_TOKEN_RE = re.compile(r"[0-9a-f]{32}\Z", re.ASCII)
_MAX_HOST = 255


@dataclass(frozen=True, kw_only=True)
class WriterRecord:
    """Who committed a pointer, and until when it holds the chain (the pointer's ``writer``).

    A publisher makes one when it starts (a random ``token``) and writes it, with the time of
    the commit, into every pointer it commits; another publisher reads it to learn whether the
    chain is held. Times are Unix milliseconds (integers: a pointer holds no floats)."""

    host: str
    """The writer's host name."""
    pid: int
    """The writer's process id on that host."""
    started_ms: int
    """When the writer started."""
    token: str
    """32 lower-case hex digits, random per writer: what tells two writers apart."""
    committed_ms: int
    """When this pointer was committed."""
    lease_ms: int
    """How long after ``committed_ms`` the writer holds the chain; 0 once it let go (closed)."""

    @property
    def expires_ms(self) -> int:
        """When the hold ends, unless the writer commits again."""
        return self.committed_ms + self.lease_ms

    def describe(self) -> str:
        """``host H, process P, started <UTC time>``: the writer, for an error message."""
        return f"host {self.host!r}, process {self.pid}, started {_utc(self.started_ms)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host, "pid": self.pid, "started_ms": self.started_ms, "token": self.token,
            "committed_ms": self.committed_ms, "lease_ms": self.lease_ms,
        }  # fmt: skip

    @classmethod
    def from_json(cls, item: object, where: str) -> WriterRecord:
        if not isinstance(item, dict):
            raise FormatError(f"{where}: writer must be an object, got {type(item).__name__}")
        host, token = item.get("host"), item.get("token")
        if not isinstance(host, str) or not 0 < len(host) <= _MAX_HOST:
            raise FormatError(f"{where}: writer.host must be a string of 1 to {_MAX_HOST} characters")
        if not isinstance(token, str) or not _TOKEN_RE.match(token):
            raise FormatError(f"{where}: writer.token must be 32 lower-case hex digits")
        ints = {key: check_int(item.get(key), where=where, field=f"writer.{key}")
                for key in ("pid", "started_ms", "committed_ms", "lease_ms")}  # fmt: skip
        return cls(host=host, token=token, **ints)


def _utc(ms: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


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
