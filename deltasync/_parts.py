"""Reading and writing a committed version whatever its number of files.

A version is one file (format version 1) or, when several sharded writers wrote it, one part
file per writer (format version 2, docs/protocol.md section 18). Readers go through
:func:`fetch_version` (every file of a chain entry, each checked against the pointer's size
and SHA-256) and then :func:`iter_anchor_parts` / :func:`iter_delta_parts` (each part decoded
and checked against the entry and the other parts) or :func:`decode_version` (the whole
version assembled: full anchor tensors, or one merged :class:`Change` per parameter).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from ._errors import FormatError, IntegrityError
from ._format import (
    AnchorSource,
    BaseLookup,
    ChainEntry,
    Change,
    FileHeader,
    load_tensors,
    anchor_stream,
    decode_anchor,
    decode_delta,
    read_header,
    sha256_hex,
)
from .stores import read_buffer, read_limited

if TYPE_CHECKING:
    from .stores import Store

__all__ = [
    "AnchorSlice",
    "AnchorPart",
    "DeltaPart",
    "encode_anchor_part",
    "fetch_version",
    "iter_anchor_parts",
    "iter_delta_parts",
    "decode_version",
]


@dataclass(frozen=True)
class AnchorSlice:
    """Flat elements ``begin .. end - 1`` of parameter ``name`` (full shape ``shape``)."""

    name: str
    shape: tuple[int, ...]
    begin: int
    end: int
    values: torch.Tensor
    """bf16, 1-D, ``end - begin`` elements."""


@dataclass(frozen=True)
class AnchorPart:
    """One decoded file of an anchor: a slice of every parameter (a single file has them whole)."""

    number: int
    header: FileHeader
    slices: tuple[AnchorSlice, ...]


@dataclass(frozen=True)
class DeltaPart:
    """One decoded file of a delta: its changes, with flat indices of the full parameters."""

    number: int
    header: FileHeader
    changes: dict[str, Change]


def encode_anchor_part(
    slices: Sequence[AnchorSlice],
    *,
    version: int,
    fingerprint: str,
    total: int,
    part: int,
    parts: int,
    extra_metadata: Mapping[str, str] | None = None,
) -> bytes:
    """Part ``part`` of an anchor written by ``parts`` writers: each slice as a 1-D bf16 tensor.

    ``extra_metadata``: ``x-`` keys as :func:`~deltasync._format.encode_anchor` takes them
    (every part carries them, so a reader needs only part 0)."""
    for item in slices:
        if item.values.dtype != torch.bfloat16 or item.values.numel() != item.end - item.begin:
            raise FormatError(f"anchor {version} part {part}: slice of {item.name!r} is not {item.end - item.begin} bf16 values")
    sources = [AnchorSource(s.name, s.shape, s.begin, s.end, lambda s=s: (s.values.reshape(-1),)) for s in slices]
    stream = anchor_stream(
        sources, version=version, fingerprint=fingerprint, total=total, part=part, parts=parts, extra_metadata=extra_metadata
    )
    return b"".join(stream)


def fetch_version(store: Store, entry: ChainEntry) -> list[bytes]:
    """Every file of ``entry``, in part order, each checked against the pointer's size and SHA-256.

    A missing file raises :class:`~deltasync.NotFoundError` (from the store); a file of another
    size or digest raises :class:`~deltasync.IntegrityError` naming the part.
    """
    return [fetch_file(store, entry, number) for number in range(len(entry.files))]


class LazyFiles(Sequence[bytearray]):
    """The files of a version, each fetched and checked (as :func:`fetch_file`) only when it is
    reached, into a writable buffer: decoding an anchor part by part never holds every part."""

    def __init__(self, store: Store, entry: ChainEntry) -> None:
        self.store, self.entry = store, entry
        self.nbytes = 0
        """Bytes fetched so far."""

    def __len__(self) -> int:
        return len(self.entry.files)

    def __getitem__(self, number: int) -> bytearray:  # type: ignore[override]
        if not 0 <= number < len(self):
            raise IndexError(number)
        data = fetch_file(self.store, self.entry, number, buffer=True)
        self.nbytes += len(data)
        return data  # type: ignore[return-value]


def fetch_file(store: Store, entry: ChainEntry, number: int, *, buffer: bool = False) -> bytes | bytearray:
    """File ``number`` of ``entry``, checked against the pointer's size and SHA-256; with
    ``buffer``, read into a writable ``bytearray`` (see :func:`~deltasync.stores.read_buffer`)."""
    item = entry.files[number]
    label = f"part {number} of version {entry.version}" if entry.parts else f"version {entry.version}"
    where = f"{store.url}/{item.path} ({label})"
    # At most nbytes + 1, whatever the file holds.
    data = read_buffer(store, item.path, item.nbytes) if buffer else read_limited(store, item.path, item.nbytes)
    if len(data) != item.nbytes:
        got = f"more than {item.nbytes}" if len(data) > item.nbytes else str(len(data))
        raise IntegrityError(f"{where}: {got} bytes, the pointer says {item.nbytes} (truncated or replaced)")
    digest = sha256_hex(data)
    if digest != item.sha256:
        raise IntegrityError(
            f"{where}: SHA-256 {digest[:16]}... does not match the pointer's {item.sha256[:16]}... "
            "(corrupted or tampered)"
        )
    return data


def _where(url: str, entry: ChainEntry, number: int) -> str:
    if not entry.parts:
        return f"{url}/{entry.path} (version {entry.version})"
    return f"{url}/{entry.parts[number].path} (part {number} of version {entry.version})"


def _check_part(header: FileHeader, first: FileHeader | None, entry: ChainEntry, number: int, where: str) -> None:
    """A part names its place in the version, and agrees with the entry and with part 0."""
    if not entry.parts:
        if header.parts is not None:
            raise FormatError(f"{where}: the file is part {header.part} of {header.parts}, the pointer lists one file")
        return
    if header.parts is None:
        raise FormatError(f"{where}: a single-file version, the pointer lists it as part {number} of {len(entry.parts)}")
    if header.part != number or header.parts != len(entry.parts):
        raise FormatError(
            f"{where}: the file is part {header.part} of {header.parts}, the pointer lists it as part "
            f"{number} of {len(entry.parts)}"
        )
    if header.changed != entry.parts[number].changed:
        raise FormatError(f"{where}: holds {header.changed} elements, the pointer says {entry.parts[number].changed}")
    if first is not None:
        for key in ("kind", "version", "base", "anchor", "codec", "total", "fingerprint", "base_fingerprint"):
            if getattr(header, key) != getattr(first, key):
                raise FormatError(
                    f"{where}: {key} is {getattr(header, key)!r}, part 0 of the same version says {getattr(first, key)!r}"
                )


def iter_anchor_parts(files: Sequence[bytes], entry: ChainEntry, *, url: str) -> Iterator[AnchorPart]:
    """Decode an anchor's files one at a time (from :func:`fetch_version`).

    Each part is checked on its own and against part 0; that the parts together cover every
    element exactly once is checked as they come, and completed after the last one. A caller
    that applies parts as they come must still wait for the end of the iteration (and check
    the fingerprint) before it exposes the result.
    """
    if not entry.parts:
        where = _where(url, entry, 0)
        data = files[0]
        _check_part(read_header(data, where=where), None, entry, 0, where)
        header, tensors = decode_anchor(data, where=where)
        slices = tuple(
            AnchorSlice(name, tuple(t.shape), 0, t.numel(), t.reshape(-1)) for name, t in tensors.items()
        )
        yield AnchorPart(0, header, slices)
        return
    first: FileHeader | None = None
    covered: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for number, data in enumerate(files):
        where = _where(url, entry, number)
        header = read_header(data, where=where)
        if header.kind != "anchor":
            raise FormatError(f"{where}: expected an anchor, found a {header.kind}")
        _check_part(header, first, entry, number, where)
        assert header.slices is not None
        tensors = load_tensors(data, where=where)
        names = [s[0] for s in header.slices]
        if len(set(names)) != len(names) or set(tensors) != set(names):
            raise FormatError(f"{where}: its tensors {sorted(tensors)} are not the parameters its 'slices' lists")
        if first is None:
            shapes = {name: shape for name, shape, _, _ in header.slices}
            covered = dict.fromkeys(shapes, 0)
            if sum(math.prod(s) for s in shapes.values()) != header.total:
                raise FormatError(f"{where}: its parameters hold {sum(map(math.prod, shapes.values()))} elements, its total says {header.total}")
        elif {name: shape for name, shape, _, _ in header.slices} != shapes:
            raise FormatError(f"{where}: lists other parameters or shapes than part 0")
        out = []
        for name, shape, begin, end in header.slices:
            values = tensors[name]
            if values.dtype != torch.bfloat16 or values.dim() != 1 or values.numel() != end - begin:
                raise FormatError(
                    f"{where}: parameter {name!r} is {values.dtype} {tuple(values.shape)}, its slice needs "
                    f"{end - begin} bfloat16 values"
                )
            if end > begin:
                if begin != covered[name]:
                    raise FormatError(
                        f"{where}: parameter {name!r} continues at element {begin}, the parts before end at "
                        f"{covered[name]} (parts must cover each parameter exactly once, in order)"
                    )
                covered[name] = end
            out.append(AnchorSlice(name, shape, begin, end, values))
        if first is None:
            first = header
        yield AnchorPart(number, header, tuple(out))
    short = [name for name, end in covered.items() if end != math.prod(shapes[name])]
    if short:
        raise FormatError(
            f"{url} (version {entry.version}): the {len(files)} parts leave elements of {short[0]!r} "
            f"uncovered ({covered[short[0]]} of {math.prod(shapes[short[0]])})"
        )


def iter_delta_parts(
    files: Sequence[bytes], entry: ChainEntry, *, url: str, numels: Mapping[str, int], base_values: BaseLookup
) -> Iterator[DeltaPart]:
    """Decode a delta's files one at a time (from :func:`fetch_version`).

    ``base_values`` must give the values before this version: parts never touch the same
    element, and for each parameter every index of a part is above every index of the parts
    before it (checked), so no part's base depends on another part of the same version.
    """
    first: FileHeader | None = None
    last: dict[str, int] = {}
    for number, data in enumerate(files):
        where = _where(url, entry, number)
        header, changes = decode_delta(data, where=where, numels=numels, base_values=base_values)
        _check_part(header, first, entry, number, where)
        for name, change in changes.items():
            if name in last and int(change.index[0]) <= last[name]:
                raise FormatError(
                    f"{where}: changes element {int(change.index[0])} of {name!r}, at or before element "
                    f"{last[name]} that an earlier part changes (parts must not overlap)"
                )
            last[name] = int(change.index[-1])
        if first is None:
            first = header
        yield DeltaPart(number, header, changes)


def decode_version(
    files: Sequence[bytes],
    entry: ChainEntry,
    *,
    url: str,
    numels: Mapping[str, int] | None = None,
    base_values: BaseLookup | None = None,
) -> tuple[FileHeader, dict[str, torch.Tensor] | dict[str, Change]]:
    """The whole version: for an anchor, full tensors by name; for a delta, merged changes.

    The header returned is part 0's with the counts of the whole version (``part``, ``parts``
    and ``slices`` cleared). For deltas pass ``numels`` and ``base_values`` as for
    :func:`~deltasync._format.decode_delta`.
    """
    if entry.kind == "anchor":
        tensors: dict[str, torch.Tensor] = {}
        header: FileHeader | None = None
        for part in iter_anchor_parts(files, entry, url=url):
            header = header or part.header
            for item in part.slices:
                if not entry.parts:
                    tensors[item.name] = item.values.view(item.shape)
                    continue
                full = tensors.get(item.name)
                if full is None:
                    full = tensors[item.name] = torch.empty(item.shape, dtype=torch.bfloat16)
                full.view(-1)[item.begin : item.end] = item.values
        assert header is not None
        merged = replace(header, part=None, parts=None, slices=None, params=len(tensors), changed=header.total)
        return merged, tensors
    assert numels is not None and base_values is not None
    changes: dict[str, Change] = {}
    pieces: dict[str, list[Change]] = {}
    first: FileHeader | None = None
    for part in iter_delta_parts(files, entry, url=url, numels=numels, base_values=base_values):
        first = first or part.header
        for name, change in part.changes.items():
            pieces.setdefault(name, []).append(change)
    assert first is not None
    for name, items in pieces.items():
        if len(items) == 1:
            changes[name] = items[0]
        else:
            changes[name] = Change(index=torch.cat([c.index for c in items]), new=torch.cat([c.new for c in items]))
    merged = replace(
        first,
        part=None,
        parts=None,
        params=len(changes),
        changed=sum(c.index.numel() for c in changes.values()),
    )
    return merged, changes
