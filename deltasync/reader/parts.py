"""Reading and writing a committed version whatever its number of files.

A version is one file (format version 1) or, when several sharded writers wrote it, one part
file per writer (format version 2, docs/protocol.md section 18). Readers go through
:func:`fetch_version` (every file of a chain entry, each checked against the pointer's size
and SHA-256) and then :func:`iter_delta_parts` (each part decoded and checked against the
entry and the other parts) or :func:`decode_version` (the whole version assembled: full anchor
tensors, or one merged :class:`Change` per parameter). Anchors, the big files, are read by
:func:`fetch_anchor` straight from the store into their tensors, checked as they stream.
:class:`~deltasync.reader.chain.ChainReader` reads a whole chain with them.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, BinaryIO, NoReturn

import torch

from ..errors import FormatError, IntegrityError
from ..format import (
    AnchorSource,
    BaseLookup,
    ChainEntry,
    Change,
    FileHeader,
    PartEntry,
    TensorSpan,
    anchor_stream,
    decode_delta,
    header_length,
    parse_header,
    sha256_hex,
    tensor_spans,
)
from ..format.dtypes import ELEMENT_DTYPES
from ..stores import open_read, read_limited

if TYPE_CHECKING:
    from ..stores import Store

__all__ = [
    "Anchor",
    "AnchorSlice",
    "DeltaPart",
    "encode_anchor_part",
    "fetch_anchor",
    "fetch_version",
    "read_anchor",
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
class Anchor:
    """A whole anchor, read and checked (:func:`read_anchor`)."""

    header: FileHeader
    """The version's header (part 0's, with the counts of the whole version)."""
    tensors: dict[str, torch.Tensor]
    """Full bf16 tensors by name."""
    metadata: dict[str, str]
    """Its ``x-`` metadata keys (every part carries them; part 0's)."""
    nbytes: int
    """The bytes of its files."""


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
    manifest: str | None = None,
) -> bytes:
    """Part ``part`` of an anchor written by ``parts`` writers: each slice as a 1-D tensor of its
    element dtype (bf16 in the bf16 chain).

    ``extra_metadata``: ``x-`` keys as :func:`~deltasync.format.encode_anchor` takes them
    (every part carries them, so a reader needs only part 0)."""
    for item in slices:
        if item.values.dtype not in ELEMENT_DTYPES or item.values.numel() != item.end - item.begin:
            raise FormatError(f"anchor {version} part {part}: slice of {item.name!r} is not {item.end - item.begin} bf16 values")
    sources = [AnchorSource(s.name, s.shape, s.begin, s.end, lambda s=s: (s.values.reshape(-1),), s.values.dtype) for s in slices]  # type: ignore[misc]
    stream = anchor_stream(
        sources, version=version, fingerprint=fingerprint, total=total, part=part, parts=parts,
        extra_metadata=extra_metadata, manifest=manifest,
    )
    return b"".join(stream)


def fetch_version(store: Store, entry: ChainEntry) -> list[bytes]:
    """Every file of ``entry``, in part order, each checked against the pointer's size and SHA-256.

    A missing file raises :class:`~deltasync.NotFoundError` (from the store); a file of another
    size or digest raises :class:`~deltasync.IntegrityError` naming the part.
    """
    return [fetch_file(store, entry, number) for number in range(len(entry.files))]


def fetch_file(store: Store, entry: ChainEntry, number: int) -> bytes:
    """File ``number`` of ``entry``, checked against the pointer's size and SHA-256."""
    item = entry.files[number]
    where = _where(store.url, entry, number)
    # At most nbytes + 1, whatever the file holds.
    data = read_limited(store, item.path, item.nbytes)
    if len(data) != item.nbytes:
        _wrong_size(where, item, len(data))
    _check_digest(where, item, sha256_hex(data))
    return data


def _wrong_size(where: str, item: PartEntry, size: int) -> NoReturn:
    got = f"more than {item.nbytes}" if size > item.nbytes else str(size)
    raise IntegrityError(f"{where}: {got} bytes, the pointer says {item.nbytes} (truncated or replaced)")


def _check_digest(where: str, item: PartEntry, digest: str) -> None:
    if digest != item.sha256:
        raise IntegrityError(
            f"{where}: SHA-256 {digest[:16]}... does not match the pointer's {item.sha256[:16]}... "
            "(corrupted or tampered)"
        )


