"""Exact detection of which bf16 elements changed since the last publish."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from ._errors import ConfigError
from ._format import Change
from ._sharded import OwnedSlice, ShardLayout, check_not_zero3, shard_layout

__all__ = ["BF16ChangeDetector", "checkpoint_name", "named_parameters", "bf16_state_dict"]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def checkpoint_name(name: str) -> str:
    """A parameter's checkpoint (Hugging Face) name: wrapper prefixes removed anywhere in it.

    DDP adds ``module.``, ``torch.compile`` adds ``_orig_mod.`` and FSDP / activation
    checkpointing add their own; none of them is part of the checkpoint a server loads.
    """
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace("." + prefix, ".")
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


def named_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """Each distinct parameter once (tied weights under their first name), checkpoint-named."""
    seen: set[str] = set()
    for name, param in model.named_parameters():
        key = checkpoint_name(name)
        if key in seen:
            raise ConfigError(f"two parameters map to the checkpoint name {key!r}")
        seen.add(key)
        yield key, param


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


class BF16ChangeDetector:
    """Finds exactly which elements of each parameter's bf16 value changed since the last publish.

    It keeps the bf16 state that was last *published* and compares the current bf16 rounding
    of each tracked parameter against it, bit for bit. Because the comparison is against what
    receivers hold, not against the state before the last optimizer step, several optimizer
    steps between publishes, gradient accumulation and skipped steps are all exact.

    With an ``optimizer``, a post-step hook records which parameters the optimizer stepped
    (those with a gradient); only those are compared at publish time. Tracked parameters are
    the trainable ones inside the optimizer (or every trainable one without an optimizer);
    the others never appear in deltas, only in anchors.

    Several processes (``torch.distributed`` initialised): with FSDP2 (``Shard(0)`` DTensor
    parameters, uneven and empty shards included) each rank compares only its local shard
    against a bf16 snapshot of that shard, so it keeps 2 bytes per *local* element and never
    gathers a parameter; indices in the changes are flat indices of the full parameter. With
    DDP rank 0 alone keeps a snapshot; with HSDP one replica group does (see :attr:`layout`).

    Args:
        model: the model being trained (wrappers such as DDP are fine).
        optimizer: the optimizer stepping it, or None.
        snapshot_device: where the bf16 snapshot lives: "cpu" (default; costs host memory,
            not accelerator memory) or None for each parameter's own device (fastest compare).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: object | None = None,
        *,
        snapshot_device: str | torch.device | None = "cpu",
    ) -> None:
        self._model = model
        self._snapshot_device = None if snapshot_device is None else torch.device(snapshot_device)
        check_not_zero3(model)
        params = dict(named_parameters(model))
        self.layout: ShardLayout | None = shard_layout(list(params.items()))
        """How ranks split the work; None in a single process."""
        self._slices: dict[str, OwnedSlice] = {} if self.layout is None else self.layout.slices
        if optimizer is not None:
            inner = _inner_optimizer(optimizer)
            in_optimizer = {id(p) for group in inner.param_groups for p in group["params"]}
            if self.layout is not None:
                unseen = [n for n, p in params.items() if p.requires_grad and id(p) not in in_optimizer]
                if unseen:
                    raise ConfigError(
                        f"{len(unseen)} trainable parameter(s) are not in the optimizer ({', '.join(unseen[:5])}"
                        f"{', ...' if len(unseen) > 5 else ''}); with {self.layout.description} the optimizer must hold "
                        "the model's own parameters (wrap the model before building the optimizer, and pass that "
                        "optimizer), or freeze them with requires_grad_(False)"
                    )
            self._tracked = {n: p for n, p in params.items() if p.requires_grad and id(p) in in_optimizer}
            self._hook = inner.register_step_post_hook(self._on_step)
            # name -> number of the last optimizer step that touched it
            self._marks: dict[str, int] | None = {}
        else:
            self._tracked = {n: p for n, p in params.items() if p.requires_grad}
            self._hook = None
            self._marks = None
        if self.layout is not None:
            # Only what this rank owns is compared here; other ranks own the rest.
            self._tracked = {n: p for n, p in self._tracked.items() if self._slices[n].end > self._slices[n].begin}
        self._step = 0
        self._captured_at = 0
        self._pending_at = 0
        self._by_id = {id(p): n for n, p in self._tracked.items()}
        self._snapshot: dict[str, torch.Tensor] = {}
        self._buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset()

    @property
    def tracked(self) -> list[str]:
        """Checkpoint names of the parameters that can appear in deltas."""
        return list(self._tracked)

    @property
    def steps_since_publish(self) -> int:
        """Optimizer steps seen since the state last published was captured."""
        return self._step - self._captured_at

    def _on_step(self, optimizer: torch.optim.Optimizer, args: object, kwargs: object) -> None:
        self._step += 1
        assert self._marks is not None
        for group in optimizer.param_groups:
            for p in group["params"]:
                name = self._by_id.get(id(p))
                if name is not None and p.grad is not None:
                    self._marks[name] = self._step

    @property
    def snapshot_bytes(self) -> int:
        """Bytes this process keeps for the last published state (2 per owned element)."""
        return sum(t.numel() * t.element_size() for t in self._snapshot.values())

    def _flat(self, name: str, param: torch.Tensor) -> torch.Tensor:
        """The elements of ``param`` this process compares, flat (its local shard when sharded)."""
        if self.layout is None:
            return param.detach().reshape(-1)
        return self._slices[name].local(param)

    def _offset(self, name: str) -> int:
        return 0 if self.layout is None else self._slices[name].begin

    def _current(self, param: torch.Tensor, name: str | None = None) -> torch.Tensor:
        flat = param.detach().reshape(-1) if name is None else self._flat(name, param)
        device = flat.device if self._snapshot_device is None else self._snapshot_device
        return flat.to(device=device, dtype=torch.bfloat16)

    def _scratch(self, device: torch.device, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused bf16 and bool buffers: allocating (and page-faulting) fresh ones for every
        parameter at every publish costs more than the conversion and comparison themselves."""
        bufs = self._buffers.get(device)
        if bufs is None or bufs[0].numel() < numel:
            size = max(numel, max(t.numel() for t in self._snapshot.values()))
            bufs = (torch.empty(size, dtype=torch.bfloat16, device=device), torch.empty(size, dtype=torch.bool, device=device))
            self._buffers[device] = bufs
        return bufs[0][:numel], bufs[1][:numel]

    def reset(self) -> None:
        """Take the current bf16 values as the published state (after an anchor)."""
        self._snapshot = {name: self._current(p, name).clone() for name, p in self._tracked.items()}
        if self._marks is not None:
            self._marks.clear()
        self._captured_at = self._pending_at = self._step

    def changes(self) -> dict[str, Change]:
        """Changed elements per tracked parameter since the last publish; nothing is updated.

        Returns only parameters with at least one change. Indices are int64 on the CPU; ``new``
        and ``old`` are the bf16 values now and at the last publish. Optimizer steps after this
        call are kept for the next publish even if :meth:`commit` comes after them.
        """
        self._pending_at = self._step
        marks = self._marks
        names = list(self._tracked) if marks is None else [n for n in self._tracked if n in marks]
        out: dict[str, Change] = {}
        for name in names:
            param = self._tracked[name]
            snap = self._snapshot[name]
            current, diff = self._scratch(snap.device, snap.numel())
            current.copy_(self._flat(name, param))  # rounds to nearest even, like Tensor.to
            torch.ne(current.view(torch.int16), snap.view(torch.int16), out=diff)
            if diff.device.type == "cpu":
                index = torch.from_numpy(np.flatnonzero(diff.numpy()))  # several times faster here
            else:
                index = diff.nonzero().reshape(-1)
            if index.numel():
                offset = self._offset(name)
                out[name] = Change(
                    index=index.cpu() + offset if offset else index.cpu(),
                    new=current[index].cpu(),
                    old=snap[index].cpu(),
                )
        return out

    def commit(self, changes: dict[str, Change]) -> None:
        """Record that ``changes`` were published: the snapshot now holds their new values."""
        for name, change in changes.items():
            snap = self._snapshot[name]
            offset = self._offset(name)
            index = change.index - offset if offset else change.index
            snap[index.to(snap.device)] = change.new.to(snap.device)
        captured = self._pending_at
        if self._marks is not None:
            for name in [n for n, step in self._marks.items() if step <= captured]:
                del self._marks[name]
        self._captured_at = captured

    def close(self) -> None:
        """Remove the optimizer hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
