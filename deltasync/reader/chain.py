"""Reading a bucket's chain: the pointer's versions fetched, checked and decoded, once for all.

Three things follow a chain: :class:`~deltasync.DeltaReceiver` (a host copy of every weight),
vllm_ext's in-place state (the live weights one rank holds) and the adapter sync (through a
receiver). They differ only in where the values before a version come from and which
elements they hold. A :class:`ChainReader` does the rest for all of them: it reads the
pointer's files (each checked against the pointer's size and SHA-256, by :mod:`._parts`),
checks each file's header against the pointer, and decodes deltas over an :class:`Overlay`,
the state being replayed: a base with the new values of the deltas replayed so far laid over
it (one :class:`Patch` per parameter). What a consumer checks itself is what only it can: the
receiver the fingerprints of its copy, the in-place state the fingerprint summed over ranks.

Values move as int16 bit patterns (lanes, :mod:`deltasync.format.dtypes`: a bf16 pattern, or a
quantized view's one-byte code zero-extended), never through float arithmetic, so every
pattern (NaN payloads too) arrives exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import FormatError, IntegrityError, NotFoundError, VersionError
from ..format import (
    MAX_POINTER_BYTES,
    POINTER_PATH,
    ChainEntry,
    Change,
    FileHeader,
    Pointer,
    read_header,
    tensors_manifest,
)
from ..format.header import read_metadata
from ..format.dtypes import from_lanes, is_one_byte, lanes, read_lanes, write_lanes
from ..format.fingerprint import fingerprint
from ..protocol.messages import check_version
from ..stores import read_limited
from ..views.identity import ViewIdentity, check_file_view, check_pointer_view, check_view_tensors
from .parts import Anchor, decode_version, fetch_anchor, fetch_version

if TYPE_CHECKING:
    from ..stores import Store

__all__ = ["BaseRead", "ChainReader", "check_view_values", "DeltaStep", "Move", "Overlay", "Patch", "bits", "read_pointer"]


def bits(values: torch.Tensor) -> torch.Tensor:
    """The int16 bit patterns of a bf16 tensor (a view): copies of these are exact."""
    return values.view(torch.int16)


class Patch:
    """New values of one parameter across successive deltas: sorted unique flat indices and
    the int16 bit patterns of their values."""

    def __init__(self, index: torch.Tensor | None = None, bits: torch.Tensor | None = None) -> None:
        self.index = torch.empty(0, dtype=torch.int64) if index is None else index
        self.bits = torch.empty(0, dtype=torch.int16) if bits is None else bits

    @property
    def values(self) -> torch.Tensor:
        """The new values, as bf16 (a view of :attr:`bits`; the bf16 chain)."""
        return self.bits.view(torch.bfloat16)

    def merge(self, index: torch.Tensor, bits: torch.Tensor) -> None:
        """Add a later change (sorted unique ``index``); where both touch an element, the later value wins."""
        if self.index.numel() == 0:
            self.index, self.bits = index, bits
            return
        # Both are sorted and unique: merge them in O(n + m log n), never sorting what the
        # patch already holds (a late joiner replays many deltas into one patch). New arrays:
        # the old ones may be the tensors a caller still holds (a Move's values).
        n = self.index.numel()
        pos = torch.searchsorted(self.index, index)
        hit = self.index[pos.clamp(max=n - 1)] == index
        fresh = ~hit
        fresh_index = index[fresh]
        dest = pos[fresh] + torch.arange(fresh_index.numel())
        is_fresh = torch.zeros(n + fresh_index.numel(), dtype=torch.bool)
        is_fresh[dest] = True
        kept = (~is_fresh).nonzero().squeeze(1)
        out_index = torch.empty(n + fresh_index.numel(), dtype=self.index.dtype)
        out_bits = torch.empty(n + fresh_index.numel(), dtype=self.bits.dtype)
        out_index[kept], out_bits[kept] = self.index, self.bits
        out_index[dest], out_bits[dest] = fresh_index, bits[fresh]
        out_bits[kept[pos[hit]]] = bits[hit]  # where both touch an element, the later value wins
        self.index, self.bits = out_index, out_bits

    def overlay(self, index: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
        """``bits`` (the base's, at ``index``) with this patch's values where it has some."""
        if self.index.numel() == 0 or index.numel() == 0:
            return bits
        pos = torch.searchsorted(self.index, index).clamp(max=self.index.numel() - 1)
        hit = self.index[pos] == index
        out = bits.clone()
        # As int16: a bf16 assignment of one element goes through a float scalar, which
        # rewrites NaN payloads.
        out[hit] = self.bits[pos[hit]]
        return out

    def lookup(self, base: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Values at ``index`` with this patch laid over ``base`` (flat, of an element dtype)."""
        return from_lanes(self.overlay(index, read_lanes(base, index)), base.dtype)

    def write(self, flat: torch.Tensor) -> None:
        """Write the new values into ``flat`` (a flat tensor of the parameter, of its element dtype)."""
        if self.index.numel():
            write_lanes(flat, self.index, self.bits)


BaseRead = Callable[[str, torch.Tensor], tuple["torch.Tensor | None", torch.Tensor]]
"""(parameter name, sorted flat int64 indices) -> (the positions in the indices whose elements
the reader holds, or None for all of them; the int16 bits of the values there now)."""


class Overlay:
    """A state being replayed: the values ``base`` reads, with :attr:`patches` laid over them.

    ``base`` reads the state before the first delta replayed (:data:`BaseRead`). A reader that
    holds only some elements (one rank's shard) answers for those: the deltas are decoded with
    zeros elsewhere, and only the elements it holds are patched.
    """

    def __init__(self, base: BaseRead, dtypes: Mapping[str, torch.dtype] | None = None) -> None:
        self.base = base
        self.dtypes = dtypes
        """Each parameter's element dtype (None: all bf16)."""
        self.patches: dict[str, Patch] = {}
        """Parameter -> the new values of the elements the deltas so far changed."""
        self._read: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = {}
        """What :meth:`values` read for the version being decoded (index, positions, bits), so
        that :meth:`advance` does not read the same elements again."""

    def read(self, name: str, index: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """As ``base``, with the deltas replayed so far: (positions held or None, current bits)."""
        pos, now = self.base(name, index)
        patch = self.patches.get(name)
        if patch is not None:
            now = patch.overlay(index if pos is None else index[pos], now)
        return pos, now

    def values(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """The current values at every element of ``index`` (zeros at those not held), in the
        parameter's element dtype."""
        pos, now = self.read(name, index)
        self._read[name] = (index, pos, now)
        if pos is not None:
            out = torch.zeros(index.numel(), dtype=torch.int16)
            out[pos] = now
            now = out
        return from_lanes(now, torch.bfloat16 if self.dtypes is None else self.dtypes[name])

    def advance(self, changes: Mapping[str, Change]) -> dict[str, Move]:
        """Lay a version's decoded ``changes`` over the state; what they move in the elements held."""
        moves = {}
        read, self._read = self._read, {}
        for name, change in changes.items():
            seen = read.get(name)
            pos, old = seen[1:] if seen is not None and seen[0] is change.index else self.read(name, change.index)
            if change.invalid is not None:
                held = change.invalid if pos is None else change.invalid[torch.isin(change.invalid, pos)]
                if held.numel():
                    at = int(change.index[held[0]])
                    raise FormatError(f"parameter {name!r}: the coded difference of element {at} leaves the 8 bits of its code")
            index, new = change.index, lanes(change.new)
            if pos is not None:
                index, new = index[pos], new[pos]
            moves[name] = Move(index, old, new, change.index.numel())
            patch = self.patches.get(name)
            if patch is None:  # (not setdefault: that would make a Patch, two empty tensors, every time)
                self.patches[name] = Patch(index, new)
            else:
                patch.merge(index, new)
        return moves


@dataclass(frozen=True)
class Move:
    """What one delta does to one parameter, in the elements the reader holds."""

    index: torch.Tensor
    """Their flat indices (sorted)."""
    old: torch.Tensor
    """Their int16 bits before the delta."""
    new: torch.Tensor
    """Their int16 bits after it."""
    changed: int
    """Elements the delta changes in the parameter, held or not."""


@dataclass(frozen=True)
class DeltaStep:
    """One delta of a chain, read, checked against the pointer and laid over the overlay."""

    entry: ChainEntry
    header: FileHeader
    """The version's header (of part 0, with the counts of the whole version)."""
    where: str
    """The version's files, as messages name them."""
    nbytes: int
    """Bytes read."""
    moves: dict[str, Move]
    """Changed parameter -> what it moves (see :meth:`Overlay.advance`)."""


def check_view_values(items: Iterable[tuple[str, torch.Tensor]], where: str) -> None:
    """Refuse codes and scales a quantized view cannot hold (:func:`deltasync.views.check_codes`,
    :func:`~deltasync.views.check_scale`): a NaN fp8 code, a scale that is NaN, infinite, zero
    or negative. ``items``: a view's tensors (or new values) by name."""
    from ..views.schemes import check_codes, check_scale

    try:
        for name, values in items:
            if is_one_byte(values.dtype):
                check_codes(name, values)
            elif name.endswith("_scale"):
                check_scale(name, values)
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None


def read_pointer(store: Store) -> Pointer:
    """The bucket's committed pointer (read with a bound, parsed and checked)."""
    where = f"{store.url}/{POINTER_PATH}"
    try:
        data = read_limited(store, POINTER_PATH, MAX_POINTER_BYTES)
    except NotFoundError as exc:
        raise VersionError(f"{where}: no version is committed in this bucket yet") from exc
    return Pointer.from_bytes(data, where=where)


class ChainReader:
    """The versions one pointer commits in ``store``: each fetched, checked and decoded.

    Every file is checked against the pointer's size and SHA-256 and every header against the
    pointer's entry and chain; a file that fails raises a :class:`~deltasync.DeltaSyncError`
    naming it, before any of its values reach the caller.

    A reader reads the chain it asks for (``view``: a view's name; None: the bf16 chain) and
    nothing else: a pointer, a file's metadata or an anchor's tensors that belong to another
    chain are refused (:mod:`deltasync.views.identity`), the pointer's at once.
    """

    def __init__(self, store: Store, pointer: Pointer, *, view: str | None = None) -> None:
        self.store = store
        self.pointer = pointer
        self.identity = None if view is None else ViewIdentity.of(view)
        """The chain asked for (None: the bf16 chain)."""
        check_pointer_view(self.identity, pointer.view, f"{store.url}/{POINTER_PATH}")

    def where(self, entry: ChainEntry) -> str:
        """How messages name the files of ``entry``."""
        if not entry.parts:
            return f"{self.store.url}/{entry.path} (version {entry.version})"
        return f"{self.store.url}/{entry.kind}s/{entry.version:08d}.part* ({len(entry.parts)} parts of version {entry.version})"

    def target(self, version: int | None) -> int:
        """``version`` (default: the newest), checked to be committed."""
        target = self.pointer.version if version is None else version
        check_version(target)
        if target > self.pointer.version:
            raise VersionError(
                f"version {target} is not committed in {self.store.url} (the newest is {self.pointer.version})"
            )
        return target

    def check_header(self, header: FileHeader, entry: ChainEntry) -> None:
        """Refuse a file whose header is not what the pointer lists for ``entry``."""
        where, pointer = self.where(entry), self.pointer
        if header.version != entry.version:
            raise VersionError(f"{where}: the file is version {header.version}, the pointer lists it as {entry.version}")
        if header.kind != entry.kind:
            raise FormatError(f"{where}: the file is a(n) {header.kind}, the pointer lists a(n) {entry.kind}")
        root = entry.version if entry.kind == "anchor" else pointer.root
        if header.anchor != root:
            raise VersionError(f"{where}: descends from anchor {header.anchor}, the pointer's chain grew from {root}")
        if header.fingerprint != entry.fingerprint:
            raise IntegrityError(
                f"{where}: fingerprint {header.fingerprint} in the file, {entry.fingerprint} in the pointer"
            )
        if header.total != pointer.total:
            raise FormatError(f"{where}: says the state has {header.total} elements, the pointer says {pointer.total}")
        if header.manifest != pointer.manifest:
            raise IntegrityError(
                f"{where}: manifest {header.manifest} in the file, {pointer.manifest} in the pointer (the "
                "parameters' names, shapes or dtypes differ)"
            )

    def anchor(self, entry: ChainEntry) -> Anchor:
        """The anchor ``entry``'s full tensors, streamed from the store straight into them (the
        encoded file and the tensors are never both in memory), with its header checked and its
        tensors hashed to the fingerprint it names."""
        where = self.where(entry)
        anchor = fetch_anchor(self.store, entry)
        self.check_header(anchor.header, entry)
        check_file_view(self.identity, anchor.metadata, where, kind="anchor", named=self.pointer.view is not None)
        check_view_tensors(self.identity, anchor.tensors, where)
        if any(t.dtype != torch.bfloat16 for t in anchor.tensors.values()):
            check_view_values(anchor.tensors.items(), where)
        if self.pointer.manifest is not None:
            manifest = tensors_manifest(anchor.tensors)
            if manifest != self.pointer.manifest:
                raise IntegrityError(
                    f"{where}: the anchor's parameters (names, shapes, dtypes) have manifest {manifest}, the "
                    f"pointer says {self.pointer.manifest} (the file was altered after it was written)"
                )
        got = fingerprint(anchor.tensors)
        if got != anchor.header.fingerprint:
            raise IntegrityError(
                f"{where}: the anchor's tensors hash to {got}, its metadata says {anchor.header.fingerprint} "
                "(the file was altered after it was written)"
            )
        return anchor

    def fetch(self, version: int) -> tuple[ChainEntry, list[bytes]]:
        """Delta ``version``'s entry and files (one, or one per part), each read with a bound and
        checked against the pointer's size and SHA-256."""
        entry = self.pointer.delta(version)
        return entry, fetch_version(self.store, entry)

    def check_files(self, version: int) -> int:
        """Check delta ``version`` as far as it can be without the state it applies to: each
        file's size and SHA-256, and its header against the pointer. Returns the bytes read."""
        entry, files = self.fetch(version)
        for number, data in enumerate(files):
            where = f"{self.store.url}/{entry.files[number].path}"
            self.check_header(read_header(data, where=where), entry)
            self.check_view(data, where, entry.kind)
        return sum(map(len, files))

    def check_view(self, data: bytes, where: str, kind: str) -> None:
        """Refuse a file (its header already read and checked) whose metadata names another
        chain than the one asked for."""
        check_file_view(self.identity, read_metadata(data, where=where), where, kind=kind, named=self.pointer.view is not None)

    def deltas(
        self, first: int, target: int, overlay: Overlay, *, numels: Mapping[str, int]
    ) -> Iterator[DeltaStep]:
        """Deltas ``first .. target``, each decoded over ``overlay`` and then laid over it.

        ``numels``: the parameters' element counts (a delta naming another parameter, or an
        index outside one, is refused); the element dtypes are the overlay's."""
        for version in range(first, target + 1):
            entry, files = self.fetch(version)
            header, changes = decode_version(
                files, entry, url=self.store.url, numels=numels, base_values=overlay.values, dtypes=overlay.dtypes
            )
            self.check_header(header, entry)
            for number, data in enumerate(files):
                self.check_view(data, f"{self.store.url}/{entry.files[number].path}", "delta")
            try:
                moves = overlay.advance(changes)  # type: ignore[arg-type]  # a delta decodes to changes
            except FormatError as exc:
                raise FormatError(f"{self.where(entry)}: {exc}") from None
            if overlay.dtypes is not None:
                # The values of the elements this reader holds (a rank decodes the others against
                # zeros: they mean nothing here).
                dtypes = overlay.dtypes
                held = ((name, from_lanes(move.new, dtypes[name])) for name, move in moves.items())
                check_view_values(held, self.where(entry))
            yield DeltaStep(entry, header, self.where(entry), sum(map(len, files)), moves)