class _CheckedFile:
    """A file of a version read in pieces: each piece counted and hashed, so that the whole is
    checked against the pointer's size and SHA-256 at :meth:`finish` without ever being held."""

    _DRAIN = 1 << 20

    def __init__(self, f: BinaryIO, item: PartEntry, where: str) -> None:
        self.f, self.item, self.where = f, item, where
        self.digest = hashlib.sha256()
        self.nbytes = 0

    def readinto(self, view: memoryview) -> None:
        """Fill ``view`` entirely; a file that ends first is truncated."""
        got = 0
        while got < view.nbytes:
            n = self.f.readinto(view[got:])  # type: ignore[attr-defined]
            if not n:
                _wrong_size(self.where, self.item, self.nbytes + got)
            got += n
        self.digest.update(view)
        self.nbytes += got

    def read(self, size: int) -> bytes:
        buffer = bytearray(size)
        self.readinto(memoryview(buffer))
        return bytes(buffer)

    def finish(self) -> None:
        """Check that the file ends here and hashes to the pointer's digest."""
        if self.f.read(1):
            _wrong_size(self.where, self.item, self.item.nbytes + 1)
        _check_digest(self.where, self.item, self.digest.hexdigest())

    def refuse(self, exc: FormatError) -> NoReturn:
        """A file that does not decode: if it is not the file the pointer names (its size or
        digest differ) say so, which is the more useful error; else raise ``exc``."""
        try:
            while self.nbytes < self.item.nbytes:
                self.readinto(memoryview(bytearray(min(self._DRAIN, self.item.nbytes - self.nbytes))))
            self.finish()
        except IntegrityError as integrity:
            raise integrity from exc
        raise exc


@dataclass
class _AnchorChecks:
    """What the files of one anchor must agree on, checked file by file as they are read."""

    entry: ChainEntry
    url: str
    first: FileHeader | None = None
    shapes: dict[str, tuple[int, ...]] | None = None
    covered: dict[str, int] | None = None
    dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    """Each parameter's element dtype (every part must agree)."""

    def slices(self, header: FileHeader, spans: Sequence[TensorSpan], number: int, where: str) -> dict[str, tuple[int, int]]:
        """The flat range of its full parameter that each tensor of file ``number`` holds."""
        if header.kind != "anchor":
            raise FormatError(f"{where}: expected an anchor, found a {header.kind}")
        _check_part(header, self.first, self.entry, number, where)
        for span in spans:
            if span.dtype not in ELEMENT_DTYPES:
                raise FormatError(f"{where}: parameter {span.name!r} is {span.dtype}, anchors hold bfloat16 (or a view's codes)")
            if self.dtypes.setdefault(span.name, span.dtype) != span.dtype:
                raise FormatError(f"{where}: parameter {span.name!r} is {span.dtype}, part 0 has it as {self.dtypes[span.name]}")
        if not self.entry.parts:
            total = sum(math.prod(span.shape) for span in spans)
            if len(spans) != header.params or total != header.total:
                raise FormatError(
                    f"{where}: holds {len(spans)} parameters / {total} elements, "
                    f"its metadata says {header.params} / {header.total}"
                )
            self.shapes = {span.name: span.shape for span in spans}
            self.first = header
            return {span.name: (0, math.prod(span.shape)) for span in spans}
        assert header.slices is not None
        names = [s[0] for s in header.slices]
        if len(set(names)) != len(names) or {span.name for span in spans} != set(names):
            raise FormatError(f"{where}: its tensors {sorted(span.name for span in spans)} are not the parameters its 'slices' lists")
        listed = {name: shape for name, shape, _, _ in header.slices}
        if self.shapes is None:
            self.shapes, self.covered = listed, dict.fromkeys(listed, 0)
            if sum(map(math.prod, listed.values())) != header.total:
                raise FormatError(f"{where}: its parameters hold {sum(map(math.prod, listed.values()))} elements, its total says {header.total}")
        elif listed != self.shapes:
            raise FormatError(f"{where}: lists other parameters or shapes than part 0")
        assert self.covered is not None
        sizes = {span.name: span.shape for span in spans}
        out = {}
        for name, _, begin, end in header.slices:
            if len(sizes[name]) != 1 or sizes[name][0] != end - begin:
                raise FormatError(
                    f"{where}: parameter {name!r} is {list(sizes[name])} values, its slice needs {end - begin} values"
                )
            if end > begin:
                if begin != self.covered[name]:
                    raise FormatError(
                        f"{where}: parameter {name!r} continues at element {begin}, the parts before end at "
                        f"{self.covered[name]} (parts must cover each parameter exactly once, in order)"
                    )
                self.covered[name] = end
            out[name] = (begin, end)
        self.first = self.first or header
        return out

    def finish(self) -> FileHeader:
        """After the last file: every element was covered; the version's header."""
        assert self.first is not None and self.shapes is not None
        if self.covered is not None:
            short = [name for name, end in self.covered.items() if end != math.prod(self.shapes[name])]
            if short:
                raise FormatError(
                    f"{self.url} (version {self.entry.version}): the {len(self.entry.files)} parts leave elements of "
                    f"{short[0]!r} uncovered ({self.covered[short[0]]} of {math.prod(self.shapes[short[0]])})"
                )
        return replace(self.first, part=None, parts=None, slices=None, params=len(self.shapes), changed=self.first.total)


