"""Weight sources: the weights a change detector compares and a publisher publishes.

A source names each weight as the checkpoint a server loads names it, gives its value (a
tensor, a DTensor under FSDP2, or a value computed when read, such as a merged LoRA weight),
and says which trainable parameters an optimizer step must touch for the weight to change.
:class:`~deltasync.BF16ChangeDetector` and :class:`~deltasync.DeltaPublisher` take any source;
a plain ``nn.Module`` is read through :class:`ModelWeights`. The PEFT sources (merged weights,
the adapter alone) are in :mod:`deltasync.trainer.lora`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from .sharded import ShardLayout, check_not_zero3, shard_layout

__all__ = ["SourceWeight", "WeightSource", "ModelWeights", "weight_source", "checkpoint_name", "named_parameters"]

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


@dataclass(frozen=True)
class SourceWeight:
    """One weight of a :class:`WeightSource`."""

    name: str
    """Its checkpoint name: what versions call it."""
    value: Any
    """The weight: a tensor (a ``Shard(0)`` DTensor under FSDP2), or an object with ``shape``,
    ``dtype``, ``device``, ``numel()`` and ``detach()`` whose value is computed when read (its
    local rows when sharded). Its bf16 rounding is what is compared and published."""
    stepped_by: tuple[torch.Tensor, ...] = ()
    """The parameters whose optimizer step changes it: it is compared after a step that gave
    one of them (trainable, and in the optimizer) a gradient. Empty: it never changes, and is
    read live for anchors."""


class WeightSource(ABC):
    """What a change detector compares and a publisher publishes: named weights, how ranks own
    them, and which parameters' steps change them. Subclass it to publish something other
    than a module's own parameters; :meth:`weights` is the one method to write."""

    checkpoint_model: Any = None
    """The module whose ``save_pretrained`` layout versions are written in (MoE experts fused
    in memory are per expert in the checkpoint), or None for the weights as they are named."""

    @abstractmethod
    def weights(self) -> list[SourceWeight]:
        """Every weight published, each once, checkpoint-named (cheap: values are read later)."""

    def layout(self) -> ShardLayout | None:
        """How the processes own the weights' elements (collective when several processes
        run); None in a single process."""
        return shard_layout([(w.name, w.value) for w in self.weights()])

    def prepare(self) -> None:  # noqa: B027  (an optional hook)
        """Called before values are read (by every rank, at the same points): a source whose
        values need a collective runs it here. Nothing by default."""

    @property
    def overlap_problem(self) -> str | None:
        """Why values may not be read in another thread while the trainer goes on (a
        collective of the training process group, say), or None if they may."""
        return None


class ModelWeights(WeightSource):
    """A module's own parameters under their checkpoint names (tied weights once); each one
    changes when the optimizer steps it."""

    def __init__(self, model: torch.nn.Module) -> None:
        check_not_zero3(model)
        self.model = model
        self.checkpoint_model = model

    def weights(self) -> list[SourceWeight]:
        return [SourceWeight(name, param, (param,)) for name, param in named_parameters(self.model)]


def weight_source(model: torch.nn.Module | WeightSource) -> WeightSource:
    """``model`` itself if it is a :class:`WeightSource`, else its :class:`ModelWeights`."""
    return model if isinstance(model, WeightSource) else ModelWeights(model)
