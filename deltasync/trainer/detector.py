"""Exact detection of which bf16 elements changed since the last publish."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..errors import ConfigError
from ..format import Change
from ..reader.chain import Patch
from .scan import CHUNK, SLICE, SnapshotScan, sync_point
from .sharded import OwnedSlice, ShardLayout
from .sources import SourceWeight, WeightSource, checkpoint_name, named_parameters, weight_source

__all__ = ["BF16ChangeDetector", "checkpoint_name", "named_parameters", "bf16_state_dict"]


def _free_device_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return None


def _readable(name: str, weight: Any) -> None:
    """A ConfigError unless the publisher can read the weight where it lives (judged from its
    device alone: a weight source may compute its values, which is not done here)."""
    device = torch.device(weight.device)
    if device.type == "meta":
        raise ConfigError(
            f"weight {name!r} is on the meta device (it has a shape but no values): materialise the model "
            "(to_empty() and load its weights, or build it on a real device) before publishing it"
        )
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is not None and device.index >= count:
            raise ConfigError(f"weight {name!r} is on {device}, but this process sees {count} CUDA device(s)")


def bf16_state_dict(model: torch.nn.Module, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every parameter rounded to bf16 (round to nearest even, as ``Tensor.to`` does)."""
    return {
        name: param.detach().to(device=device, dtype=torch.bfloat16, copy=True).contiguous()
        for name, param in named_parameters(model)
    }


def _inner_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """The torch optimizer behind wrappers such as accelerate's ``AcceleratedOptimizer``."""
    # Wrappers such as accelerate's subclass Optimizer themselves but keep their own hooks
    # unused: the hook must go on the optimizer that actually steps, the innermost one.
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optimizer: {type(optimizer).__name__} is not a torch.optim.Optimizer and wraps none "
            "(pass the torch optimizer, or None to compare every trainable parameter)"
        )
    return optimizer