def read_anchor(open_file: Callable[[int], AbstractContextManager[BinaryIO]], entry: ChainEntry, *, url: str) -> Anchor:
    """An anchor's full bf16 tensors, each file read straight into them.

    ``open_file(number)`` opens file ``number`` of ``entry`` (see :func:`fetch_anchor`). Each
    file's header is read and checked first; its tensor bytes then go directly into the
    tensors' memory, so nothing but the tensors is ever held (a split anchor needs no buffer
    per part). Every file is also checked against the pointer's size and SHA-256, as it is
    read: a file that fails raises, and the tensors, which nobody else has seen, are dropped.
    A file that does not decode and is not the pointer's file says so (``IntegrityError``).
    """
    checks = _AnchorChecks(entry, url)
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for number, item in enumerate(entry.files):
        where = _where(url, entry, number)
        with open_file(number) as f:
            source = _CheckedFile(f, item, where)
            try:
                prefix = source.read(8)
                head = prefix + source.read(header_length(prefix, where=where, file_bytes=item.nbytes))
                table, header = parse_header(head, where=where, file_bytes=item.nbytes)
                spans = tensor_spans(table, where=where, data_bytes=item.nbytes - len(head))
                ranges = checks.slices(header, spans, number, where)
                if number == 0:
                    metadata = {k: v for k, v in (table.get("__metadata__") or {}).items() if k.startswith("x-")}
                if not tensors:
                    # Allocated from part 0's shapes, only once the files hold that many bytes.
                    assert checks.shapes is not None
                    dtypes = {name: checks.dtypes.get(name, torch.bfloat16) for name in checks.shapes}
                    need = sum(math.prod(shape) * dtypes[name].itemsize for name, shape in checks.shapes.items())
                    if need > sum(part.nbytes for part in entry.files):
                        raise FormatError(f"{where}: {header.total} elements do not fit the {entry.nbytes} bytes of the version's files")
                    tensors = {name: torch.empty(shape, dtype=dtypes[name]) for name, shape in checks.shapes.items()}
            except FormatError as exc:
                source.refuse(exc)
            for span in spans:
                begin, end = ranges[span.name]
                if end > begin:
                    source.readinto(memoryview(tensors[span.name].view(-1)[begin:end].view(torch.uint8).numpy()))
            source.finish()
    return Anchor(checks.finish(), tensors, metadata, entry.nbytes)


def fetch_anchor(store: Store, entry: ChainEntry) -> Anchor:
    """:func:`read_anchor` from ``store``, streamed where the store can (see
    :func:`~deltasync.stores.open_read`)."""
    return read_anchor(
        lambda number: open_read(store, entry.files[number].path, entry.files[number].nbytes), entry, url=store.url
    )


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
        for key in ("kind", "version", "base", "anchor", "codec", "total", "fingerprint", "base_fingerprint", "manifest"):
            if getattr(header, key) != getattr(first, key):
                raise FormatError(
                    f"{where}: {key} is {getattr(header, key)!r}, part 0 of the same version says {getattr(first, key)!r}"
                )


def iter_delta_parts(
    files: Sequence[bytes],
    entry: ChainEntry,
    *,
    url: str,
    numels: Mapping[str, int],
    base_values: BaseLookup,
    dtypes: Mapping[str, torch.dtype] | None = None,
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
        header, changes = decode_delta(data, where=where, numels=numels, base_values=base_values, dtypes=dtypes)
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
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> tuple[FileHeader, dict[str, torch.Tensor] | dict[str, Change]]:
    """The whole version: for an anchor, full tensors by name; for a delta, merged changes.

    The header returned is part 0's with the counts of the whole version (``part``, ``parts``
    and ``slices`` cleared). For deltas pass ``numels`` and ``base_values`` as for
    :func:`~deltasync.format.decode_delta` (and ``dtypes`` for a chain that holds other
    element dtypes than bf16).
    """
    if entry.kind == "anchor":
        anchor = read_anchor(lambda number: contextlib.nullcontext(io.BytesIO(files[number])), entry, url=url)
        return anchor.header, anchor.tensors
    assert numels is not None and base_values is not None
    changes: dict[str, Change] = {}
    pieces: dict[str, list[Change]] = {}
    first: FileHeader | None = None
    for part in iter_delta_parts(files, entry, url=url, numels=numels, base_values=base_values, dtypes=dtypes):
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
