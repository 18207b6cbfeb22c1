"""PEFT / LoRA models through the bucket: adapter versions, or merged-weight deltas.

Two ways to ship a LoRA policy, the same two as TRL's own async GRPO:

- **adapter mode** (the server runs ``--enable-lora``): the bucket holds versions of the
  adapter alone, its LoRA tensors under the names ``save_pretrained`` writes, with the PEFT
  adapter config and a fingerprint of the base model in every anchor's metadata
  (:data:`ADAPTER_CONFIG_KEY`, :data:`BASE_FINGERPRINT_KEY`). Same format, checks, anchors and
  retention as full-model versions. The server materialises version N into a private
  directory and loads it as ``<lora_name>-v<N>`` (``vllm_ext.LoraSyncMiddleware``);
  :class:`~deltasync.control.lora_client.AdapterRolloutClient` drives that.
- **merged mode** (a server without LoRA): the bucket holds ordinary full-model versions of
  the merged weights ``W + scale * B @ A``, rounded to bf16 exactly as PEFT's merge followed
  by ``.to(torch.bfloat16)`` gives. The merged value of a LoRA-targeted weight is computed
  when it is compared or written; the base weights are never copied, and the change
  detector's snapshot holds the merged bf16 state of the targeted weights only.

This module never imports vLLM; PEFT is imported only by the functions that need it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..errors import AdapterError, ConfigError
from ..format.fingerprint import fingerprint, fingerprint_slice_share, format_fingerprint
from ..protocol.lora import (
    ADAPTER_CONFIG_KEY,
    BASE_FINGERPRINT_KEY,
    LORA_NAME_RE,
    VLLM_LORA_RANKS,
    adapter_config,
    adapter_modules,
    adapter_rank,
    check_adapter_config,
    check_adapter_modules,
    check_server_lora,
)
from .detector import BF16ChangeDetector
from .publisher import DeltaPublisher
from .sharded import ShardLayout, check_not_zero3, shard_layout
from .sources import SourceWeight, WeightSource, checkpoint_name

if TYPE_CHECKING:
    import os

    from ..stores import Store

__all__ = [
    "ADAPTER_CONFIG_KEY",
    "BASE_FINGERPRINT_KEY",
    "LORA_NAME_RE",
    "AdapterError",
    "AdapterWeights",
    "MergedChangeDetector",
    "MergedLoraWeights",
    "VLLM_LORA_RANKS",
    "adapter_config",
    "adapter_publisher",
    "adapter_rank",
    "adapter_state_dict",
    "base_fingerprint",
    "adapter_modules",
    "check_adapter_config",
    "check_adapter_modules",
    "check_server_lora",
    "lora_targets",
    "merged_publisher",
    "merged_state_dict",
]

_PEFT_PREFIX = "base_model.model."


# --------------------------------------------------------------------------- the model's pieces


def _active_adapter(model: torch.nn.Module, adapter: str | None) -> str:
    if adapter is not None:
        return adapter
    active = getattr(model, "active_adapters", None)
    if not active:
        raise ConfigError(f"{type(model).__name__} is not a PEFT model with an active adapter")
    return active[0]


def _base_name(name: str) -> str:
    """A base parameter's checkpoint name from its PEFT name."""
    return checkpoint_name(name).removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def _adapter_parameters(model: torch.nn.Module, adapter: str) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter's LoRA tensors under the names ``save_pretrained`` writes."""
    marker = f".{adapter}."
    out = []
    for name, param in model.named_parameters():
        name = checkpoint_name(name)
        if "lora_" in name and marker in name:
            out.append((name.replace(marker, "."), param))
    if not out:
        raise ConfigError(f"the model has no LoRA tensors for adapter {adapter!r}")
    return out


def _lora_layers(model: torch.nn.Module, adapter: str) -> dict[str, Any]:
    """Base checkpoint name of each LoRA-targeted weight -> its PEFT ``LoraLayer``."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_A:
            layers[_base_name(name + ".base_layer.weight")] = module
    return layers


def lora_targets(model: torch.nn.Module, adapter: str | None = None) -> list[str]:
    """The last name component of every module that carries LoRA of ``adapter`` (embeddings
    included): what the adapter's ``target_modules`` really matched, a regex included."""
    from peft.tuners.lora import LoraLayer

    adapter = _active_adapter(model, adapter)
    return sorted({
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer) and (adapter in module.lora_A or adapter in getattr(module, "lora_embedding_A", {}))
    })


def _base_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """The base model's parameters under their checkpoint names (tied weights once)."""
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if "lora_" in name or id(param) in seen:
            continue
        if "modules_to_save" in name or "original_module" in name:
            raise AdapterError(f"{name}: modules_to_save cannot be shipped; drop modules_to_save from the LoRA config")
        seen.add(id(param))
        yield _base_name(name), param


