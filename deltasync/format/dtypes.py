"""The element types a chain can hold, and the 16-bit lanes every one of them moves in.

A chain holds one dtype per parameter. The bf16 chain holds bf16 only; a quantized view
(:mod:`deltasync.views`) holds its codes (``float8_e4m3fn`` or ``int8``) and its scales
(bf16). Everything that carries values through a chain (codecs, the chain reader, the
fingerprint, the in-place writer) moves them as *lanes*: the element's bit pattern,
zero-extended to an unsigned 16-bit number and held in an ``int16`` tensor. A bf16 lane is
the bf16 bit pattern itself (so the bf16 chain's bytes and fingerprints are those of format
version 1); a one-byte lane holds its byte in the low 8 bits and zeros above. Values never go
through float arithmetic on the way, so every bit pattern arrives exactly.

docs/protocol.md lists the dtypes with their safetensors codes.
"""

from __future__ import annotations

import torch

from ..errors import FormatError

__all__ = [
    "ELEMENT_DTYPES",
    "dtype_code",
    "dtype_from_code",
    "lane_bits",
    "lanes",
    "from_lanes",
    "write_lanes",
    "check_lanes",
    "read_lanes",
]

ELEMENT_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int8: "I8",
}
"""dtype -> its safetensors code, for every dtype a chain may hold."""

_BY_CODE = {code: dtype for dtype, code in ELEMENT_DTYPES.items()}


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of an element dtype; a FormatError for any other dtype."""
    try:
        return ELEMENT_DTYPES[dtype]
    except KeyError:
        raise FormatError(f"dtype {dtype} cannot be held by a chain (it holds {', '.join(ELEMENT_DTYPES.values())})") from None


def dtype_from_code(code: str, *, where: str) -> torch.dtype:
    """The element dtype of a safetensors code; a FormatError naming ``where`` for any other."""
    dtype = _BY_CODE.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise FormatError(f"{where}: dtype {code!r} is not one a chain holds ({', '.join(_BY_CODE)})")
    return dtype


def lane_bits(dtype: torch.dtype) -> int:
    """How many low bits of a lane an element of ``dtype`` uses (16 or 8)."""
    return 16 if dtype_code(dtype) == "BF16" else 8


def lanes(values: torch.Tensor) -> torch.Tensor:
    """The int16 lanes of a tensor of an element dtype: for bf16 a view (no copy), for a
    one-byte dtype a new tensor of its bytes zero-extended. Always 1-D and contiguous for
    one-byte dtypes; a bf16 tensor keeps its shape."""
    if values.dtype == torch.bfloat16:
        return values.view(torch.int16)
    if values.dtype in (torch.float8_e4m3fn, torch.int8):
        return values.reshape(-1).view(torch.uint8).to(torch.int16)
    raise FormatError(f"dtype {values.dtype} cannot be held by a chain (it holds {', '.join(ELEMENT_DTYPES.values())})")


def check_lanes(lane: torch.Tensor, dtype: torch.dtype, *, what: str) -> None:
    """A FormatError naming ``what`` if a one-byte dtype's lanes use more than their 8 bits."""
    if lane_bits(dtype) == 8 and lane.numel() and not bool(((lane & ~0xFF) == 0).all()):
        bad = int(lane[(lane & ~0xFF) != 0][0]) & 0xFFFF
        raise FormatError(f"{what}: value bits 0x{bad:04x} do not fit the 8 bits of {dtype_code(dtype)}")


def from_lanes(lane: torch.Tensor, dtype: torch.dtype, *, what: str = "values") -> torch.Tensor:
    """Elements of ``dtype`` from their int16 lanes (checked to fit, see :func:`check_lanes`)."""
    if dtype == torch.bfloat16:
        return lane.view(torch.bfloat16)
    check_lanes(lane, dtype, what=what)
    return lane.to(torch.uint8).view(dtype)


def write_lanes(flat: torch.Tensor, index: torch.Tensor, lane: torch.Tensor) -> None:
    """``flat[index] = <the elements of lanes lane>`` on a flat tensor of an element dtype, as
    bit patterns (an assignment through float scalars would rewrite NaN payloads)."""
    if flat.dtype == torch.bfloat16:
        flat.view(torch.int16)[index] = lane
    else:
        flat.view(torch.uint8)[index] = lane.to(torch.uint8)


def read_lanes(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The lanes of ``flat[index]`` (a flat tensor of an element dtype)."""
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16)[index]
    return flat.view(torch.uint8)[index].to(torch.int16)

