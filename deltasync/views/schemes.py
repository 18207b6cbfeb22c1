"""Quantized views of bf16 weights: compressed-tensors' preset schemes, computed as llm-compressor does.

A *view* is the policy's weights in one quantized format, named by compressed-tensors' preset
scheme (``FP8_DYNAMIC``, ``FP8_BLOCK``, ``W8A8``). For each quantized 2-D weight ``[out, in]`` a view
holds the tensors that llm-compressor's checkpoint stores for that layer: ``weight`` (the codes)
and ``weight_scale``. The arithmetic is compressed-tensors' own, called exactly as llm-compressor
(``oneshot`` with ``QuantizationModifier(scheme=PRESET)``) calls it:

- the observer is llm-compressor's memoryless min/max (weights always use it): the minimum and
  maximum of each output row (``channel``) or of each 128x128 block (``block``, zero-padded at the
  right and bottom edges as llm-compressor pads); that reduction is the only arithmetic here;
- ``calculate_qparams`` turns them into the scale (bf16 for a bf16 weight; a zero scale becomes the
  scale dtype's eps) and a zero point (zero: every preset here is symmetric);
- the codes come from the compressor registered for the scheme's format
  (``float-quantized`` / ``int-quantized``), which calls ``quantize`` and drops the symmetric zero
  point, so exactly ``{"weight", "weight_scale"}`` remain.

Shards (FSDP2 row shards, ``quantize_rows``). Channel scales depend on one row only, so a rank
quantizes its rows alone. A block scale depends on up to 128 rows, which may lie on several ranks:
every rank computes its contribution to the per-block abs-max (:meth:`ViewScheme.block_absmax_rows`,
zeros for the blocks it has no row of), the ranks all-reduce it with MAX, and each rank then
quantizes its rows with the reduced abs-max. The scale row of a block belongs to the rank that
holds the block's **first** row; so the concatenation of every rank's ``weight`` rows and
``weight_scale`` rows, in rank order, is the full tensor's result, for any split. (A symmetric
scale depends only on ``max(|min|, |max|)`` once ``calculate_qparams`` has put 0 in the range, so the
abs-max is all a rank needs.)

Validation of received view data: :func:`check_codes` and :func:`check_scale`.

compressed-tensors is imported inside functions only, so ``import deltasync`` works without it
(``pip install 'deltasync[views]'``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..errors import ConfigError, FormatError

__all__ = ["SCHEMES", "ViewScheme", "check_codes", "check_scale", "from_quantization_config", "get_scheme"]

#: The compressed-tensors preset schemes deltasync publishes views of.
SCHEMES: tuple[str, ...] = ("FP8_DYNAMIC", "FP8_BLOCK", "W8A8")

_SHAPES: dict[str, tuple[torch.dtype, Literal["channel", "block"], tuple[int, int] | None]] = {
    "FP8_DYNAMIC": (torch.float8_e4m3fn, "channel", None),
    "FP8_BLOCK": (torch.float8_e4m3fn, "block", (128, 128)),
    "W8A8": (torch.int8, "channel", None),
}


def _ct() -> Any:
    try:
        import compressed_tensors
    except ImportError as exc:  # pragma: no cover - compressed-tensors comes with vLLM and the extra
        raise ConfigError(
            "quantized views need compressed-tensors: pip install 'deltasync[views]' (vLLM installs it too)"
        ) from exc
    return compressed_tensors


@functools.cache
def _preset(name: str) -> Any:
    """compressed-tensors' ``QuantizationScheme`` of preset ``name`` targeting Linear, with the
    compression format llm-compressor infers for a Linear layer (``scheme.format``)."""
    _ct()
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme(name, ["Linear"])
    scheme.format = infer_module_format(torch.nn.Linear, scheme).value
    return scheme


@dataclass(frozen=True)
class ViewScheme:
    """One quantized view format: a compressed-tensors preset, applied to 2-D Linear weights."""

    name: str
    """The compressed-tensors preset name, e.g. ``"FP8_DYNAMIC"``."""
    code_dtype: torch.dtype
    """dtype of the codes (``weight``): ``torch.float8_e4m3fn`` or ``torch.int8``."""
    strategy: Literal["channel", "block"]
    """One scale per output row, or one per ``block`` of the weight."""
    block: tuple[int, int] | None = None
    """(rows, columns) of a block, for the block strategy."""

    # ------------------------------------------------------------------ compressed-tensors objects

    @property
    def preset(self) -> Any:
        """compressed-tensors' ``QuantizationScheme`` (targets ``["Linear"]``, format set)."""
        return _preset(self.name)

    @property
    def format(self) -> str:
        """The compressed-tensors compression format: ``"float-quantized"`` or ``"int-quantized"``."""
        return str(self.preset.format)

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """Shape of ``weight_scale`` for a weight of ``shape`` ``[out, in]``."""
        out, cols = self._check_shape("weight", shape)
        if self.block is None:
            return (out, 1)
        return (math.ceil(out / self.block[0]), math.ceil(cols / self.block[1]))

    # ------------------------------------------------------------------ full tensors

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"weight": codes, "weight_scale": scale}`` of the 2-D weight ``[out, in]``, bit for bit
        what llm-compressor's checkpoint stores for a Linear layer holding ``weight``."""
        self._check_shape("weight", weight.shape)
        low, high = self._observe(weight)
        return self._compress(weight, low, high)

    def checkpoint_tensors(
        self, tensors: Iterable[tuple[str, torch.Tensor]], quantized: Container[str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The view's checkpoint, streamed: each (name, tensor) of ``tensors`` (a bf16 checkpoint) as
        it is, except names in ``quantized`` (see :func:`deltasync.trainer.view_targets.quantized_names`), which
        become ``name`` (the codes) followed by its :func:`scale_name` (the scale)."""
        for name, tensor in tensors:
            if name in quantized:
                view = self.quantize(tensor)
                yield name, view["weight"]
                yield scale_name(name), view["weight_scale"]
            else:
                yield name, tensor

    # ------------------------------------------------------------------ row shards

    def block_absmax_rows(self, rows: torch.Tensor, row0: int, full_shape: Sequence[int]) -> torch.Tensor:
        """This shard's contribution to the per-block abs-max of the full weight (block strategy):
        a float32 ``scale_shape(full_shape)`` tensor holding the abs-max of the shard's elements of each
        block (exactly: a float32 holds every bf16 value) and zero for blocks it has no row of. All-reduce it with MAX over the ranks, then pass it to
        :meth:`quantize_rows` as ``block_amax``."""
        if self.block is None:
            raise ConfigError(f"view {self.name}: block_absmax_rows is for block schemes; {self.name} scales rows")
        self._check_rows(rows, row0, full_shape)
        bh = self.block[0]
        # float32 holds every bf16/fp16 value exactly, and every backend all-reduces it
        amax = torch.zeros(self.scale_shape(full_shape), dtype=torch.float32, device=rows.device)
        if rows.shape[0] == 0:
            return amax
        first, last = row0 // bh, (row0 + rows.shape[0] - 1) // bh
        padded = self._span(rows, row0)  # whole blocks first..last, zeros outside this shard
        amax[first : last + 1] = self._block_minmax(padded, absmax=True)
        return amax

    def quantize_rows(
        self,
        rows: torch.Tensor,
        row0: int,
        full_shape: Sequence[int],
        block_amax: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The view of rows ``row0 .. row0 + len(rows)`` of a weight of ``full_shape``: ``weight`` is
        those rows' codes; ``weight_scale`` holds the scale rows this shard owns (channel: its rows;
        block: the blocks whose first row is in the shard). ``block_amax`` (block strategy only, and
        required there) is the MAX-reduced :meth:`block_absmax_rows` of every rank."""
        _, cols = self._check_rows(rows, row0, full_shape)
        if self.block is None:
            if block_amax is not None:
                raise ConfigError(f"view {self.name}: block_amax is for block schemes; {self.name} scales rows")
            return self.quantize(rows) if rows.shape[0] else self._empty(cols, rows.dtype)
        if block_amax is None:
            raise ConfigError(
                f"view {self.name}: quantize_rows needs block_amax, the MAX over ranks of block_absmax_rows"
            )
        if tuple(block_amax.shape) != self.scale_shape(full_shape):
            raise ConfigError(
                f"view {self.name}: block_amax has shape {tuple(block_amax.shape)}, "
                f"expected {self.scale_shape(full_shape)} for a weight of shape {tuple(full_shape)}"
            )
        if rows.shape[0] == 0:
            return self._empty(cols, rows.dtype)
        bh = self.block[0]
        first, last = row0 // bh, (row0 + rows.shape[0] - 1) // bh
        amax = block_amax[first : last + 1].to(rows.dtype)
        span = self._span(rows, row0)
        done = self._compress(span, -amax, amax)
        skip = row0 - first * bh
        owned = slice(first if row0 % bh == 0 else first + 1, last + 1)
        return {
            "weight": done["weight"][skip : skip + rows.shape[0]].contiguous(),
            "weight_scale": done["weight_scale"][owned.start - first : owned.stop - first].contiguous(),
        }

    def scale_rows(self, row0: int, nrows: int) -> tuple[int, int]:
        """The ``weight_scale`` rows ``(begin, end)`` that the shard of rows ``row0 .. row0 + nrows`` owns."""
        if self.block is None:
            return row0, row0 + nrows
        bh = self.block[0]
        return -(-row0 // bh), -(-(row0 + nrows) // bh)

    # ------------------------------------------------------------------ config.json

    def quantization_config(self, ignore: Sequence[str]) -> dict[str, Any]:
        """The ``quantization_config`` llm-compressor writes into config.json for this preset
        (targets ``["Linear"]``) and ``ignore`` (module names and ``re:`` patterns, written as
        given; :func:`deltasync.trainer.view_targets.ignore_list` gives the expanded list llm-compressor writes).
        Built and serialized by compressed-tensors' ``QuantizationConfig`` and ``ModelCompressor``."""
        _ct()
        import json
        import tempfile

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

    # ------------------------------------------------------------------ internals

    def _check_shape(self, what: str, shape: Sequence[int]) -> tuple[int, int]:
        if len(shape) != 2:
            raise ConfigError(f"view {self.name}: {what} has shape {tuple(shape)}; a quantized weight is 2-D [out, in]")
        return int(shape[0]), int(shape[1])

    def _check_rows(self, rows: torch.Tensor, row0: int, full_shape: Sequence[int]) -> tuple[int, int]:
        out, cols = self._check_shape("full_shape", full_shape)
        if rows.ndim != 2 or rows.shape[1] != cols or not 0 <= row0 <= row0 + rows.shape[0] <= out:
            raise ConfigError(
                f"view {self.name}: rows of shape {tuple(rows.shape)} at row {row0} are not rows of a weight of shape "
                f"{tuple(full_shape)}"
            )
        return out, cols

    def _empty(self, cols: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        width = 1 if self.block is None else math.ceil(cols / self.block[1])
        return {
            "weight": torch.empty(0, cols, dtype=self.code_dtype),
            "weight_scale": torch.empty(0, width, dtype=dtype),
        }

    def _span(self, rows: torch.Tensor, row0: int) -> torch.Tensor:
        """``rows`` placed in the whole blocks of rows they touch, zeros elsewhere (the tail block
        may stay short: compressed-tensors pads it)."""
        assert self.block is not None
        bh = self.block[0]
        before = row0 % bh
        if before == 0:
            return rows
        return torch.cat([rows.new_zeros(before, rows.shape[1]), rows])

    def _block_minmax(self, weight: torch.Tensor, absmax: bool = False) -> Any:
        """llm-compressor's weight observer for blocks: zero-pad to whole blocks, min/max per block."""
        from compressed_tensors.quantization.utils import maybe_pad_tensor_for_block_quant

        assert self.block is not None
        padded = maybe_pad_tensor_for_block_quant(weight, tuple(self.block))
        bh, bw = self.block
        blocks = padded.reshape(padded.shape[0] // bh, bh, padded.shape[1] // bw, bw).transpose(1, 2).flatten(-2, -1)
        if absmax:
            return blocks.abs().amax(dim=-1)
        return blocks.amin(dim=-1), blocks.amax(dim=-1)

    def _observe(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.block is None:  # one observation per output row: (rows, 1), as llm-compressor's observer
            return weight.amin(dim=-1, keepdim=True), weight.amax(dim=-1, keepdim=True)
        low, high = self._block_minmax(weight)
        return low, high

    def _compress(self, weight: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> dict[str, torch.Tensor]:
        _ct()
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization.utils import calculate_qparams

        preset = self.preset
        scale, zero_point = calculate_qparams(low, high, preset.weights)
        compressor = BaseCompressor.get_value_from_registry(preset.format)
        state = {"weight": weight, "weight_scale": scale.to(weight.dtype), "weight_zero_point": zero_point}
        done = compressor.compress(state, preset)
        return {"weight": done["weight"], "weight_scale": done["weight_scale"]}


def scale_name(name: str) -> str:
    """The checkpoint name of the scale of quantized weight ``name`` (``x.weight`` -> ``x.weight_scale``)."""
    if not name.endswith("weight"):
        raise ConfigError(f"{name!r} is no weight name; quantized weights are named '<module>.weight'")
    return name + "_scale"


def get_scheme(name: str) -> ViewScheme:
    """The view scheme named ``name`` (a compressed-tensors preset name, any case).

    Raises :class:`ConfigError` naming ``name`` and the supported schemes; a preset that
    compressed-tensors knows but deltasync does not publish (e.g. ``NVFP4``) is said to be one.
    """
    key = str(name).upper()
    if key in _SHAPES:
        dtype, strategy, block = _SHAPES[key]
        return ViewScheme(key, dtype, strategy, block)
    supported = ", ".join(SCHEMES)
    try:
        from compressed_tensors.quantization.quant_scheme import is_preset_scheme

        known = is_preset_scheme(key)
    except ImportError:  # pragma: no cover - without compressed-tensors nothing is supported anyway
        known = False
    if known:
        raise ConfigError(
            f"view {name!r} is a compressed-tensors preset that deltasync does not support; supported views: {supported}"
        )
    raise ConfigError(f"unknown view {name!r}; supported views (compressed-tensors preset names): {supported}")


def from_quantization_config(cfg: Mapping[str, Any]) -> ViewScheme:
    """The supported scheme a checkpoint's config.json ``quantization_config`` is.

    A config matches a scheme when it is compressed-tensors', holds one config group, and that
    group's weight and input-activation arguments equal the preset's (observers aside: they do
    not change what is stored). Raises :class:`ConfigError` naming what was found otherwise.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"quantization_config is {type(cfg).__name__}, expected a dict")
    method = cfg.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(
            f"quantization_config has quant_method {method!r}; views follow compressed-tensors checkpoints "
            f"({', '.join(SCHEMES)})"
        )
    groups = cfg.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise ConfigError(
            f"quantization_config has {len(groups) if isinstance(groups, Mapping) else 'no'} config groups; "
            f"a view checkpoint has one ({', '.join(SCHEMES)})"
        )
    _ct()
    from compressed_tensors.quantization import QuantizationScheme

    ((group_name, group),) = groups.items()
    try:
        found = QuantizationScheme.model_validate(dict(group))
    except Exception as exc:  # pydantic's ValidationError: say which group
        raise ConfigError(
            f"quantization_config group {group_name!r} is not a compressed-tensors scheme: {exc}"
        ) from exc
    for name in SCHEMES:
        preset = _preset(name)
        if _same_args(found.weights, preset.weights) and _same_args(found.input_activations, preset.input_activations):
            return get_scheme(name)
    weights = found.weights
    described = (
        "no weight quantization"
        if weights is None
        else f"weights {weights.num_bits}-bit {weights.type} {weights.strategy}"
        + (f" {weights.block_structure}" if weights.block_structure else "")
        + ("" if weights.symmetric else " asymmetric")
    )
    raise ConfigError(
        f"quantization_config group {group_name!r} ({described}) matches no supported view; "
        f"supported views: {', '.join(SCHEMES)}"
    )


def _same_args(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    skip = {"observer", "observer_kwargs"}
    return bool(a.model_dump(exclude=skip) == b.model_dump(exclude=skip))


def check_codes(name: str, codes: torch.Tensor) -> None:
    """Raise :class:`FormatError` naming ``name`` unless ``codes`` are valid codes of a view: fp8
    e4m3fn without NaN (bit patterns 0x7F / 0xFF; e4m3fn has no infinity), or int8 (every value
    is a code: symmetric int8 uses -128 too, where the row's minimum is its abs-max)."""
    if codes.dtype == torch.float8_e4m3fn:
        bits = codes.view(torch.uint8)
        bad = (bits & 0x7F) == 0x7F
        if bool(bad.any()):
            where = int(bad.flatten().nonzero()[0])
            raise FormatError(f"{name}: fp8 code at flat index {where} is NaN (0x{int(bits.flatten()[where]):02X})")
    elif codes.dtype != torch.int8:
        raise FormatError(f"{name}: codes are {codes.dtype}; a view's codes are float8_e4m3fn or int8")


def check_scale(name: str, scale: torch.Tensor) -> None:
    """Raise :class:`FormatError` naming ``name`` unless every scale is finite and positive."""
    if not scale.is_floating_point():
        raise FormatError(f"{name}: scale is {scale.dtype}; a view's scales are floating point")
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if bool(bad.any()):
        where = int(bad.flatten().nonzero()[0])
        value = float(scale.flatten()[where])
        raise FormatError(
            f"{name}: scale at flat index {where} is {value}; a scale must be finite and positive (not NaN, inf or zero)"
        )