def adapter_state_dict(model: torch.nn.Module, adapter: str | None = None) -> dict[str, torch.Tensor]:
    """The adapter's tensors in bf16, under ``save_pretrained``'s names: what an adapter version holds."""
    adapter = _active_adapter(model, adapter)
    return {name: p.detach().to("cpu", torch.bfloat16, copy=True) for name, p in _adapter_parameters(model, adapter)}


def base_fingerprint(model: torch.nn.Module) -> str:
    """Fingerprint of the base model's weights in bf16, as a server computes it from its checkpoint.

    With several processes it is collective (every rank calls it): each rank hashes what it
    owns of the base weights (FSDP2: its rows; DDP: rank 0 everything) and the shares add up.
    """
    named = list(_base_parameters(model))
    layout = shard_layout(named)
    if layout is None:
        return fingerprint(dict(named))
    share = 0
    for name, param in named:
        owned = layout.slices[name]
        if owned.end > owned.begin:
            values = owned.local(param).to(device="cpu", dtype=torch.bfloat16)
            share += fingerprint_slice_share(name, values, owned.begin)
    return format_fingerprint(sum(layout.all_gather(share)))


class _MergedWeight:
    """A LoRA-targeted weight's merged value, computed when asked for (never stored).

    Under FSDP2 (the base weight a ``Shard(0)`` DTensor) it stands for this rank's rows of the
    merged weight: the rows of ``W`` and of ``lora_B`` are split alike (both are split over the
    output features, by ``torch.chunk``'s rule), and ``lora_A`` (``r`` rows) is gathered whole by
    :meth:`MergedLoraWeights.prepare` before any value is read. Row blocks of ``B @ A`` are computed
    as PEFT computes the whole product, so each element is PEFT's merge bit for bit.
    """

    def __init__(self, layer: Any, adapter: str, name: str = "") -> None:
        self.layer = layer
        self.adapter = adapter
        self.base = layer.get_base_layer().weight
        self.sharded = _is_dtensor(self.base)
        self.gathered_a: torch.Tensor | None = None
        """FSDP2: the whole lora_A, gathered by :meth:`MergedLoraWeights.prepare`."""
        if self.sharded:
            _check_sharded_like(name, self.base, layer, adapter)

    @property
    def shape(self) -> torch.Size:
        return self.base.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def device(self) -> torch.device:
        return self.base.device

    def numel(self) -> int:
        return self.base.numel()

    def detach(self) -> torch.Tensor:
        # What PEFT's merge computes (weight.data += get_delta_weight), without touching the weight.
        with torch.no_grad():
            if not self.sharded:
                return self.base.detach() + self.layer.get_delta_weight(self.adapter)
            if self.gathered_a is None:
                raise RuntimeError("MergedLoraWeights.prepare() must gather lora_A before a sharded merged weight is read")
            weight_b = self.layer.lora_B[self.adapter].weight.to_local().detach()
            weight_a = self.gathered_a
            dtype = weight_b.dtype
            # The same steps as peft's LoraLayer.get_delta_weight, on this rank's rows of B.
            cast = weight_b.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
            if cast:
                weight_a, weight_b = weight_a.float(), weight_b.float()
            delta = (weight_b @ weight_a) * self.layer.scaling[self.adapter]
            if cast:
                delta = delta.to(dtype)
            return self.base.to_local().detach() + delta


def _is_dtensor(tensor: object) -> bool:
    # None is a DTensor before torch.distributed.tensor is imported (a single process never pays for it)
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def _check_sharded_like(name: str, base: Any, layer: Any, adapter: str) -> None:
    """Merged mode under FSDP2 needs W and lora_B split by the same rows, and no transposed layer."""
    from torch.distributed.tensor import Shard

    weight_b = layer.lora_B[adapter].weight
    problems = []
    if getattr(layer, "fan_in_fan_out", False):
        problems.append("fan_in_fan_out=True (W's rows are its input features, lora_B's its output features)")
    for what, tensor in (("the base weight", base), ("lora_B", weight_b), ("lora_A", layer.lora_A[adapter].weight)):
        placements = tuple(getattr(tensor, "placements", ()))
        if len(placements) != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
            problems.append(f"{what} is placed {list(map(str, placements)) or 'as a plain tensor'}")
    if not problems and weight_b.device_mesh != base.device_mesh:
        problems.append("lora_B lives on another device mesh than the base weight")
    if problems:
        raise ConfigError(
            f"{name}: merged mode with sharded parameters supports FSDP2 (fully_shard, Shard(0) on one 1-D mesh for the "
            f"base weight, lora_A and lora_B), but {'; '.join(problems)}; shard the PEFT model with fully_shard as a whole, "
            "or use adapter mode (peft_sync='adapter')"
        )


def merged_state_dict(model: torch.nn.Module, adapter: str | None = None) -> dict[str, torch.Tensor]:
    """The merged model in bf16 under checkpoint names: what merged mode publishes."""
    source = MergedLoraWeights(model, adapter)
    source.prepare()
    return {w.name: w.value.detach().to("cpu", torch.bfloat16, copy=True) for w in source.weights()}


