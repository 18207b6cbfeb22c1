"""A live parameter as 16-bit lanes, the way the in-place writer reads and writes it.

:class:`LiveFlat` reads and writes a live parameter in storage order as 16-bit lanes, as the
element table says (:mod:`deltasync.format.dtypes`: a bf16 or one-byte element as its lane); a
view's scale may be held widened, in a float32 parameter (a bf16 value widened exactly), and is
then written as the upper half of its bits. Where an engine keeps a quantized layer's parameters
(transposed, repacked) is the engine's business (vLLM: :mod:`vllm_ext._quantized`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from deltasync.format.dtypes import find_element_type

__all__ = ["WIDENED", "LiveFlat", "is_widening", "is_writable", "storage_flat"]

WIDENED = torch.float32
"""The dtype a loader may widen a bf16 checkpoint tensor into (a view's scales, exactly): the
in-place writer keeps such a parameter as bf16 lanes, the upper half of its bits."""


def storage_flat(param: torch.Tensor) -> torch.Tensor:
    """``param``'s elements in storage order, flat (a view): the tensor itself, or the
    transpose of a 2-D parameter that is the transpose of a dense tensor."""
    data = param.data
    if data.is_contiguous():
        return data.view(-1)
    if data.dim() == 2 and data.t().is_contiguous():
        return data.t().view(-1)
    raise ValueError(f"a {tuple(data.shape)} parameter with strides {data.stride()} is not dense in any order")


class LiveFlat:
    """One live parameter, flat in storage order, read and written as int16 lanes."""

    def __init__(self, param: torch.Tensor) -> None:
        flat = storage_flat(param)
        self.dtype = flat.dtype
        kind = find_element_type(flat.dtype)
        if kind is not None:  # an element of a chain: its lanes' bits (int16, or uint8 for one byte)
            self.raw = flat.view(kind.raw)
        elif flat.dtype == WIDENED:  # a bf16 checkpoint value held widened (a scale)
            self.raw = flat.view(torch.int32)
        else:
            raise ValueError(f"a {flat.dtype} parameter cannot be written in place")
        self.device = flat.device
        self._host = self.raw.numpy() if self.device.type == "cpu" else None
        """The CPU storage as NumPy, viewed once (each decode thread reads it for every name)."""

    @property
    def tensor(self) -> torch.Tensor:
        return self.raw

    def numel(self) -> int:
        return self.raw.numel()

    def read(self, dst: torch.Tensor) -> torch.Tensor:
        """The lanes at flat positions ``dst`` (on this parameter's device). On the CPU with
        NumPy: it runs in the decode threads, where each torch operation would start a team of
        torch's intra-op threads of its own, more threads than cores."""
        if self._host is not None:
            got = torch.from_numpy(np.take(self._host, dst.numpy()))
        else:
            got = self.raw.index_select(0, dst)
        if self.raw.dtype == torch.int32:  # the bf16 bits: the upper half, the lower one is zero
            got = got >> 16
        return got if got.dtype == torch.int16 else got.to(torch.int16)  # a lane's bits zero-extended

    def hashed(self, start: int, stop: int) -> torch.Tensor:
        """Flat positions ``start .. stop - 1`` as the fingerprint hashes them: bf16 patterns (a
        view, where the parameter holds them as they are), or one-byte codes."""
        run = self.raw[start:stop]
        if self.raw.dtype == torch.int32:  # the bf16 bits: the upper half
            run = (run >> 16).to(torch.int16)
        return run.view(torch.bfloat16) if run.dtype == torch.int16 else run

    def write(self, dst: torch.Tensor, lanes: torch.Tensor) -> None:
        """Write ``lanes`` (int16, on this parameter's device) at flat positions ``dst``."""
        self.raw.scatter_(0, dst, self.encode(lanes))

    def encode(self, lanes: torch.Tensor) -> torch.Tensor:
        """Lanes as this parameter's raw bits (what :meth:`write` scatters)."""
        if self.raw.dtype == torch.int32:
            return (lanes.to(torch.int32) & 0xFFFF) << 16
        return lanes.to(self.raw.dtype)  # the lane's low bits (no copy for int16)

    def widened_exactly(self) -> bool:
        """For a float32 parameter: whether every value is a bf16 value (its lower 16 bits zero)."""
        return self.raw.dtype != torch.int32 or not bool((self.raw & 0xFFFF).any())


def is_widening(src: Any, dst: Any) -> bool:
    """Whether a copy from ``src`` to ``dst`` widens bf16 into float32 (exact: the in-place
    writer keeps such a parameter as bf16 lanes)."""
    return src.dtype == torch.bfloat16 and dst.dtype == WIDENED


def is_writable(dtype: torch.dtype, *, widen: bool) -> bool:
    """Whether the in-place writer holds a parameter of ``dtype``: an element type of a chain
    (:mod:`deltasync.format.dtypes`), or with ``widen`` (a view whose scales may be widened) the
    float32 a bf16 value is widened into."""
    return find_element_type(dtype) is not None or (widen and dtype == WIDENED)

