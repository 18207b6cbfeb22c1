"""Which weights a view quantizes: llm-compressor's ``targets=["Linear"]`` with an ``ignore`` list.

llm-compressor quantizes the weight of every module that compressed-tensors' ``is_match`` matches
with ``"Linear"`` (the class or one of its bases is ``torch.nn.Linear``) and that no ``ignore``
entry matches. An ignore entry is an exact module name, a ``re:`` regular expression matched with
``re.match`` (anchored at the start, not the end) against the module name, or a class name;
compressed-tensors' own ``is_match`` decides here too.

Names are checkpoint names. Where transformers holds weights in another layout than its
checkpoint, the checkpoint's module names are the ones matched and returned:

- **Fused MoE experts.** transformers 5 keeps experts fused (Qwen3-MoE's
  ``mlp.experts.gate_up_proj`` of shape ``(experts, 2 * inter, hidden)``); checkpoints hold them per
  expert (``mlp.experts.{e}.gate_proj.weight``, see ``deltasync.trainer.checkpoint_layout``). llm-compressor
  linearizes such experts into per-expert ``nn.Linear`` modules of those names before it quantizes,
  so here every 2-D per-expert checkpoint tensor of a fused (3-D) parameter is a Linear target
  named by its checkpoint module (``mlp.experts.{e}.gate_proj``), ignorable by that name.
- **The router** (``mlp.gate``) is no ``nn.Linear`` in transformers 5 (Qwen3-MoE's
  ``Qwen3MoeTopKRouter``), so ``targets=["Linear"]`` leaves it in bf16, as llm-compressor does with
  ``ignore=["lm_head"]``. vLLM builds it as a linear layer, so the config's ``ignore`` list must name
  it: :func:`ignore_list` does, as compressed-tensors' ``QuantizationConfig.from_pretrained`` does
  (a module whose class name holds "Router", "Gate" or "Gating" counts as Linear there).
- Renamed modules (Mixtral's live ``mlp`` is ``block_sparse_moe`` on disk) are matched by their
  checkpoint names, the names vLLM matches the config's ``ignore`` against.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..views.schemes.preset import compressed_tensors

__all__ = ["ignore_list", "quantized_names"]

_ROUTER = re.compile(r"Router|Gate|Gating")


@dataclass(frozen=True)
class _Target:
    module: str
    """The checkpoint module name (the weight is ``module + ".weight"``)."""
    type_name: str
    """The module's type as compressed-tensors names it for the config's ignore list."""
    quantized: bool


def quantized_names(model: torch.nn.Module, names: Iterable[str], ignore: Sequence[str] = ("lm_head",)) -> set[str]:
    """The checkpoint names among ``names`` of the weights llm-compressor quantizes in ``model``
    with ``targets=["Linear"]`` and ``ignore`` (see the module docstring for MoE experts and routers)."""
    quantized = {t.module + ".weight" for t in _targets(model, ignore) if t.quantized}
    return {name for name in names if name in quantized}


def ignore_list(model: torch.nn.Module, ignore: Sequence[str] = ("lm_head",)) -> list[str]:
    """The ``ignore`` list llm-compressor writes into config.json for ``model`` quantized with
    ``targets=["Linear"]`` and ``ignore``: every module of a quantized type (Linear; routers count
    as Linear) that is not quantized, by checkpoint name, in module order (compressed-tensors'
    ``QuantizationConfig.from_pretrained`` rule). Pass it to :meth:`ViewScheme.quantization_config`.

    llm-compressor also lists its own per-expert MLP containers (``mlp.experts.{e}``, whose class
    name holds "Gate"); they hold no weight of their own and are left out here.
    """
    targets = _targets(model, ignore)
    types = {t.type_name for t in targets if t.quantized}
    return [t.module for t in targets if not t.quantized and t.type_name in types]


def _targets(model: torch.nn.Module, ignore: Sequence[str]) -> list[_Target]:
    compressed_tensors()
    from compressed_tensors.utils.match import is_match

    # The trainer's model: imported here, so that a server reading views loads no trainer-side code.
    from .checkpoint_layout import checkpoint_layout, find_pretrained

    if isinstance(ignore, str):
        ignore = [ignore]
    root = find_pretrained(model) or model
    named = [(name, param) for name, param in root.named_parameters()]
    layout = checkpoint_layout(root, named)
    sources = {name for name, _ in named}
    linear = torch.nn.Linear(1, 1, device="meta")  # stands for a linearized expert
    found: list[_Target] = []
    for module_name, module in root.named_modules():
        own = [(p, t) for p, t in module.named_parameters(recurse=False)]
        fused = [f"{module_name}.{p}" if module_name else p for p, t in own if t.ndim == 3]
        if fused:
            for source in fused:
                for piece in layout.of(source):
                    if len(piece.shape) == 2 and piece.name.endswith(".weight"):
                        name = piece.name.removesuffix(".weight")
                        found.append(_Target(name, "Linear", is_match(name, linear, "Linear", ignore)))
            continue
        weight = f"{module_name}.weight" if module_name else "weight"
        if not any(p == "weight" for p, _ in own):
            continue
        type_name = type(module).__name__
        if _ROUTER.search(type_name):
            type_name = "Linear"
        # A tied weight (lm_head sharing the embedding) is no parameter of its own: its module's name.
        pieces = (
            [(p.name, p.shape) for p in layout.of(weight)] if weight in sources else [(weight, module.weight.shape)]
        )
        for checkpoint_name, shape in pieces:
            name = checkpoint_name.removesuffix(".weight")
            quantized = len(shape) == 2 and is_match(name, module, "Linear", ignore)
            found.append(_Target(name, type_name, quantized))
    return found
