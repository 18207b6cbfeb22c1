"""Which checkpoint tensors an engine's module is rebuilt from: send them all, or none.

An engine that reloads modules (vLLM's layerwise reload, :mod:`vllm_ext._reload`) rebuilds a
fused module (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``: the model's
``packed_modules_mapping``; a fused-MoE layer's experts: ``landing``) only from ALL its parts.
:func:`reload_groups` says what to send with each changed tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["module_groups", "reload_groups"]


def module_groups(
    names: Iterable[str], packed: Mapping[str, Sequence[str]], landing: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """Checkpoint names grouped by the vLLM module that loads them.

    ``landing`` (checkpoint name -> the vLLM module it is loaded into, as discovered) decides
    where known. Otherwise ``model.layers.0.self_attn.q_proj.weight`` and ``...k_proj.bias``
    both belong to ``model.layers.0.self_attn.qkv_proj`` when ``packed`` maps ``qkv_proj`` to
    ``[q_proj, k_proj, v_proj]``; any other parameter belongs to its own module.
    """
    fused_of = {member: fused for fused, members in packed.items() for member in members}
    groups: dict[str, list[str]] = {}
    for name in names:
        if landing and name in landing:
            groups.setdefault(landing[name], []).append(name)
            continue
        module = name.rpartition(".")[0]
        parent, _, leaf = module.rpartition(".")
        if leaf in fused_of:
            module = f"{parent}.{fused_of[leaf]}" if parent else fused_of[leaf]
        groups.setdefault(module, []).append(name)
    return groups


def reload_groups(
    changed: Iterable[str], names: Sequence[str], packed: Mapping[str, Sequence[str]],
    landing: Mapping[str, str] | None = None,
) -> list[str]:
    """The parameters to send so that every module touched by ``changed`` is rebuilt whole.

    ``names`` is the full list of checkpoint names (its order is kept); ``landing`` as for
    :func:`module_groups`.
    """
    groups = module_groups(names, packed, landing)
    group_of = {name: key for key, members in groups.items() for name in members}
    wanted: set[str] = set()
    for name in changed:
        wanted.update(groups[group_of[name]])
    return [name for name in names if name in wanted]
