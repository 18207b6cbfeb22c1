"""Quantized layers written in place: their load-time parameters, and flat views of any weight.

A quantized checkpoint (a view, :mod:`deltasync.views`) is loaded into layers whose parameters
vLLM rearranges after loading. Where, is the view scheme's live layout
(:class:`deltasync.views.LiveLayout`), interpreted here for vLLM's compressed-tensors layers:

- codes ``"transposed"`` (``FP8_DYNAMIC``: vLLM keeps the ``float8_e4m3fn`` weight as loaded,
  only transposed: ``weight`` becomes the ``[in, out]`` transpose of the ``[out, in]`` tensor the
  loader filled, sharing its storage): :func:`load_time_params` puts back, for the duration of a
  ``with``, parameters shaped and typed as at load time over the same storage (the weight's
  ``[out, in]`` transpose, the scale itself), with vLLM's own parameter classes and weight
  loaders, so that the model's loader maps and loads checkpoint tensors into the live storage
  again (discovery, an anchor's dense load);
- scales ``"widened"``: the scale stays in the float32 parameter it was loaded into (a bf16
  scale widened exactly); :class:`LiveFlat` writes it as the upper half of its bits.

:class:`LiveFlat` reads and writes a live parameter in storage order as 16-bit lanes, as the
element table says (:mod:`deltasync.format.dtypes`: a bf16 or one-byte element as its lane).

Codes ``"as_loaded"`` are not rearranged here. Layers that repack their weight for a kernel
(W8A8 int8 through oneDNN frees ``weight``): discovery finds them unfit, and they fall back to
the layerwise reload.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from deltasync.format.dtypes import find_element_type

if TYPE_CHECKING:
    from deltasync.views import ViewScheme

__all__ = ["WIDENED", "LiveFlat", "load_time_params", "storage_flat", "is_widening", "is_writable"]

WIDENED = torch.float32
"""The dtype a loader may widen a bf16 checkpoint tensor into (a view's scales, exactly): the
in-place writer keeps such a parameter as bf16 lanes, the upper half of its bits."""


def storage_flat(param: torch.Tensor) -> torch.Tensor:
    """``param``'s elements in storage order, flat (a view): the tensor itself, or the
    transpose of a 2-D parameter that is the transpose of a dense tensor."""
    data = param.data
    if data.is_contiguous():
        return data.view(-1)
    if data.dim() == 2 and data.t().is_contiguous():
        return data.t().view(-1)
    raise ValueError(f"a {tuple(data.shape)} parameter with strides {data.stride()} is not dense in any order")


class LiveFlat:
    """One live parameter, flat in storage order, read and written as int16 lanes."""

    def __init__(self, param: torch.Tensor) -> None:
        flat = storage_flat(param)
        self.dtype = flat.dtype
        kind = find_element_type(flat.dtype)
        if kind is not None:  # an element of a chain: its lanes' bits (int16, or uint8 for one byte)
            self.raw = flat.view(kind.raw)
        elif flat.dtype == WIDENED:  # a bf16 checkpoint value held widened (a scale)
            self.raw = flat.view(torch.int32)
        else:
            raise ValueError(f"a {flat.dtype} parameter cannot be written in place")
        self.device = flat.device

    @property
    def tensor(self) -> torch.Tensor:
        return self.raw

    def numel(self) -> int:
        return self.raw.numel()

    def read(self, dst: torch.Tensor) -> torch.Tensor:
        """The lanes at flat positions ``dst`` (on this parameter's device)."""
        got = self.raw.index_select(0, dst)
        if self.raw.dtype == torch.int32:  # the bf16 bits: the upper half, the lower one is zero
            got = got >> 16
        return got.to(torch.int16)  # a lane's bits zero-extended (no copy for int16)

    def write(self, dst: torch.Tensor, lanes: torch.Tensor) -> None:
        """Write ``lanes`` (int16, on this parameter's device) at flat positions ``dst``."""
        self.raw.scatter_(0, dst, self.encode(lanes))

    def encode(self, lanes: torch.Tensor) -> torch.Tensor:
        """Lanes as this parameter's raw bits (what :meth:`write` scatters)."""
        if self.raw.dtype == torch.int32:
            return (lanes.to(torch.int32) & 0xFFFF) << 16
        return lanes.to(self.raw.dtype)  # the lane's low bits (no copy for int16)

    def widened_exactly(self) -> bool:
        """For a float32 parameter: whether every value is a bf16 value (its lower 16 bits zero)."""
        return self.raw.dtype != torch.int32 or not bool((self.raw & 0xFFFF).any())


def _stand_ins(
    model: torch.nn.Module, scheme: ViewScheme | None
) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.nn.Parameter]]:
    """(layer, name, live parameter, load-time stand-in) for each parameter of a compressed-tensors
    layer that holds the codes of ``scheme`` (the view served; None: the bf16 chain) transposed,
    as the scheme's live layout says vLLM keeps them."""
    if scheme is None or scheme.live.codes != "transposed":
        return []
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED
    from vllm.model_executor.parameter import (
        BlockQuantScaleParameter,
        ChannelQuantScaleParameter,
        ModelWeightParameter,
    )

    found = []
    for module in model.modules():
        weight = module._parameters.get("weight")
        scale = module._parameters.get("weight_scale")
        if getattr(module, "scheme", None) is None or weight is None or scale is None or weight.dtype != scheme.code_dtype:
            continue
        if weight.dim() != 2 or weight.is_contiguous() or not weight.data.t().is_contiguous():
            continue  # not held transposed
        if scale.dim() != 2 or tuple(scale.shape) != scheme.scale_shape(tuple(weight.data.t().shape)):
            continue  # not the scheme's scale layout
        method = getattr(module, "quant_method", None)
        v2 = method is not None and type(method).__name__ in WEIGHT_LOADER_V2_SUPPORTED
        loader = module.weight_loader_v2 if v2 else module.weight_loader
        found.append((module, "weight", weight,
                      ModelWeightParameter(data=weight.data.t(), input_dim=1, output_dim=0, weight_loader=loader)))
        stand_in = (ChannelQuantScaleParameter(data=scale.data, output_dim=0, weight_loader=loader)
                    if scheme.block is None else
                    BlockQuantScaleParameter(data=scale.data, input_dim=1, output_dim=0, weight_loader=loader))
        found.append((module, "weight_scale", scale, stand_in))  # fmt: skip
    return found


