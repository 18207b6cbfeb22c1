"""Quantized layers written in place: vLLM's load-time parameters over the live storage.

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
  scale widened exactly); :class:`deltasync.server.live_flat.LiveFlat` writes it as the upper half of its bits.

Codes ``"as_loaded"`` are not rearranged here. Layers that repack their weight for a kernel
(W8A8 int8 through oneDNN frees ``weight``): discovery finds them unfit, and they fall back to
the layerwise reload.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch


if TYPE_CHECKING:
    from deltasync.views import ViewScheme

__all__ = ["load_time_params"]

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
