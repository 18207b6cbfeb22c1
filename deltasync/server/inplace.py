"""Deltas written straight into the live (tensor-parallel-sharded) weights, with no host copy.

Each worker maps checkpoint elements onto its live parameters (:mod:`.weight_map`). For a
delta it decodes only the elements it holds, against old values read from the live
weights (the zstd codec codes new values relative to them). Everything but the write itself
happens while staging, before the pause: decoding, mapping to flat positions of the live
parameters (sorted, for a near-sequential pass), and saving the old values there for a
rollback; they cannot change in between, since a staged update is used only while the
served version and fingerprint are those it was staged against, and only an update changes
them. Applying is one ``scatter_`` per live parameter: time and memory are O(changed
elements on this rank). Values move as int16 lanes (a bf16 bit pattern, or a quantized view's
one-byte code zero-extended; :mod:`deltasync.format.dtypes`), never through float
arithmetic, so every pattern (NaN payloads too) arrives exactly. A live parameter is read and
written in storage order through :class:`~deltasync.server.live_flat.LiveFlat` (an FP8 weight that
vLLM transposed after loading, a scale it widened to float32).

The fingerprint of what is served is computed from the live weights through the map:
each rank hashes the elements it owns (an element held by several ranks or pieces, like a
replicated KV head, a norm or a bias, belongs to the first of them) and the shares add up
across ranks. It is computed in full at start-up, after an anchor and on ``verify``, and
moved in O(changed) by every delta. A delta is written only if the fingerprint it gives,
summed over every rank, is the one the bucket committed.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from deltasync import IntegrityError
from deltasync.format.codecs.zstd import decode_threads
from deltasync.format.fingerprint import (
    DeviceHasher,
    fingerprint_add,
    fingerprint_move,
    fingerprint_moves,
    fingerprint_share,
    fingerprint_slices,
)
from deltasync.format.threads import SMALL, spread
from deltasync.protocol import Heal
from deltasync.reader import ChainReader, Overlay

from .cpus import BackgroundPolicy
from .live_flat import LiveFlat
from .weight_map import Piece, WeightMap

__all__ = ["InPlaceState", "LiveStaged", "release_freed_memory", "release_later", "wait_for_device"]

_MASK = (1 << 64) - 1
_SPREAD_MOVES = 1 << 20
"""A delta's fingerprint moves of host values are spread over the decode threads from this
many changed elements."""
# Parameter names of the host copy in ``InPlaceState.flat`` (never a vLLM parameter's name).
_HOST = "<host>"


def _meet(a: Piece, b: Piece) -> bool:
    """Whether the checkpoint ranges of two boxes overlap."""
    (a_lo, a_hi), (b_lo, b_hi) = a.src_range, b.src_range
    return a_lo <= b_hi and b_lo <= a_hi


def release_freed_memory() -> None:
    """Return freed heap pages to the system. glibc keeps them (per thread arena) after large
    transient buffers, such as an anchor's full copy or a full hash's chunks; elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def release_later(*objects: Any, background: BackgroundPolicy) -> None:
    """Drop ``objects`` (containers of tensors, emptied) and give the memory back to the system
    in a background thread (run as ``background`` says), so that the caller (inside a pause)
    does not wait for either."""
    held = list(objects)
    del objects

    def run() -> None:
        background.enter()
        for obj in held:
            obj.clear()
        held.clear()
        release_freed_memory()

    # Not a daemon: a daemon thread still freeing tensors when the interpreter finalizes is
    # killed inside torch's C++ destructors, and the process aborts ("terminate called without
    # an active exception"); the interpreter joins this one, a moment's work, before it exits.
    threading.Thread(target=run, name="deltasync-release").start()


def wait_for_device(tensors: Any) -> None:
    """Wait until the kernels queued on the accelerator holding any of ``tensors`` have run.

    CUDA kernels run asynchronously: without this, an update would return (and its time be
    taken, and the engine resume on whatever stream it uses) while its writes were still
    queued, and buffers staged in another thread could be read before they are filled. A no-op
    for CPU tensors."""
    devices = {t.device for t in tensors if t.device.type == "cuda"}
    for device in devices:
        torch.cuda.synchronize(device)


