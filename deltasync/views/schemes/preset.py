"""Schemes that are compressed-tensors' preset schemes, computed as llm-compressor does.

Such a view is named by compressed-tensors' preset (``FP8_DYNAMIC``, ``FP8_BLOCK``, ``W8A8``). For
each quantized 2-D weight ``[out, in]`` it holds the tensors that llm-compressor's checkpoint
stores for that layer: ``weight`` (the codes) and ``weight_scale``. The arithmetic is
compressed-tensors' own, called exactly as llm-compressor (``oneshot`` with
``QuantizationModifier(scheme=PRESET)``) calls it, after the shared observer
(:mod:`.base`):

- ``calculate_qparams`` turns the observed range into the scale (bf16 for a bf16 weight; a zero
  scale becomes the scale dtype's eps) and a zero point (zero: every preset here is symmetric);
- the codes come from the compressor registered for the scheme's format
  (``float-quantized`` / ``int-quantized``), which calls ``quantize`` and drops the symmetric zero
  point, so exactly ``{"weight", "weight_scale"}`` remain.

compressed-tensors is imported inside functions only, so ``import deltasync`` works without it
(``pip install 'deltasync[views]'``).
"""

from __future__ import annotations

import functools
import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ConfigError
from .base import ViewScheme

__all__ = ["PresetScheme", "compressed_tensors", "is_preset", "refuse_config"]


def compressed_tensors() -> Any:
    """The compressed-tensors module, or a ConfigError saying how to install it."""
    try:
        import compressed_tensors as ct
    except ImportError as exc:  # pragma: no cover - compressed-tensors comes with vLLM and the extra
        raise ConfigError(
            "quantized views need compressed-tensors: pip install 'deltasync[views]' (vLLM installs it too)"
        ) from exc
    return ct


@functools.cache
def _preset(name: str) -> Any:
    """compressed-tensors' ``QuantizationScheme`` of preset ``name`` targeting Linear, with the
    compression format llm-compressor infers for a Linear layer (``scheme.format``)."""
    compressed_tensors()
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(name, ["Linear"])
    scheme.format = infer_module_format(torch.nn.Linear, scheme).value
    return scheme


def is_preset(name: str) -> bool:
    """Whether compressed-tensors knows a preset ``name`` (False without compressed-tensors)."""
    try:
        from compressed_tensors.quantization.quant_scheme import is_preset_scheme
    except ImportError:  # pragma: no cover - without compressed-tensors nothing is supported anyway
        return False
    return bool(is_preset_scheme(name))


@dataclass(frozen=True)
class PresetScheme(ViewScheme):
    """A view that is the compressed-tensors preset of its :attr:`name`, applied to Linear weights."""

    @property
    def preset(self) -> Any:
        """compressed-tensors' ``QuantizationScheme`` (targets ``["Linear"]``, format set)."""
        return _preset(self.name)

    @property
    def format(self) -> str:
        """The compressed-tensors compression format: ``"float-quantized"`` or ``"int-quantized"``."""
        return str(self.preset.format)

    def compress(self, weight: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> dict[str, torch.Tensor]:
        compressed_tensors()
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization.utils import calculate_qparams

        preset = self.preset
        scale, zero_point = calculate_qparams(low, high, preset.weights)
        compressor = BaseCompressor.get_value_from_registry(preset.format)
        state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero_point}
        done = compressor.compress(state, preset)
        return {"weight": done["weight"], "weight_scale": done["weight_scale"]}

    def quantization_config(self, ignore: Sequence[str]) -> dict[str, Any]:
        """The ``quantization_config`` llm-compressor writes into config.json for this preset
        (targets ``["Linear"]``) and ``ignore`` (module names and ``re:`` patterns, written as
        given; :func:`deltasync.trainer.view_targets.ignore_list` gives the expanded list llm-compressor writes).
        Built and serialized by compressed-tensors' ``QuantizationConfig`` and ``ModelCompressor``."""
        compressed_tensors()
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

        config = QuantizationConfig(
            config_groups={"group_0": self.preset.model_copy(deep=True)},
            format=self.format,
            quantization_status=QuantizationStatus.COMPRESSED,
            ignore=list(ignore),
        )
        with tempfile.TemporaryDirectory() as tmp:
            ModelCompressor(quantization_config=config).update_config(tmp)
            with open(f"{tmp}/config.json") as file:
                return dict(json.load(file)["quantization_config"])

    def matches(self, config: Mapping[str, Any]) -> bool:
        """A config matches when it is compressed-tensors', holds one config group, and that
        group's weight and input-activation arguments equal the preset's (observers aside: they
        do not change what is stored)."""
        group = _one_group(config)
        if group is None:
            return False
        try:
            found = _parse_group(*group)
        except ConfigError:
            return False
        preset = self.preset
        return _same_args(found.weights, preset.weights) and _same_args(
            found.input_activations, preset.input_activations
        )


def _one_group(config: Mapping[str, Any]) -> tuple[str, Any] | None:
    """The one config group of a compressed-tensors config; None for anything else."""
    groups = config.get("config_groups")
    if config.get("quant_method") != "compressed-tensors" or not isinstance(groups, Mapping) or len(groups) != 1:
        return None
    ((name, group),) = groups.items()
    return str(name), group


def _parse_group(name: str, group: Any) -> Any:
    compressed_tensors()
    from compressed_tensors.quantization import QuantizationScheme

    try:
        return QuantizationScheme.model_validate(dict(group))
    except Exception as exc:  # pydantic's ValidationError: say which group
        raise ConfigError(f"quantization_config group {name!r} is not a compressed-tensors scheme: {exc}") from exc


def _same_args(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    skip = {"observer", "observer_kwargs"}
    return bool(a.model_dump(exclude=skip) == b.model_dump(exclude=skip))


def refuse_config(config: Mapping[str, Any], supported: str) -> ConfigError:
    """Why ``config`` (a ``quantization_config`` that no scheme matches) is no view: what it is
    instead, for a compressed-tensors config its weights' type. ``supported``: the views."""
    method = config.get("quant_method")
    if method != "compressed-tensors":
        return ConfigError(
            f"quantization_config has quant_method {method!r}; views follow compressed-tensors checkpoints "
            f"({supported})"
        )
    groups = config.get("config_groups")
    group = _one_group(config)
    if group is None:
        return ConfigError(
            f"quantization_config has {len(groups) if isinstance(groups, Mapping) else 'no'} config groups; "
            f"a view checkpoint has one ({supported})"
        )
    weights = _parse_group(*group).weights
    described = (
        "no weight quantization"
        if weights is None
        else f"weights {weights.num_bits}-bit {weights.type} {weights.strategy}"
        + (f" {weights.block_structure}" if weights.block_structure else "")
        + ("" if weights.symmetric else " asymmetric")
    )
    return ConfigError(
        f"quantization_config group {group[0]!r} ({described}) matches no supported view; supported views: {supported}"
    )
