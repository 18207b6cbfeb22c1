"""The entries of a pointer: the files of each committed version, their sizes and digests.

A :class:`ChainEntry` is one version (an anchor or a delta) as the pointer lists it, one file
or (a version written by several writers) its :class:`PartEntry` parts. This module writes
them to JSON and builds them back from a pointer's JSON, which
:meth:`~deltasync.format.pointer.Pointer.from_bytes` checked for types and ranges first.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from .paths import part_path

__all__ = ["ChainEntry", "PartEntry", "sha256_hex"]


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