class BF16ChangeDetector(SnapshotScan):
    """Finds exactly which elements of each weight's bf16 value changed since the last publish.

    It keeps the bf16 state that was last *published* and compares the current bf16 rounding
    of each tracked weight against it, bit for bit. Because the comparison is against what
    receivers hold, not against the state before the last optimizer step, several optimizer
    steps between publishes, gradient accumulation and skipped steps are all exact.

    The weights come from a :class:`~deltasync.trainer.sources.WeightSource`: a plain module's
    parameters (:class:`~deltasync.trainer.sources.ModelWeights`, what a module passed as ``model``
    is read through), a LoRA model's merged weights or its adapter alone
    (:mod:`deltasync.trainer.lora`), or a source of one's own. A weight is tracked when a trainable
    parameter in the optimizer (any trainable one, without an optimizer) steps it; the others
    never appear in deltas, only in anchors. With an ``optimizer``, a post-step hook records
    which weights a step touched (one of their parameters had a gradient); only those are
    compared at publish time.

    Several processes (``torch.distributed`` initialised): with FSDP2 (``Shard(0)`` DTensor
    parameters, uneven and empty shards included) each rank compares only its local shard
    against a bf16 snapshot of that shard, so it keeps 2 bytes per *local* element and never
    gathers a parameter; indices in the changes are flat indices of the full parameter. With
    DDP rank 0 alone keeps a snapshot; with HSDP one replica group does (see :attr:`layout`).

    Args:
        model: the model being trained (wrappers such as DDP are fine), or a weight source.
        optimizer: the optimizer stepping it, or None.
        snapshot_device: where the bf16 snapshot lives: "auto" (the default: each weight's own
            accelerator while ``snapshot_budget`` holds it, else the host), "cpu" (host memory,
            pinned for weights on CUDA), None (each weight's own device, whatever it costs), or
            a device.
        snapshot_budget: the most bytes of accelerator memory the snapshot may take on each
            device; None: half the memory free on that device when the detector is built.
            With ``snapshot_device`` None or a device, a snapshot larger than this is a
            :class:`~deltasync.ConfigError`; with "auto" it goes to the host instead.

    On an accelerator, each weight is compared in slices of :data:`SLICE` elements: a first
    pass counts the changed elements of every slice (one host synchronization per device), a
    second one copies exactly those elements out (no synchronization per slice), and the
    host waits once more for the copies. The detector's scratch stays within 256 MiB; the
    changes' fingerprint move is summed on the device on the way (:attr:`last_share`).
    """

    def __init__(
        self,
        model: torch.nn.Module | WeightSource,
        optimizer: object | None = None,
        *,
        snapshot_device: str | torch.device | None = "auto",
        snapshot_budget: int | None = None,
    ) -> None:
        self.source = weight_source(model)
        """Where the weights come from."""
        self._auto = isinstance(snapshot_device, str) and snapshot_device == "auto"
        if snapshot_budget is not None and snapshot_budget < 0:
            raise ConfigError(f"snapshot_budget must be >= 0 bytes, got {snapshot_budget}")
        self._budget = snapshot_budget
        self._snapshot_device = None if snapshot_device is None or self._auto else torch.device(snapshot_device)
        weights = self.source.weights()
        self.layout: ShardLayout | None = self.source.layout()
        """How ranks split the work; None in a single process."""
        self._slices: dict[str, OwnedSlice] = {} if self.layout is None else self.layout.slices
        inner = None if optimizer is None else _inner_optimizer(optimizer)
        steppers = self._steppers(weights, inner)
        # Only what this rank owns is compared here; other ranks own the rest.
        self._tracked = {
            w.name: w.value
            for w in weights
            if steppers[w.name] and (self.layout is None or self._slices[w.name].end > self._slices[w.name].begin)
        }
        # id of a parameter -> the tracked weights its steps change
        self._by_id: dict[int, list[str]] = {}
        for name in self._tracked:
            for param in steppers[name]:
                self._by_id.setdefault(id(param), []).append(name)
        self._hooks = [] if inner is None else [
            inner.register_step_post_hook(self._on_step),
            inner.register_step_pre_hook(self._before_step),
        ]
        # name -> number of the last optimizer step that touched it (None: no optimizer, every
        # tracked weight may change)
        self._marks: dict[str, int] | None = None if inner is None else {}
        self._gate: threading.Event | None = None
        self._gate_waiting: float | None = None
        self._step = 0
        self._captured_at = 0
        self._pending_at = 0
        self._snapshot: dict[str, torch.Tensor] = {}
        self._buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._host_views = {}
        # Guards the marks (the optimizer hook runs in the training thread, commits may run in
        # a publisher's background thread) and the snapshot against a pin's end.
        self._lock = threading.RLock()
        self._pins = 0
        # While pinned: parameter -> the committed values kept aside (see commit).
        self._overlay: dict[str, Patch] = {}
        for name, value in self._tracked.items():
            _readable(name, value)
        self._placement = self._place()
        # One stream per CUDA device for the detector's own work, so that a capture that overlaps
        # the trainer's next gradients runs beside them, not queued behind them.
        self._streams: dict[torch.device, Any] = {}
        self._ready: dict[torch.device, Any] = {}
        self.last_timing: dict[str, float] = {}
        """Seconds the last :meth:`changes` spent on accelerators' weights: queueing the counts and
        waiting for them ("count"), queueing the gathers and copies ("gather"), waiting for the
        copies ("copy")."""
        self.sliced = False
        """Compare weights on the CPU the way accelerators do (two passes over large slices)
        instead of in small chunks with NumPy; slower on most CPUs, it is there so that the
        accelerators' path runs and is checked on any machine."""
        self.last_share: int | None = None
        """The fingerprint move of the changes last returned by :meth:`changes` (the sum of
        their new elements' hashes minus their old ones', at their flat indices under their
        own names), where it was summed on the device; None where it was not."""
        self.reset()

    def _place(self) -> dict[str, torch.device]:
        """Where each tracked weight's snapshot lives (see ``snapshot_device`` and ``snapshot_budget``)."""
        own = {name: torch.device(value.device) for name, value in self._tracked.items()}
        cpu = torch.device("cpu")

        def target(name: str) -> torch.device:
            if self._auto:
                return own[name]
            return own[name] if self._snapshot_device is None else self._snapshot_device

        need: dict[torch.device, int] = {}
        for name, value in self._tracked.items():
            device = target(name)
            if device.type != "cpu" or not self._auto:
                owned = value.numel() if self.layout is None else self._slices[name].end - self._slices[name].begin
                need[device] = need.get(device, 0) + 2 * owned
        fits: dict[torch.device, bool] = {}
        for device, nbytes in need.items():
            budget = self._budget
            if budget is None:
                free = _free_device_memory(device) if self._auto else None
                budget = nbytes if free is None else free // 2
            fits[device] = nbytes <= budget
            if not fits[device] and not self._auto:
                raise ConfigError(
                    f"the bf16 snapshot of the tracked weights needs {nbytes / 2**20:.1f} MiB on {device}, more than "
                    f"snapshot_budget={budget} bytes ({budget / 2**20:.1f} MiB); raise snapshot_budget, or let the "
                    "detector choose (snapshot_device='auto' keeps it on the host where the device cannot hold it)"
                )
        placement: dict[str, torch.device] = {}
        for name in self._tracked:
            device = target(name)
            placement[name] = device if device.type == "cpu" or fits.get(device, False) else cpu
        return placement

    @property
    def snapshot_devices(self) -> dict[str, str]:
        """Where each tracked weight's snapshot lives (checkpoint name -> device)."""
        return {name: str(device) for name, device in self._placement.items()}

    def _steppers(self, weights: list[SourceWeight], inner: torch.optim.Optimizer | None) -> dict[str, list[torch.Tensor]]:
        """Each weight's parameters that can step it: trainable, and in the optimizer if there is one."""
        steppers = {w.name: [p for p in w.stepped_by if p.requires_grad] for w in weights}
        if inner is None:
            return steppers
        in_optimizer = {id(p) for group in inner.param_groups for p in group["params"]}
        if self.layout is not None:
            unseen = [n for n, ps in steppers.items() if any(id(p) not in in_optimizer for p in ps)]
            if unseen:
                raise ConfigError(
                    f"{len(unseen)} trainable parameter(s) are not in the optimizer ({', '.join(unseen[:5])}"
                    f"{', ...' if len(unseen) > 5 else ''}); with {self.layout.description} the optimizer must hold "
                    "the model's own parameters (wrap the model before building the optimizer, and pass that "
                    "optimizer), or freeze them with requires_grad_(False)"
                )
        return {n: [p for p in ps if id(p) in in_optimizer] for n, ps in steppers.items()}

    @property
    def overlap_problem(self) -> str | None:
        """Why :meth:`changes` may not run in another thread while the trainer goes on to its
        next gradients, or None if it may (it needs the optimizer, whose next step it holds,
        and a source whose values need no collective)."""
        problem = self.source.overlap_problem
        if problem is None and not self._hooks:
            problem = "the detector was built without the optimizer, whose next step it must hold"
        return problem

    def hold_next_step(self) -> Callable[[], float]:
        """Make the optimizer's next step wait, until the returned ``release()`` is called.

        So a capture may run in another thread while the trainer computes its next gradients:
        nothing changes the weights before the step. ``release()`` returns the seconds a step
        waited for it (0 if none came in the meantime)."""
        problem = self.overlap_problem
        if problem is not None:
            raise ConfigError(f"cannot hold the next step: {problem}")
        gate = self._gate = threading.Event()
        self._mark_ready()

        def release() -> float:
            now, since = time.perf_counter(), self._gate_waiting
            gate.set()
            return 0.0 if since is None else now - since

        return release

    def _before_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        gate = self._gate
        if gate is not None and not gate.is_set():
            self._gate_waiting = time.perf_counter()
            gate.wait()
        self._gate, self._gate_waiting = None, None

    @property
    def tracked(self) -> list[str]:
        """Checkpoint names of the parameters that can appear in deltas."""
        return list(self._tracked)

    @property
    def steps_since_publish(self) -> int:
        """Optimizer steps seen since the state last published was captured."""
        return self._step - self._captured_at

    def _on_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        with self._lock:
            self._step += 1
            assert self._marks is not None
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        for name in self._by_id.get(id(p), ()):
                            self._marks[name] = self._step

    @property
    def snapshot_bytes(self) -> int:
        """Bytes this process keeps for the last published state (2 per owned element)."""
        return sum(t.numel() * t.element_size() for t in self._snapshot.values())

    def reset(self) -> None:
        """Take the current bf16 values as the published state (a version without a delta).

        The snapshot is overwritten in place, chunk by chunk: no second copy of it exists at
        any time. Must not be called while an anchor streams from the snapshot (:meth:`pin`).
        """
        self.source.prepare()
        with self._lock:
            if self._pins:
                raise RuntimeError("reset() while an anchor streams from the snapshot")
            self._overlay.clear()
            for name, param in self._tracked.items():
                flat = self._flat(name, param)
                snap = self._snapshot.get(name)
                if snap is None or snap.numel() != flat.numel():
                    device = self._placement[name]
                    pin = device.type == "cpu" and flat.device.type == "cuda"
                    snap = self._snapshot[name] = torch.empty(flat.numel(), dtype=torch.bfloat16, device=device, pin_memory=pin)
                step = CHUNK if flat.device.type == "cpu" else SLICE
                with self._on_stream(flat.device):
                    for lo in range(0, flat.numel(), step):
                        snap[lo : lo + step].copy_(flat[lo : lo + step], non_blocking=True)  # rounds to nearest even
                    sync_point(flat.device)
            if self._marks is not None:
                self._marks.clear()
            self._captured_at = self._pending_at = self._step

    def changes(self) -> dict[str, Change]:
        """Changed elements per tracked parameter since the last publish; nothing is updated.

        Returns only parameters with at least one change. Indices are int64 on the CPU; ``new``
        and ``old`` are the bf16 values now and at the last publish. Optimizer steps after this
        call are kept for the next publish even if :meth:`commit` comes after them.
        """
        self.source.prepare()
        with self._lock:
            self._pending_at = self._step
            marks = self._marks
            names = list(self._tracked) if marks is None else [n for n in self._tracked if n in marks]
            on_host = [n for n in names if self._flat(n, self._tracked[n]).device.type == "cpu"
                       and self._snapshot[n].device.type == "cpu" and not self.sliced]
            out: dict[str, Change] = {}
            for name in on_host:
                change = self._compare(name)
                if change is not None:
                    out[name] = change
            host = set(on_host)
            found, share = self._device_changes([n for n in names if n not in host])
            self.last_share = None if on_host else share
            return {name: out.get(name) or found[name] for name in names if name in out or name in found}

    def commit(self, changes: dict[str, Change]) -> None:
        """Record that ``changes`` were published: the snapshot now holds their new values.

        While an anchor streams from the snapshot (:meth:`pin`), the new values are kept aside
        (they are few) and compared as if written; the pin's end writes them.
        """
        with self._lock:
            for name, change in changes.items():
                offset = self._offset(name)
                index = change.index - offset if offset else change.index
                if self._pins:
                    # Copies: a Patch keeps the first tensors it is given, and these are the caller's.
                    patch = self._overlay.get(name)
                    if patch is None:
                        self._overlay[name] = Patch(index.clone(), change.new.view(torch.int16).clone())
                    else:
                        patch.merge(index.clone(), change.new.view(torch.int16).clone())
                else:
                    snap = self._snapshot[name]
                    if snap.device.type == index.device.type == change.new.device.type == "cpu":
                        # NumPy: one call, where torch's index_put_ makes several (a model of
                        # many small tensors pays for each).
                        snap.view(torch.int16).numpy()[index.numpy()] = change.new.view(torch.int16).numpy()
                        continue
                    stream = self._stream(snap.device)
                    # On an accelerator, a slice of the changes at a time: the copies of their
                    # indices and values there stay within the detector's scratch.
                    step = index.numel() if snap.device.type == "cpu" else SLICE
                    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
                        for lo in range(0, index.numel(), max(step, 1)):
                            at = index[lo : lo + step].to(snap.device, non_blocking=True)
                            snap[at] = change.new[lo : lo + step].to(snap.device, non_blocking=True)
            for device in {self._snapshot[n].device for n in changes if n in self._snapshot}:
                self._drain(device)
            captured = self._pending_at
            if self._marks is not None:
                for name in [n for n, step in self._marks.items() if step <= captured]:
                    del self._marks[name]
            self._captured_at = captured

    def pin(self) -> None:
        """Freeze the snapshot for an anchor that streams from it: until :meth:`unpin`, commits
        are kept aside and the snapshot's bytes stay the published state of this moment."""
        with self._lock:
            self._pins += 1

    def unpin(self) -> None:
        """End a :meth:`pin`: the commits kept aside are written into the snapshot."""
        with self._lock:
            self._pins -= 1
            if self._pins:
                return
            for name, patch in self._overlay.items():
                snap = self._snapshot[name]
                stream = self._stream(snap.device)
                with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
                    snap.view(torch.int16)[patch.index.to(snap.device)] = patch.bits.to(snap.device)
                self._drain(snap.device)
            self._overlay.clear()

    def is_tracked(self, name: str) -> bool:
        """Whether ``name`` is compared (its published state is in the snapshot)."""
        return name in self._snapshot

    def snapshot_chunks(self, name: str) -> Iterator[torch.Tensor]:
        """The published bf16 values of a tracked parameter (this rank's elements), in chunks
        of :data:`CHUNK` elements, read from the snapshot itself (no copy)."""
        snap = self._snapshot[name]
        for lo in range(0, snap.numel(), CHUNK):
            yield snap[lo : lo + CHUNK]

    def snapshot_flat(self, name: str) -> torch.Tensor:
        """The published bf16 values of a tracked parameter (this rank's elements), flat: the
        snapshot itself, not a copy. Read it only while :meth:`pin` holds it."""
        return self._snapshot[name]

    def published_flat(self, name: str, begin: int = 0, end: int | None = None) -> torch.Tensor:
        """The published bf16 values of a tracked parameter (this rank's elements ``begin ..
        end - 1``; all of them by default), flat, at the newest commit: a copy of the snapshot's
        range with the commits a :meth:`pin` keeps aside laid over it."""
        with self._lock:
            snapshot = self._snapshot[name]
            end = snapshot.numel() if end is None else end
            flat = snapshot[begin:end].clone()
            patch = self._overlay.get(name)
            if patch is not None and patch.index.numel():
                # The patch's sorted indices: a block's commits are one slice of them (an MoE
                # view reads a fused tensor one expert at a time).
                self._lay_overlay(flat, patch, begin, end)
            return flat

    def close(self) -> None:
        """Remove the optimizer hooks."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
