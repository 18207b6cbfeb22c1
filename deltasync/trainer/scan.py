"""The detector's compare: each weight's bf16 rounding now against its published snapshot.

:class:`~deltasync.trainer.detector.BF16ChangeDetector` keeps the snapshot and decides what to
compare and when; this module compares. On the CPU a weight is compared :data:`CHUNK` elements
at a time with NumPy; on an accelerator (or on the CPU with ``sliced``) in slices of
:data:`SLICE` elements, two passes with a host synchronization after each, on the detector's
own stream.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import torch

from ..format import Change
from ..format.fingerprint import DeviceHasher
from ..reader.chain import Patch
from .sharded import OwnedSlice, ShardLayout

CHUNK = 1 << 18
"""Elements compared (and streamed into an anchor) at a time on the CPU: the detector's scratch
buffers hold at most this many, whatever the largest parameter."""
SLICE = 1 << 23
"""Elements compared at a time on an accelerator. A slice's scratch (its bf16 rounding, the
snapshot slice when the snapshot is on the host, the mask, and the changed elements' indices)
stays under 112 MiB whatever the parameter's size and however many changed."""
BATCH = 1 << 22
"""Changed elements gathered on an accelerator before they are hashed and copied to the host
together, whichever weights they belong to: 48 MiB of indices and values, and 96 MiB of the
hasher's scratch. Per slice the gather queues a handful of kernels; per batch, the hashes and
three copies."""


def sync_point(device: torch.device) -> None:
    """Wait for the kernels this thread queued on ``device`` (an accelerator; a no-op on the
    CPU). Every wait of the detector goes through here, so that a test can count them."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()


def _nonzero_exact(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the ``count`` set elements of ``mask``, without the host synchronization
    of ``nonzero`` (the count is known already); plain ``nonzero`` where a device lacks that."""
    try:
        return torch.nonzero_static(mask, size=count).reshape(-1)
    except (NotImplementedError, RuntimeError):  # a device without nonzero_static: one wait more
        return mask.nonzero().reshape(-1)