@dataclass
class _Write:
    """New values for one parameter on this rank: flat indices (sorted, each once), the int16
    bit patterns to write there and those there now (the undo log)."""

    dst: torch.Tensor
    bits: torch.Tensor
    old: torch.Tensor | None = None
    ordered: bool = False
    """Whether ``dst`` is known to be increasing already (one dense box's run of sorted indices)."""
    more: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """Further ``(dst, bits)`` of the same parameter while staging (several names: a fused MoE
    parameter holds every expert's), joined once at the end (:meth:`join`)."""

    def join(self, device: torch.device) -> None:
        """``dst`` and ``bits`` on ``device``, with :attr:`more` joined to them: one copy of each,
        where joining each name as it came would copy what came before it again (quadratic in the
        names of a parameter)."""
        if self.more:
            self.dst = torch.cat([self.dst.to(device), *(d.to(device) for d, _ in self.more)])
            self.bits = torch.cat([self.bits.to(device), *(b.to(device) for _, b in self.more)])
            self.more = []
        else:
            self.dst, self.bits = self.dst.to(device), self.bits.to(device)


@dataclass
class _Resident:
    """One parameter's elements of a delta being staged as :meth:`InPlaceState.read` read them,
    with their copies on the parameter's device: the indices cross to the device once, and the
    fingerprint move and the write use the copies the read made (see :meth:`InPlaceState.stage_deltas`)."""

    index: torch.Tensor
    """The checkpoint indices read (the host tensor the decoder holds)."""
    got: torch.Tensor
    """Their bits, on the host (what the read returned)."""
    index_on: torch.Tensor | None
    """The indices on the device (dropped once the fingerprint move used them)."""
    dst_on: torch.Tensor
    """Their flat positions in the parameter, on its device."""
    got_on: torch.Tensor
    new: torch.Tensor | None = None
    """The host bits the fingerprint move took to the device (``new_on``)."""
    new_on: torch.Tensor | None = None


@dataclass
class LiveStaged:
    """A staged in-place update (this rank's part), checked except for the cross-rank sums."""

    from_version: int | None
    from_fingerprint: str | None
    version: int
    kind: str
    """"delta" (written in place), "anchor" (loaded densely, then checked) or "none"."""
    fingerprint: str
    """The fingerprint the bucket committed for ``version``."""
    chain: list[tuple[int, str, str]] = field(default_factory=list)
    """(version, base fingerprint, fingerprint) of each delta replayed."""
    shares: list[int] = field(default_factory=list)
    """This rank's fingerprint move for each delta of ``chain`` (owned elements only)."""
    writes: dict[str, _Write] = field(default_factory=dict)
    """vLLM parameter -> what to write there."""
    changed: int = 0
    """Checkpoint elements changed (all ranks, counted once)."""
    names: list[str] = field(default_factory=list)
    nbytes: int = 0
    seconds: float = 0.0
    dense: Any = None
    """For an anchor: the fully staged :class:`~deltasync.StagedUpdate` to load densely."""
    broken: str | None = None
    """Why this rank could not stage the deltas (a file corrupt or missing) where an anchor past
    the served version can replace them: the ranks then agree to load the anchor instead."""
    healed: Heal | None = None
    """Set when the version is an anchor loaded instead of deltas that could not be used."""