class MergedLoraWeights(WeightSource):
    """The merged model of a PEFT LoRA model, as a weight source: LoRA-targeted weights as their
    merged value ``W + scale * B @ A`` (computed when read, never stored), stepped by their
    layer's ``lora_A`` and ``lora_B``; the other base weights as they are. Published in the base
    model's ``save_pretrained`` layout. Under FSDP2 reading needs :meth:`prepare` (a collective
    that gathers each ``lora_A``), so the values may not be read while the trainer goes on."""

    def __init__(self, model: torch.nn.Module, adapter: str | None = None) -> None:
        check_not_zero3(model)
        self.adapter = _active_adapter(model, adapter)
        check_adapter_config(adapter_config(model.peft_config[self.adapter]))  # type: ignore[index]
        layers = _lora_layers(model, self.adapter)
        self._weights = []
        for name, param in _base_parameters(model):
            layer = layers.get(name)
            if layer is None:
                self._weights.append(SourceWeight(name, param, (param,)))
            else:
                merged = _MergedWeight(layer, self.adapter, name)
                steppers = (layer.lora_A[self.adapter].weight, layer.lora_B[self.adapter].weight)
                self._weights.append(SourceWeight(name, merged, steppers))
        # Fused MoE experts are per expert in the checkpoint; the names are relative to the base model.
        self.checkpoint_model = model.get_base_model()
        self._sharded = [w.value for w in self._weights if isinstance(w.value, _MergedWeight) and w.value.sharded]

    def weights(self) -> list[SourceWeight]:
        return list(self._weights)

    def layout(self) -> ShardLayout | None:
        # A merged weight is owned and split exactly as its base weight is (DDP: rank 0 owns
        # everything; FSDP2: each rank its rows).
        return shard_layout([(w.name, w.value.base if isinstance(w.value, _MergedWeight) else w.value) for w in self._weights])

    def prepare(self) -> None:
        """FSDP2: gather every targeted layer's lora_A (a collective: every rank calls it, in
        the same order). Nothing to do in one process or with replicated parameters."""
        for weight in self._sharded:
            weight.gathered_a = weight.layer.lora_A[weight.adapter].weight.full_tensor().detach()

    @property
    def overlap_problem(self) -> str | None:
        if self._sharded:
            return "merged LoRA weights under FSDP2 are gathered by a collective of the training process group"
        return None


class AdapterWeights(WeightSource):
    """A PEFT model's adapter alone, as a weight source: its LoRA tensors under the names
    ``save_pretrained`` writes (what an adapter version holds), each stepped by itself."""

    def __init__(self, model: torch.nn.Module, adapter: str | None = None) -> None:
        check_not_zero3(model)
        self.adapter = _active_adapter(model, adapter)
        self._weights = [SourceWeight(name, p, (p,)) for name, p in _adapter_parameters(model, self.adapter)]

    def weights(self) -> list[SourceWeight]:
        return list(self._weights)


class MergedChangeDetector(BF16ChangeDetector):
    """:class:`BF16ChangeDetector` over the merged weights of a LoRA model (:class:`MergedLoraWeights`).

    A step that changes a layer's ``lora_A`` or ``lora_B`` marks its base weight; at publish
    time the merged value is computed and compared in bf16 against the snapshot of what was
    last published. Base weights that no LoRA targets are not trained, and never compared.
    """

    def __init__(
        self,
        model: torch.nn.Module | MergedLoraWeights,
        optimizer: object | None = None,
        *,
        adapter: str | None = None,
        snapshot_device: str | torch.device | None = "auto",
    ) -> None:
        source = model if isinstance(model, MergedLoraWeights) else MergedLoraWeights(model, adapter)
        super().__init__(source, optimizer, snapshot_device=snapshot_device)


# --------------------------------------------------------------------------- publishers


def adapter_publisher(
    bucket: str | os.PathLike[str] | Store,
    model: torch.nn.Module,
    optimizer: object | None = None,
    *,
    adapter: str | None = None,
    **options: object,
) -> DeltaPublisher:
    """A :class:`DeltaPublisher` of the adapter alone (adapter mode); checks the adapter first."""
    adapter = _active_adapter(model, adapter)
    config = adapter_config(model.peft_config[adapter])  # type: ignore[index]
    check_adapter_config(config)
    publisher = DeltaPublisher(bucket, AdapterWeights(model, adapter), optimizer, **options)  # type: ignore[arg-type]
    publisher.anchor_metadata = {
        ADAPTER_CONFIG_KEY: json.dumps(config, sort_keys=True),
        BASE_FINGERPRINT_KEY: base_fingerprint(model),
    }
    return publisher


def merged_publisher(
    bucket: str | os.PathLike[str] | Store,
    model: torch.nn.Module,
    optimizer: object | None = None,
    *,
    adapter: str | None = None,
    **options: object,
) -> DeltaPublisher:
    """A :class:`DeltaPublisher` of the merged weights (merged mode), for a server without LoRA."""
    return DeltaPublisher(bucket, MergedLoraWeights(model, adapter), optimizer, **options)  # type: ignore[arg-type]