@contextlib.contextmanager
def load_time_params(model: torch.nn.Module, scheme: ViewScheme | None) -> Iterator[int]:
    """Within the ``with``, the layers that hold ``scheme``'s codes transposed (its live layout;
    None: the bf16 chain, nothing to swap) hold their load-time parameters (over the live
    storage, see the module's docstring); the live ones are put back after, even on error.
    Yields how many parameters were swapped."""
    swaps = _stand_ins(model, scheme)
    for module, name, _, stand_in in swaps:
        module._parameters[name] = stand_in
    try:
        yield len(swaps)
    finally:
        for module, name, live, _ in swaps:
            module._parameters[name] = live


def is_widening(src: Any, dst: Any) -> bool:
    """Whether a copy from ``src`` to ``dst`` widens bf16 into float32 (exact: the in-place
    writer keeps such a parameter as bf16 lanes)."""
    return src.dtype == torch.bfloat16 and dst.dtype == WIDENED


def is_writable(dtype: torch.dtype, *, widen: bool) -> bool:
    """Whether the in-place writer holds a parameter of ``dtype``: an element type of a chain
    (:mod:`deltasync.format.dtypes`), or with ``widen`` (a view whose scales may be widened) the
    float32 a bf16 value is widened into."""
    return find_element_type(dtype) is not None or (widen and dtype == WIDENED)

