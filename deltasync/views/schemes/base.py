"""What every view scheme is: quantize a 2-D weight ``[out, in]`` into codes and scales, by rows
or by blocks, whole or as row shards; say where a serving engine keeps them.

A scheme is one module (a :class:`ViewScheme` subclass or instance) and one
:func:`~deltasync.views.schemes.register_scheme` line (:mod:`deltasync.views.schemes`). A subclass
gives the arithmetic (:meth:`ViewScheme.compress`: codes and scales from each row's or block's
observed range), its checkpoint's ``quantization_config`` (:meth:`ViewScheme.quantization_config`,
:meth:`ViewScheme.matches`) and its :class:`LiveLayout`; everything else is shared here:

- the observer is llm-compressor's memoryless min/max (weights always use it): the minimum and
  maximum of each output row (``channel``) or of each block (``block``, zero-padded at the
  right and bottom edges as llm-compressor pads); that reduction is the only arithmetic here;
- row shards (FSDP2, :meth:`ViewScheme.quantize_rows`). Channel scales depend on one row only,
  so a rank quantizes its rows alone. A block scale depends on up to ``block[0]`` rows, which may
  lie on several ranks: every rank computes its contribution to the per-block abs-max
  (:meth:`ViewScheme.block_absmax_rows`, zeros for the blocks it has no row of), the ranks
  all-reduce it with MAX, and each rank then quantizes its rows with the reduced abs-max. The
  scale row of a block belongs to the rank that holds the block's **first** row; so the
  concatenation of every rank's ``weight`` rows and ``weight_scale`` rows, in rank order, is the
  full tensor's result, for any split. (A symmetric scale depends only on ``max(|min|, |max|)``
  once 0 is put in the range, so the abs-max is all a rank needs.)

Validation of received view data: :func:`check_codes` (by the codes' element type,
:mod:`deltasync.format.dtypes`) and :func:`check_scale`.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ...errors import ConfigError, FormatError
from ...format.dtypes import find_element_type, is_one_byte, one_byte_dtypes

__all__ = ["LiveLayout", "ViewScheme", "check_codes", "check_scale", "scale_name"]


@dataclass(frozen=True)
class LiveLayout:
    """Where a serving engine keeps a view's tensors once it has loaded them: the policy the
    server's in-place writer follows, as data. It names no engine; an engine's adapter
    (``vllm_ext``) interprets it for its own layers."""

    codes: Literal["as_loaded", "transposed"] = "as_loaded"
    """``"as_loaded"``: the codes stay in the ``[out, in]`` tensor the loader filled, written in
    place where the engine leaves it dense (a layer that repacks it for a kernel is found unfit
    and falls back to the layerwise reload). ``"transposed"``: the engine keeps the ``[in, out]``
    transpose over the same storage; the writer maps checkpoint elements onto it through an
    ``[out, in]`` load-time stand-in over that storage."""
    scales: Literal["as_loaded", "widened"] = "widened"
    """``"widened"``: the engine may hold a bf16 scale widened, exactly, into float32 (the writer
    writes the bf16 bits as the upper half of the float32's); ``"as_loaded"``: only as bf16."""


@dataclass(frozen=True)
class ViewScheme(ABC):
    """One quantized view format, applied to 2-D Linear weights ``[out, in]``: codes of a
    one-byte element type and bf16 scales, one per output row or one per block."""

    name: str
    """The view's name: its folder ``views/<name>/`` and what users pass, e.g. ``"FP8_DYNAMIC"``
    (capitals, digits and ``_``)."""
    code_dtype: torch.dtype
    """dtype of the codes (``weight``): a one-byte element type (:mod:`deltasync.format.dtypes`)."""
    strategy: Literal["channel", "block"]
    """One scale per output row, or one per ``block`` of the weight."""
    block: tuple[int, int] | None = None
    """(rows, columns) of a block, for the block strategy."""
    live: LiveLayout = field(default_factory=LiveLayout)
    """Where a serving engine keeps the codes and scales (the in-place writer's policy)."""

    def __post_init__(self) -> None:
        if not is_one_byte(self.code_dtype):
            held = ", ".join(str(d) for d in one_byte_dtypes())
            raise ConfigError(f"view {self.name}: codes of {self.code_dtype}; a view's codes are one byte ({held})")
        if (self.strategy == "block") != (self.block is not None):
            raise ConfigError(f"view {self.name}: a block size goes with the block strategy, and only with it")

    # ------------------------------------------------------------------ what a scheme gives

    @abstractmethod
    def compress(self, weight: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"weight": codes, "weight_scale": scale}`` of ``weight`` (rows ``[n, in]``, bf16)
        from the observed minimum ``low`` and maximum ``high`` of each row (``[n, 1]``) or of each
        block (``[ceil(n / rows), ceil(in / columns)]``). Codes are ``code_dtype`` of
        ``weight``'s shape; the scale is ``weight``'s dtype."""

    @abstractmethod
    def quantization_config(self, ignore: Sequence[str]) -> dict[str, Any]:
        """The ``quantization_config`` of a checkpoint of this view (config.json), which leaves
        the modules ``ignore`` names (and ``re:`` patterns) in bf16."""

    @abstractmethod
    def matches(self, config: Mapping[str, Any]) -> bool:
        """Whether a checkpoint's ``quantization_config`` is this view's (False for anything
        else, never an error: :func:`~deltasync.views.from_quantization_config` asks each scheme)."""

    def scale_shape(self, shape: Sequence[int]) -> tuple[int, int]:
        """Shape of ``weight_scale`` for a weight of ``shape`` ``[out, in]``."""
        out, cols = self._check_shape("weight", shape)
        if self.block is None:
            return (out, 1)
        return (math.ceil(out / self.block[0]), math.ceil(cols / self.block[1]))

    # ------------------------------------------------------------------ full tensors

    def quantize(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"weight": codes, "weight_scale": scale}`` of the 2-D weight ``[out, in]`` (for a
        compressed-tensors preset, bit for bit what llm-compressor's checkpoint stores for a
        Linear layer holding ``weight``)."""
        self._check_shape("weight", weight.shape)
        low, high = self._observe(weight)
        return self.compress(weight, low, high)

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
        done = self.compress(span, -amax, amax)
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

    def pad(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` zero-padded at the right and bottom to whole blocks (as llm-compressor pads)."""
        assert self.block is not None
        rows = -weight.shape[0] % self.block[0]
        cols = -weight.shape[1] % self.block[1]
        return torch.nn.functional.pad(weight, (0, cols, 0, rows)) if rows or cols else weight

    def _block_minmax(self, weight: torch.Tensor, absmax: bool = False) -> Any:
        """llm-compressor's weight observer for blocks: zero-pad to whole blocks, min/max per block."""
        assert self.block is not None
        padded = self.pad(weight)
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


def scale_name(name: str) -> str:
    """The checkpoint name of the scale of quantized weight ``name`` (``x.weight`` -> ``x.weight_scale``)."""
    if not name.endswith("weight"):
        raise ConfigError(f"{name!r} is no weight name; quantized weights are named '<module>.weight'")
    return name + "_scale"


def check_codes(name: str, codes: torch.Tensor) -> None:
    """Raise :class:`FormatError` naming ``name`` unless ``codes`` are valid codes of a view: of a
    one-byte element type, none of them NaN (its :attr:`~deltasync.format.dtypes.ElementType.nan_bits`:
    fp8 e4m3fn bit patterns 0x7F / 0xFF, e4m3fn has no infinity; every int8 is a code: symmetric
    int8 uses -128 too, where the row's minimum is its abs-max)."""
    kind = find_element_type(codes.dtype)
    if kind is None or not kind.one_byte:
        held = " or ".join(str(d).removeprefix("torch.") for d in one_byte_dtypes())
        raise FormatError(f"{name}: codes are {codes.dtype}; a view's codes are {held}")
    where = kind.nan_at(codes)
    if where is not None:
        bits = int(codes.reshape(-1).view(torch.uint8)[where])
        raise FormatError(f"{name}: {kind.label} code at flat index {where} is NaN (0x{bits:02X})")


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
