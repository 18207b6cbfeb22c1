"""Quantized layers written in place: their load-time parameters, and flat views of any weight.

A quantized checkpoint (a view, :mod:`deltasync.views`) is loaded into layers whose parameters
vLLM rearranges after loading. compressed-tensors' channel-wise FP8 layers keep their
``float8_e4m3fn`` weight as loaded, only transposed (``weight`` becomes the ``[in, out]``
transpose of the ``[out, in]`` tensor the loader filled, sharing its storage), and keep their
scale in the float32 parameter it was loaded into (a bf16 scale widened exactly). Nothing is
repacked, so both can be written in place, element by element:

- :func:`load_time_params` puts back, for the duration of a ``with``, parameters shaped and
  typed as at load time over the same storage (the weight's ``[out, in]`` transpose, the scale
  itself), with vLLM's own parameter classes and weight loaders, so that the model's loader
  maps and loads checkpoint tensors into the live storage again (discovery, an anchor's dense
  load);
- :class:`LiveFlat` reads and writes a live parameter in storage order as 16-bit lanes
  (:mod:`deltasync.format.dtypes`): a bf16 or one-byte element as its lane, a bf16 value held
  widened in float32 as the upper half of its bits.

Layers that repack their weight for a kernel (W8A8 int8 through oneDNN frees ``weight``) are
not rearranged here: discovery finds them unfit, and they fall back to the layerwise reload.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["LiveFlat", "load_time_params", "storage_flat", "is_widening"]

_ONE_BYTE = (torch.float8_e4m3fn, torch.int8)


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
        if flat.dtype == torch.bfloat16:
            self.raw = flat.view(torch.int16)
        elif flat.dtype in _ONE_BYTE:
            self.raw = flat.view(torch.uint8)
        elif flat.dtype == torch.float32:  # a bf16 checkpoint value held widened (a scale)
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
        if self.raw.dtype == torch.int16:
            return got
        if self.raw.dtype == torch.uint8:
            return got.to(torch.int16)
        return (got >> 16).to(torch.int16)  # the bf16 bits: the upper half, the lower one is zero

    def write(self, dst: torch.Tensor, lanes: torch.Tensor) -> None:
        """Write ``lanes`` (int16, on this parameter's device) at flat positions ``dst``."""
        self.raw.scatter_(0, dst, self.encode(lanes))

    def encode(self, lanes: torch.Tensor) -> torch.Tensor:
        """Lanes as this parameter's raw bits (what :meth:`write` scatters)."""
        if self.raw.dtype == torch.int16:
            return lanes
        if self.raw.dtype == torch.uint8:
            return lanes.to(torch.uint8)
        return (lanes.to(torch.int32) & 0xFFFF) << 16

    def widened_exactly(self) -> bool:
        """For a float32 parameter: whether every value is a bf16 value (its lower 16 bits zero)."""
        return self.raw.dtype != torch.int32 or not bool((self.raw & 0xFFFF).any())


def _stand_ins(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Parameter, torch.nn.Parameter]]:
    """(layer, name, live parameter, load-time stand-in) for each parameter of a channel-wise
    FP8 compressed-tensors layer."""
    found = []
    for module in model.modules():
        scheme = getattr(module, "scheme", None)
        weight = module._parameters.get("weight")
        scale = module._parameters.get("weight_scale")
        if scheme is None or weight is None or scale is None or weight.dtype != torch.float8_e4m3fn:
            continue
        if type(scheme).__name__ != "CompressedTensorsW8A8Fp8" or weight.dim() != 2 or weight.is_contiguous():
            continue
        if not weight.data.t().is_contiguous() or scale.dim() != 2 or scale.shape[1] != 1:
            continue  # not the channel-wise layout (a block-wise weight keeps [out, in])
        from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED
        from vllm.model_executor.parameter import ChannelQuantScaleParameter, ModelWeightParameter

        method = getattr(module, "quant_method", None)
        v2 = method is not None and type(method).__name__ in WEIGHT_LOADER_V2_SUPPORTED
        loader = module.weight_loader_v2 if v2 else module.weight_loader
        found.append((module, "weight", weight,
                      ModelWeightParameter(data=weight.data.t(), input_dim=1, output_dim=0, weight_loader=loader)))
        found.append((module, "weight_scale", scale,
                      ChannelQuantScaleParameter(data=scale.data, output_dim=0, weight_loader=loader)))  # fmt: skip
    return found


@contextlib.contextmanager
def load_time_params(model: torch.nn.Module) -> Iterator[int]:
    """Within the ``with``, channel-wise FP8 layers hold their load-time parameters (over the
    live storage, see the module's docstring); the live ones are put back after, even on
    error. Yields how many parameters were swapped."""
    swaps = _stand_ins(model)
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
    return src.dtype == torch.bfloat16 and dst.dtype == torch.float32