class SnapshotScan:
    """The compare half of :class:`~deltasync.trainer.detector.BF16ChangeDetector`: its streams,
    its scratch buffers, and the passes that find the changed elements of the tracked weights.

    The state it reads is the detector's, set up by the detector's ``__init__``."""

    layout: ShardLayout | None
    _slices: dict[str, OwnedSlice]
    _tracked: dict[str, torch.Tensor]
    _snapshot: dict[str, torch.Tensor]
    _overlay: dict[str, Patch]
    _buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    _host_views: dict[torch.device, tuple[np.ndarray, np.ndarray, np.ndarray]]
    """NumPy views of the CPU's buffers (int16, int16, bool), made once."""
    _streams: dict[torch.device, Any]
    _ready: dict[torch.device, Any]
    last_timing: dict[str, float]

    def _stream(self, device: torch.device) -> Any:
        """The detector's own CUDA stream on ``device`` (None elsewhere)."""
        if device.type != "cuda":
            return None
        stream = self._streams.get(device)
        if stream is None:
            # The highest priority: its few, short kernels are scheduled between the blocks of
            # the trainer's long ones instead of after them.
            high, _low = torch.cuda.Stream.priority_range()
            stream = self._streams[device] = torch.cuda.Stream(device, priority=high)
        return stream

    def _drain(self, device: torch.device) -> None:
        """Wait for what the detector queued on ``device`` (its own stream, on CUDA)."""
        stream = self._streams.get(device)
        if stream is not None:
            stream.synchronize()
        else:
            sync_point(device)

    def _on_stream(self, device: torch.device) -> Any:
        """Run on the detector's stream of ``device``, after the work the trainer had queued when
        the version was captured
        (:meth:`~deltasync.trainer.detector.BF16ChangeDetector.hold_next_step`) or now."""
        stream = self._stream(device)
        if stream is None:
            return contextlib.nullcontext()
        ready = self._ready.pop(device, None)
        if ready is not None:
            stream.wait_event(ready)
        else:
            stream.wait_stream(torch.cuda.current_stream(device))
        return torch.cuda.stream(stream)

    def _mark_ready(self) -> None:
        """Record, on each CUDA device's current stream, the point the capture must read after."""
        for device in {t.device for t in self._tracked.values() if t.device.type == "cuda"}:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._ready[device] = event

    def _flat(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The elements of ``param`` this process compares, flat (its local shard when sharded)."""
        if self.layout is None:
            return param.detach().reshape(-1)
        return self._slices[name].local(param)

    def _offset(self, name: str) -> int:
        return 0 if self.layout is None else self._slices[name].begin

    def _scratch(self, device: torch.device, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reused bf16, bf16 and bool buffers of at most :data:`CHUNK` elements: allocating (and
        page-faulting) fresh ones for every parameter at every publish costs more than the
        conversion and comparison themselves, and none may scale with the largest tensor."""
        bufs = self._buffers.get(device)
        if bufs is None or bufs[0].numel() < numel:
            size = max(numel, min(CHUNK, max((t.numel() for t in self._snapshot.values()), default=0)))
            bufs = (
                torch.empty(size, dtype=torch.bfloat16, device=device),
                torch.empty(size, dtype=torch.bfloat16, device=device),
                torch.empty(size, dtype=torch.bool, device=device),
            )
            self._buffers[device] = bufs
            if device.type == "cpu":
                self._host_views[device] = (bufs[0].view(torch.int16).numpy(), bufs[1].view(torch.int16).numpy(), bufs[2].numpy())
        return bufs[0][:numel], bufs[1][:numel], bufs[2][:numel]

    def _compare(self, name: str) -> Change | None:
        """One parameter on the CPU against its published state, :data:`CHUNK` elements at a time.

        The chunks are compared and gathered with NumPy on int16 views made once per weight: a
        torch call (even a view) releases the GIL, and each release can cost a thread switch
        interval (5 ms) to take it back beside a thread that runs Python all the time, so a
        chunk makes a few such calls instead of a dozen (``benchmarks/gil.py``)."""
        snap = self._snapshot[name]
        flat = self._flat(name, self._tracked[name])
        overlay = self._overlay.get(name)
        numel = snap.numel()
        current_t, base_t, _ = self._scratch(snap.device, min(numel, CHUNK))
        scratch_current, scratch_base, diff = self._host_views[snap.device]  # int16, int16, bool
        snap_bits = snap.view(torch.int16).numpy()
        # bf16 weights are read where they are; others are rounded into the scratch a chunk at a time
        live_bits = None
        if flat.dtype == torch.bfloat16 and flat.is_contiguous():
            try:
                live_bits = flat.view(torch.int16).numpy()
            except (RuntimeError, TypeError):  # a tensor NumPy cannot view (a lazy negation, say): copied
                pass
        indices, news, olds = [], [], []
        for lo in range(0, numel, CHUNK):
            hi = min(lo + CHUNK, numel)
            if live_bits is None:
                current_t[: hi - lo].copy_(flat[lo:hi])  # rounds to nearest even, like Tensor.to
                current = scratch_current[: hi - lo]
            else:
                current = live_bits[lo:hi]
            if overlay is None:
                base = snap_bits[lo:hi]
            else:
                base_t[: hi - lo].copy_(snap[lo:hi])
                self._lay_overlay(base_t[: hi - lo], overlay, lo, hi)
                base = scratch_base[: hi - lo]
            np.not_equal(current, base, out=diff[: hi - lo])
            index = np.flatnonzero(diff[: hi - lo])  # several times faster here than nonzero
            if index.size:
                news.append(np.take(current, index))
                olds.append(np.take(base, index))
                index += lo
                indices.append(index)
        if not indices:
            return None
        offset = self._offset(name)
        index_np = indices[0] if len(indices) == 1 else np.concatenate(indices)
        if offset:
            index_np += offset
        new_np = news[0] if len(news) == 1 else np.concatenate(news)
        old_np = olds[0] if len(olds) == 1 else np.concatenate(olds)
        return Change(
            index=torch.from_numpy(index_np),
            new=torch.from_numpy(new_np).view(torch.bfloat16),
            old=torch.from_numpy(old_np).view(torch.bfloat16),
        )

    @staticmethod
    def _lay_overlay(base: torch.Tensor, overlay: Patch, lo: int, hi: int) -> None:
        """Write the commits a pin keeps aside that fall in ``lo .. hi - 1`` into ``base`` (that slice)."""
        first, last = torch.searchsorted(overlay.index, torch.tensor([lo, hi])).tolist()
        if last > first:
            where = overlay.index[first:last].to(base.device) - lo
            base.view(torch.int16)[where] = overlay.bits[first:last].to(base.device)

    def _pair(self, name: str, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slice ``lo .. hi - 1`` of a weight on an accelerator: its bf16 rounding now and its
        published state, both on the weight's device."""
        flat = self._flat(name, self._tracked[name])
        current = flat[lo:hi]
        if current.dtype != torch.bfloat16:
            current = current.to(torch.bfloat16)  # rounds to nearest even
        base = self._snapshot[name][lo:hi]
        overlay = self._overlay.get(name)
        if base.device != flat.device:
            base = base.to(flat.device, non_blocking=True)
        elif overlay is not None:
            base = base.clone()
        if overlay is not None:
            self._lay_overlay(base, overlay, lo, hi)
        return current, base

    def _device_changes(self, names: list[str]) -> tuple[dict[str, Change], int]:
        """The changes of weights on accelerators, and their fingerprint move summed there.

        Per device: a pass that counts each slice's changed elements, one synchronization to read
        the counts, a pass that gathers exactly those elements and queues their copies to the host
        (page-locked buffers for CUDA), and one synchronization for the copies."""
        by_device: dict[torch.device, list[str]] = {}
        for name in names:
            by_device.setdefault(self._flat(name, self._tracked[name]).device, []).append(name)
        out: dict[str, Change] = {}
        share = 0
        timing = {"count": 0.0, "gather": 0.0, "copy": 0.0}
        for device, group in by_device.items():
            pin = device.type == "cuda"
            start = time.perf_counter()
            with self._on_stream(device):
                plan: list[tuple[str, int, int]] = []
                sums = []
                for name in group:
                    numel = self._snapshot[name].numel()
                    for lo in range(0, numel, SLICE):
                        hi = min(lo + SLICE, numel)
                        current, base = self._pair(name, lo, hi)
                        sums.append(torch.ne(current.view(torch.int16), base.view(torch.int16)).sum())
                        plan.append((name, lo, hi))
                if not plan:
                    continue
                counts = torch.stack(sums).to("cpu").tolist()  # the first synchronization
                timing["count"] += time.perf_counter() - start
                start = time.perf_counter()
                found = self._gather(device, plan, counts, pin)
                timing["gather"] += time.perf_counter() - start
                if found is None:
                    continue
                changes, total = found
                start = time.perf_counter()
                sync_point(device)  # the second: the copies are on the host
                timing["copy"] += time.perf_counter() - start
                share += int(total)
                out.update(changes)
        self.last_timing = timing
        return out, share & ((1 << 64) - 1)

    def _gather(
        self, device: torch.device, plan: list[tuple[str, int, int]], counts: list[int], pin: bool
    ) -> tuple[dict[str, Change], torch.Tensor] | None:
        """The second pass on ``device``: the changed elements of each slice of ``plan``
        (``counts`` of them) gathered into :data:`BATCH`-sized buffers; each full batch hashed (the
        fingerprint move) and queued for one copy per field into host buffers (page-locked with
        ``pin``) that hold every weight's changes end to end. Returns each weight's change (views
        of those buffers, valid once the device is synchronized) and the move, still on the
        device; None where nothing changed."""
        changed = sum(counts)
        if not changed:
            return None
        hasher = DeviceHasher(device, chunk=BATCH)
        host = tuple(torch.empty(changed, dtype=dt, pin_memory=pin) for dt in (torch.int64, torch.bfloat16, torch.bfloat16))
        size = min(BATCH, changed)
        batch = (
            torch.empty(size, dtype=torch.int64, device=device),
            torch.empty(size, dtype=torch.bfloat16, device=device),
            torch.empty(size, dtype=torch.bfloat16, device=device),
        )
        runs: list[tuple[str, int, int]] = []  # (name, begin, end) in the batch
        filled, done = 0, 0  # elements in the batch; elements before it (hashed, copies queued)
        spans: dict[str, list[int]] = {}  # name -> [begin, end] in the host buffers

        def flush() -> None:
            nonlocal filled, done
            hasher.add_moves(batch[0][:filled], batch[1][:filled], batch[2][:filled], runs)
            for h, b in zip(host, batch):
                h[done : done + filled].copy_(b[:filled], non_blocking=True)
            # The next batch's kernels run on this stream after these copies: no wait here.
            done, filled = done + filled, 0
            runs.clear()

        for (name, lo, hi), count in zip(plan, counts):
            if not count:
                continue
            current, base = self._pair(name, lo, hi)
            at = _nonzero_exact(torch.ne(current.view(torch.int16), base.view(torch.int16)), count)
            offset = lo + self._offset(name)
            span = spans.setdefault(name, [done + filled, done + filled])
            p = 0
            while p < count:  # a slice with more changes than a batch holds goes in pieces
                if filled == size:
                    flush()
                n = min(count - p, size - filled)
                piece = at[p : p + n]
                torch.add(piece, offset, out=batch[0][filled : filled + n])
                torch.index_select(current, 0, piece, out=batch[1][filled : filled + n])
                torch.index_select(base, 0, piece, out=batch[2][filled : filled + n])
                runs.append((name, filled, filled + n))
                filled, p = filled + n, p + n
            span[1] = done + filled
        flush()
        total = torch.empty((), dtype=torch.int64, pin_memory=pin)
        total.copy_(hasher.total, non_blocking=True)
        changes = {
            name: Change(index=host[0][b:e], new=host[1][b:e], old=host[2][b:e]) for name, (b, e) in spans.items()
        }
        return changes, total