class InPlaceState:
    """One worker's served weights, followed in place.

    Parameters that cannot be patched in place (``host``: checkpoint name -> shape, whole vLLM
    modules at a time) fall back one by one: their values are kept in HF-named tensors on
    the host, which deltas patch like live parameters (the same staging, fingerprint shares and
    undo log), and the modules they feed are rebuilt from those tensors through ``reload``
    inside the pause. Every other parameter is written in place.

    Args:
        model: the live model.
        weight_map: this worker's map (checkpoint names in ``host`` are not looked up in it).
        gather: ``obj -> [obj of every rank]`` over this engine's ranks (the same order on all).
        rank_index: this worker's position in ``gather``'s answer.
        load_dense: loads ``(checkpoint name, tensor)`` pairs through the model's loader.
        host: the checkpoint names (and shapes) that fall back, in checkpoint order.
        reload: rebuilds the modules of the given checkpoint names from ``(name, tensor)``
            pairs (whole modules: see :func:`~deltasync.server.groups.reload_groups`); raises on failure.
        groups: checkpoint names -> the names to send so that each touched module is whole.
        dtypes: each checkpoint name's element dtype, for a quantized view (None: all bf16).
        background: where and at what priority its background threads run.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        weight_map: WeightMap,
        gather: Callable[[Any], list[Any]],
        rank_index: int,
        load_dense: Callable[[Any], None],
        *,
        host: Mapping[str, tuple[int, ...]] | None = None,
        reload: Callable[[list[tuple[str, torch.Tensor]]], None] | None = None,
        groups: Callable[[list[str]], list[str]] | None = None,
        dtypes: Mapping[str, torch.dtype] | None = None,
        background: BackgroundPolicy | None = None,
    ) -> None:
        self.map = weight_map
        self.background = background or BackgroundPolicy()
        self.gather = gather
        self.load_dense = load_dense
        self.reload = reload
        self.groups = groups or (lambda names: list(names))
        self.model = model
        # Allocated now, filled by the first anchor (pages are only touched then).
        self.dtypes = None if dtypes is None else dict(dtypes)
        """Checkpoint name -> element dtype, for a checkpoint that is not all bf16 (a quantized view)."""
        self.host: dict[str, torch.Tensor] = {name: torch.empty(shape, dtype=self.dtype_of(name))
                                              for name, shape in (host or {}).items()}  # fmt: skip
        for name, tensor in self.host.items():
            n = tensor.numel()
            self.map.pieces[name] = [Piece(_HOST + name, (n,), 0, (1,), 0, (1,))] if n else []
        self.flat: dict[str, LiveFlat] = {}
        self._refresh_live()
        self.flat.update({_HOST + name: LiveFlat(t) for name, t in self.host.items()})
        # Pieces of the same name held by earlier ranks, or earlier on this rank, own their
        # elements: an element counts once in the fingerprint.
        everyone = gather(self.map.pieces)
        self.before: dict[str, list[list[Piece]]] = {}
        for name, mine in self.map.pieces.items():
            earlier = [theirs.get(name, []) for theirs in everyone[:rank_index]]
            # Only boxes whose ranges meet can hold the same elements (replicated KV heads do).
            self.before[name] = [[o for o in [*itertools.chain.from_iterable(earlier), *mine[:k]] if _meet(o, piece)] for k, piece in enumerate(mine)]
        self.version: int | None = None
        # With a host part, nothing is known before the first anchor fills it.
        self.fingerprint: str | None = None if self.host else self.full_fingerprint()
        self.tainted: str | None = None
        self.pending: dict[str, Any] | None = None
        self._resident: dict[str, _Resident] | None = None
        """While a delta is staged: what the read of each one-piece name left on its device."""

    def _refresh_live(self) -> None:
        """(Re)read the live parameters' storage (a reload keeps it, but never trust that)."""
        params = dict(self.model.named_parameters())
        for pieces in self.map.pieces.values():
            for piece in pieces:
                if not piece.param.startswith(_HOST):
                    self.flat[piece.param] = LiveFlat(params[piece.param])

    def dtype_of(self, name: str) -> torch.dtype:
        """Checkpoint name ``name``'s element dtype."""
        return torch.bfloat16 if self.dtypes is None else self.dtypes.get(name, torch.bfloat16)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host copy of the parameters that fall back (0: everything in place)."""
        return sum(t.nbytes for t in self.host.values())

    # ------------------------------------------------------------------ fingerprint

    def _owned(self, name: str, k: int, index: torch.Tensor) -> torch.Tensor:
        """Mask of ``index`` (all inside piece ``k`` of ``name``) that no earlier piece holds."""
        owned = torch.ones(index.numel(), dtype=torch.bool, device=index.device)
        for other in self.before[name][k]:
            hit, _ = other.locate(index)
            owned[hit] = False
        return owned

    def local_share(self, *, slices: bool = True) -> int:
        """This rank's share of the fingerprint, hashed from the live weights. ``slices=False``
        hashes every piece through its indices, as a piece that is not one run always is (the
        same sum; ``benchmarks/discover.py --hash`` times both)."""
        total = 0
        # A piece that is one run on both sides, and that no earlier piece shares elements with,
        # is hashed as a slice of the live weights, many small ones together (no indices made:
        # the cost follows the elements, not the names).
        runs: list[tuple[str, torch.Tensor, int]] = []
        # Weights on an accelerator are hashed there (indices made there too): one read of
        # each device's sum at the end.
        hashers: dict[torch.device, DeviceHasher] = {}
        for name, pieces in self.map.pieces.items():
            for k, piece in enumerate(pieces):
                flat = self.flat[piece.param]
                if slices and piece.dense and not self.before[name][k]:
                    runs.append((name, flat.hashed(piece.dst_offset, piece.dst_offset + piece.numel), piece.src_offset))
                    continue
                device = flat.raw.device
                hasher = None if device.type == "cpu" else hashers.setdefault(device, DeviceHasher(device))
                for src, dst in piece.chunks(device=None if hasher is None else device):
                    if self.before[name][k]:  # (a mask read back: one wait on an accelerator)
                        owned = self._owned(name, k, src)
                        if not bool(owned.all()):
                            src, dst = src[owned], dst[owned]
                    bits = flat.read(dst.to(device)).view(torch.bfloat16)
                    if hasher is None:
                        total = (total + fingerprint_share(name, src, bits)) & _MASK
                    else:
                        hasher.add(name, src, bits)
        total += fingerprint_slices(runs)
        for hasher in hashers.values():
            total = (total + hasher.value()) & _MASK
        return total & _MASK

    def full_fingerprint(self) -> str:
        """The fingerprint of what every rank serves, recomputed in full (a collective)."""
        return fingerprint_add(0, *self.gather(self.local_share()))

    def start_full_hash(self) -> None:
        """Hash this rank's share of the served weights in a background thread; :meth:`settle`
        sums the shares and checks them against the committed fingerprint."""
        job: dict[str, Any] = {"share": None, "error": None}

        def run() -> None:
            self.background.enter(behind=False)  # settled by the next call: not behind serving
            try:
                job["share"] = self.local_share()
            except Exception as exc:  # noqa: BLE001  (reported by settle)
                job["error"] = f"{type(exc).__name__}: {exc}"
            release_freed_memory()

        # Not a daemon, like ``release_later``'s thread: the interpreter joins it before it exits.
        job["thread"] = threading.Thread(target=run, name="deltasync-served-hash")
        self.pending = job
        job["thread"].start()

    def settle(self) -> None:
        """Wait for the background hash, sum it across ranks (a collective), and taint the state
        when it is not the fingerprint committed for the served version."""
        job, self.pending = self.pending, None
        if job is None:
            return
        job["thread"].join()
        shares = self.gather(job["share"])
        if any(share is None for share in shares):
            served = self.full_fingerprint()  # a rank's background hash failed: hash again here
        else:
            served = fingerprint_add(0, *shares)
        if served != self.fingerprint:
            self.tainted = (
                f"after loading version {self.version} the served weights hash to {served}, "
                f"not {self.fingerprint}; the next update loads the newest anchor again"
            )
            self.fingerprint = served

    def read(self, name: str, index: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Live int16 bits at the sorted checkpoint indices ``index`` of ``name`` that this rank
        holds: ``(positions in index, bits)``, each element once; positions None when it holds
        them all (the chain reader's :data:`~deltasync.reader.chain.BaseRead`)."""
        pieces = self.map.pieces.get(name, [])
        if len(pieces) == 1:  # the common case: one box of one parameter (hits come sorted, once each)
            # The indices cross to the parameter's device once; they are located and read there.
            flat = self.flat[pieces[0].param]
            index_on = index.to(flat.device)
            run = pieces[0].locate_run(index_on)
            hit: torch.Tensor | None
            if run is None:
                hit, dst_on = pieces[0].locate(index_on, sorted_index=True)
            else:  # a dense box: positions are made only where some indices fall outside it
                first, last, dst_on = run
                hit = None if last - first == index.numel() else torch.arange(first, last)
            got_on = flat.read(dst_on)
            got = got_on.cpu()
            if hit is not None and hit.numel() != index.numel():
                return hit.cpu(), got
            resident = self._resident
            if resident is not None:  # a decode thread's own name: one entry per name
                resident[name] = _Resident(index, got, index_on, dst_on, got_on)
            return None, got
        found = torch.zeros(index.numel(), dtype=torch.bool)
        out = torch.zeros(index.numel(), dtype=torch.int16)
        for piece in pieces:
            hit, dst = piece.locate(index, sorted_index=True)
            flat = self.flat[piece.param]
            out[hit] = flat.read(dst.to(flat.device)).cpu()
            found[hit] = True
        return torch.nonzero(found).reshape(-1), out[found]

    # ------------------------------------------------------------------ staging

    def stage_deltas(self, reader: ChainReader, target: int) -> LiveStaged:
        """Decode deltas ``version + 1 .. target`` of ``reader``'s chain for the elements this rank holds."""
        start = time.perf_counter()
        assert self.version is not None
        staged = LiveStaged(
            from_version=self.version,
            from_fingerprint=self.fingerprint,
            version=target,
            kind="delta" if target > self.version else "none",
            fingerprint=reader.pointer.fingerprint_at(target) or "",
        )
        self._resident = {}
        try:
            return self._stage_deltas(reader, target, staged, start)
        finally:
            self._resident = None

    def _stage_deltas(self, reader: ChainReader, target: int, staged: LiveStaged, start: float) -> LiveStaged:
        assert self.version is not None and self._resident is not None
        resident = self._resident
        # Old values at the elements this rank holds (the others are decoded, then dropped).
        overlay = Overlay(self.read, self.dtypes)
        patches = overlay.patches
        names: dict[str, None] = {}
        # One delta (the common case): the live values it read are the undo log already.
        live: dict[str, torch.Tensor] | None = {} if target == self.version + 1 else None
        for step in reader.deltas(self.version + 1, target, overlay, numels=self.map.numels):
            moves = [(name, move) for name, move in step.moves.items() if name not in self.map.ignored]
            share = self._share_moves(moves)
            for name, move in moves:
                names[name] = None
                staged.changed += move.changed
                if live is not None:
                    live[name] = move.old
            staged.chain.append((step.entry.version, step.header.base_fingerprint or "", step.header.fingerprint))
            staged.shares.append(share & _MASK)
            staged.nbytes += step.nbytes
        staged.names = list(names)
        # Per parameter, the undo log's parts from those values, or None where one is missing.
        olds: dict[str, list[torch.Tensor] | None] = {}
        for name, patch in patches.items():
            pieces = self.map.pieces.get(name, [])
            # Values read from this name's one piece (with several, an element can sit in two).
            read = live.get(name) if live is not None and len(pieces) == 1 else None
            if read is not None and read.numel() != patch.index.numel():
                read = None
            mine = resident.get(name)
            if read is not None and mine is not None and patch.index is mine.index and read is mine.got:
                # What the read left on the device: every element of its one piece, their values now.
                bits = mine.new_on if mine.new_on is not None and patch.bits is mine.new else patch.bits
                self._add_write(staged, olds, pieces[0].param, mine.dst_on, bits, mine.got_on, ordered=pieces[0].dense)
                continue
            for piece in pieces:
                hit, dst = piece.locate(patch.index, sorted_index=True)
                if hit.numel():
                    every = hit.numel() == patch.index.numel()  # hits come in order, each once
                    bits = patch.bits if every else patch.bits[hit]
                    self._add_write(staged, olds, piece.param, dst, bits, None if read is None else read if every else read[hit],
                                    ordered=piece.dense)  # fmt: skip
        for param, write in staged.writes.items():
            flat = self.flat[param]
            write.join(flat.device)
            parts = olds[param]
            old = None if not parts else parts[0].to(flat.device) if len(parts) == 1 else torch.cat([p.to(flat.device) for p in parts])
            if not write.ordered and write.dst.numel() > 1 and not bool((write.dst[1:] > write.dst[:-1]).all()):
                # Pieces laid out in another order than the checkpoint's (sorted already, else).
                write.dst, order = torch.sort(write.dst)
                write.bits = write.bits[order]
                old = None if old is None else old[order]
            # The undo log, read now rather than in the write's standstill: the staging's own read
            # where it holds every element written, else read here.
            write.old = flat.read(write.dst) if old is None else old
        wait_for_device(w.old for w in staged.writes.values())  # filled before another thread uses them
        staged.seconds = time.perf_counter() - start
        return staged

    def _add_write(self, staged: LiveStaged, olds: dict[str, list[torch.Tensor] | None], param: str,
                   dst: torch.Tensor, bits: torch.Tensor, old: torch.Tensor | None, *, ordered: bool = False) -> None:  # fmt: skip
        """Add ``bits`` at flat positions ``dst`` of ``param`` to the staged writes, with the values
        there now (``old``; None: read them later); ``ordered``: ``dst`` is increasing already.
        Several names of one parameter are joined on its device."""
        write = staged.writes.get(param)
        if write is None:
            staged.writes[param] = _Write(dst, bits, ordered=ordered)
            olds[param] = []
        else:
            write.more.append((dst, bits))  # joined once, at the end
            write.ordered = False  # joined: checked, and sorted where needed
        parts = olds[param]
        if parts is not None:
            if old is None:
                olds[param] = None
            else:
                parts.append(old)

    def _share_moves(self, moves: list[tuple[str, Any]]) -> int:
        """The sum (mod 2**64) of :meth:`_share_move` over ``(name, move)`` items. Those held on
        the host are hashed with NumPy, without the interpreter lock: the large ones over the decode
        threads, the small ones together in this thread meanwhile (:func:`fingerprint_moves`). The
        others are hashed on their device, in this thread."""
        host: list[tuple[str, Any]] = []
        rest: list[tuple[str, Any]] = []
        for item in moves:
            (host if self._on_host(item[0]) else rest).append(item)
        large = [item for item in host if item[1].index.numel() >= SMALL]
        small = [item for item in host if item[1].index.numel() < SMALL]

        def one(job: tuple[str, Any] | None) -> int:
            if job is None:  # the small ones, together
                owned = ((name, self._owned_move(name, m.index, m.old, m.new)) for name, m in small)
                return fingerprint_moves((name, i, o.view(torch.bfloat16), n.view(torch.bfloat16)) for name, (i, o, n) in owned)
            name, move = job
            return self._share_move(name, move.index, move.old, move.new)

        jobs: list[tuple[str, Any] | None] = [*large, None]
        workers = decode_threads() if sum(move.index.numel() for _, move in large) > _SPREAD_MOVES else 1
        with spread(workers, "deltasync-move") as threads:
            shares = threads(one, jobs, sizes=[m.index.numel() for _, m in large] + [0], small=SMALL)
        return (sum(shares) + sum(one(item) for item in rest)) & _MASK

    def _on_host(self, name: str) -> bool:
        """Whether every piece of ``name`` this rank holds is in host memory."""
        return all(self.flat[piece.param].raw.device.type == "cpu" for piece in self.map.pieces.get(name, []))

    def _owned_move(self, name: str, index: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(index, old, new)`` of the elements of a move (held here) that this rank owns: the
        same tensors where it owns all it holds."""
        pieces = self.map.pieces.get(name, [])
        if len(pieces) <= 1 and not self.before[name][0]:  # held here means owned here
            return index, old, new
        owned = torch.zeros(index.numel(), dtype=torch.bool)
        for k, piece in enumerate(pieces):
            hit, _ = piece.locate(index, sorted_index=True)
            if hit.numel():
                owned[hit[self._owned(name, k, index[hit])]] = True
                # An element in two of this rank's pieces: the first piece owns it.
        return index[owned], old[owned], new[owned]

    def _share_move(self, name: str, index: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
        """Fingerprint move of elements ``index`` (held here) going from ``old`` to ``new`` bits,
        counting only the elements this rank owns."""
        pieces = self.map.pieces.get(name, [])
        mine = None if self._resident is None else self._resident.get(name)
        if mine is not None and (index is not mine.index or old is not mine.got):
            mine = None  # not the values the read left on the device (a later delta of a chain)
        owned = self._owned_move(name, index, old, new)
        if owned[0] is not index:
            index, old, new = owned
            mine = None
        device = self.flat[pieces[0].param].raw.device if pieces else torch.device("cpu")
        if device.type != "cpu" and index.numel() > 1 << 16:  # hashed on the accelerator
            if mine is not None and mine.index_on is not None:  # the indices and old values are there already
                mine.new, mine.new_on = new, new.to(device, non_blocking=True)
                index, old, new = mine.index_on, mine.got_on, mine.new_on
                mine.index_on = None  # the write needs the positions, not the indices
            else:
                index, old, new = (t.to(device, non_blocking=True) for t in (index, old, new))
        return fingerprint_move(name, index, old.view(torch.bfloat16), new.view(torch.bfloat16))

    # ------------------------------------------------------------------ writing

    def check_chain(self, staged: LiveStaged, shares_of_all: list[list[int]]) -> str:
        """The fingerprint after the staged deltas, from every rank's shares; raises
        :class:`~deltasync.IntegrityError` where the sum is not what the bucket committed."""
        fp = self.fingerprint
        for i, (version, base, committed) in enumerate(staged.chain):
            if base != fp:
                raise IntegrityError(
                    f"version {version} applies to a state with fingerprint {base}, but the served "
                    f"weights have {fp}"
                )
            fp = fingerprint_add(fp, *(shares[i] for shares in shares_of_all))
            if fp != committed:
                raise IntegrityError(
                    f"version {version}: the served weights would have fingerprint {fp} after it, the bucket "
                    f"says {committed} (the served weights differ from the bucket's state, or the file is corrupt)"
                )
        return fp  # type: ignore[return-value]

    def write(self, staged: LiveStaged) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """Write the staged values (and rebuild the modules of host parameters they change);
        returns the undo log (old bits), also when it raises part-way (the exception then
        carries it as ``exc.undo``)."""
        undo: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        try:
            for param, w in staged.writes.items():
                flat = self.flat[param]
                old = w.old if w.old is not None else flat.read(w.dst)
                undo.append((param, w.dst, old))
                flat.write(w.dst, w.bits)
            wait_for_device(self.flat[param].tensor for param, _, _ in undo)
            self._reload_host([param for param, _, _ in undo])
        except Exception as exc:
            exc.undo = undo  # type: ignore[attr-defined]
            raise
        return undo

    def rollback(self, undo: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Put the saved old bits back, last write first, and rebuild the host parameters' modules
        from the restored values."""
        for param, dst, old in reversed(undo):
            self.flat[param].write(dst, old)
        wait_for_device(self.flat[param].tensor for param, _, _ in undo)
        self._reload_host([param for param, _, _ in undo])

    def _reload_host(self, params: list[str]) -> None:
        names = [param[len(_HOST):] for param in params if param.startswith(_HOST)]
        if names:
            self.load_host(names)

    def load_host(self, names: list[str]) -> None:
        """Rebuild the modules that the host parameters ``names`` feed, from the host copy."""
        assert self.reload is not None, "host parameters need a reload function"
        self.reload([(name, self.host[name]) for name in self.groups(names)])
        self._refresh_live()

    def load_anchor(self, weights: Any) -> None:
        """Load a full state densely: host parameters into the host copy and their modules, the
        others through the model's loader."""
        host = self.host

        def live_part() -> Any:
            for name, tensor in weights:
                if name in host:
                    host[name].view(-1).copy_(tensor.reshape(-1))
                else:
                    yield name, tensor

        self.load_dense(live_part())
        wait_for_device(flat.tensor for flat in self.flat.values())
        if host:
            self.load_host(list(host))

    def commit(self, version: int, fingerprint: str) -> None:
        self.version, self.fingerprint, self.tainted = version, fingerprint, None

    # ------------------------------------------------------------------ checks

    def verify(self) -> dict[str, Any]:
        """Recompute the served fingerprint in full; a mismatch taints the state."""
        served = self.full_fingerprint()
        ok = served == self.fingerprint
        if not ok:
            self.tainted = f"verify found fingerprint {served}, expected {self.fingerprint}"
            self.fingerprint = served
        return {"ok": ok, "fingerprint": served, "version": self.version}
