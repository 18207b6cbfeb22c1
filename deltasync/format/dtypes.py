"""The element types a chain can hold, and the 16-bit lanes every one of them moves in.

A chain holds one dtype per parameter. The bf16 chain holds bf16 only; a quantized view
(:mod:`deltasync.views`) holds its codes (``float8_e4m3fn`` or ``int8``) and its scales
(bf16). Everything that carries values through a chain (codecs, the chain reader, the
fingerprint, the views, the in-place writer) moves them as *lanes*: the element's bit pattern,
zero-extended to an unsigned 16-bit number and held in an ``int16`` tensor. A bf16 lane is
the bf16 bit pattern itself (so the bf16 chain's bytes and fingerprints are those of format
version 1); a one-byte lane holds its byte in the low 8 bits and zeros above. Values never go
through float arithmetic on the way, so every bit pattern arrives exactly.

:data:`ELEMENT_TYPES` is the one table of them: each :class:`ElementType` says its safetensors
code, its lane width, the integer dtype its bits are read as, and which of its bit patterns are
NaN; it reads and writes its lanes. The fingerprint hashes an element as its lane, the chain
reader, the codecs, the views and the server's in-place writer ask this table (by dtype:
:func:`element_type`, :func:`is_one_byte`), and nothing else lists the dtypes. A new element
type is one entry of the table (and its code in the safetensors container's table, the file
format's; docs/protocol.md lists the dtypes with their codes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import FormatError

__all__ = [
    "ELEMENT_DTYPES",
    "ELEMENT_TYPES",
    "ElementType",
    "element_type",
    "find_element_type",
    "is_one_byte",
    "one_byte_dtypes",
    "holds_byte_lanes",
    "dtype_code",
    "dtype_from_code",
    "lane_bits",
    "lanes",
    "from_lanes",
    "write_lanes",
    "check_lanes",
    "read_lanes",
]


@dataclass(frozen=True)
class ElementType:
    """One element type a chain holds: its dtype, code and lanes."""

    dtype: torch.dtype
    """The torch dtype (``torch.bfloat16``, ``torch.float8_e4m3fn``, ...)."""
    code: str
    """Its safetensors code (``"BF16"``, ``"F8_E4M3"``, ``"I8"``): a file's header and a
    view's identity name it by this."""
    label: str
    """How messages name its values (``"bf16"``, ``"fp8"``, ``"int8"``)."""
    lane_bits: int
    """How many low bits of a lane an element uses: 16, or 8 for a one-byte element."""
    nan_bits: int | None = None
    """For a one-byte float type: the bits that are all set in a NaN, and only there (e4m3fn:
    ``0x7F``, it has no infinity); None where every bit pattern is a number (int8), or where a
    NaN is no such mask (bf16: no view's codes are bf16)."""

    @property
    def raw(self) -> torch.dtype:
        """The integer dtype its bits are read as: ``int16`` (a bf16 lane is its bits) or
        ``uint8`` (a one-byte element's byte, zero-extended to its lane)."""
        return torch.int16 if self.lane_bits == 16 else torch.uint8

    @property
    def one_byte(self) -> bool:
        """Whether an element is one byte (a quantized view's codes)."""
        return self.lane_bits == 8

    def lanes(self, values: torch.Tensor) -> torch.Tensor:
        """The int16 lanes of ``values`` (of this dtype): a view of a 16-bit element's tensor
        (same shape, no copy), a new flat tensor of one-byte elements zero-extended."""
        if not self.one_byte:
            return values.view(torch.int16)
        return values.reshape(-1).view(torch.uint8).to(torch.int16)

    def check_lanes(self, lane: torch.Tensor, *, what: str) -> None:
        """A FormatError naming ``what`` if lanes use more bits than this type has."""
        if self.one_byte and lane.numel() and not bool(((lane & ~0xFF) == 0).all()):
            bad = int(lane[(lane & ~0xFF) != 0][0]) & 0xFFFF
            raise FormatError(f"{what}: value bits 0x{bad:04x} do not fit the 8 bits of {self.code}")

    def from_lanes(self, lane: torch.Tensor, *, what: str = "values") -> torch.Tensor:
        """Elements of this type from their int16 lanes (checked to fit, see :meth:`check_lanes`)."""
        if not self.one_byte:
            return lane.view(self.dtype)
        self.check_lanes(lane, what=what)
        return lane.to(torch.uint8).view(self.dtype)

    def write(self, flat: torch.Tensor, index: torch.Tensor, lane: torch.Tensor) -> None:
        """``flat[index] = <the elements of lanes lane>`` on a flat tensor of this type, as bit
        patterns (an assignment through float scalars would rewrite NaN payloads)."""
        flat.view(self.raw)[index] = lane.to(self.raw)

    def read(self, flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The lanes of ``flat[index]`` (a flat tensor of this type)."""
        return flat.view(self.raw)[index].to(torch.int16)

    def nan_at(self, values: torch.Tensor) -> int | None:
        """The flat index of the first NaN among ``values`` (of this type), None without one
        (or for a type whose NaNs :attr:`nan_bits` does not describe)."""
        if self.nan_bits is None or not self.one_byte:
            return None
        bits = values.reshape(-1).view(torch.uint8)
        bad = (bits & self.nan_bits) == self.nan_bits
        return int(bad.nonzero()[0]) if bool(bad.any()) else None


ELEMENT_TYPES: tuple[ElementType, ...] = (
    ElementType(torch.bfloat16, "BF16", "bf16", 16),
    ElementType(torch.float8_e4m3fn, "F8_E4M3", "fp8", 8, nan_bits=0x7F),
    ElementType(torch.int8, "I8", "int8", 8),
)
"""Every element type a chain may hold: the table."""

_BY_DTYPE: dict[torch.dtype, ElementType] = {t.dtype: t for t in ELEMENT_TYPES}
_BY_CODE: dict[str, ElementType] = {t.code: t for t in ELEMENT_TYPES}
_BYTE_LANES: frozenset[torch.dtype] = frozenset(
    d for t in ELEMENT_TYPES if t.one_byte for d in (t.dtype, t.raw)
)

ELEMENT_DTYPES: dict[torch.dtype, str] = {t.dtype: t.code for t in ELEMENT_TYPES}
"""dtype -> its safetensors code, for every dtype a chain may hold (from :data:`ELEMENT_TYPES`)."""


def _held() -> str:
    return ", ".join(_BY_CODE)


def find_element_type(dtype: torch.dtype) -> ElementType | None:
    """The element type of ``dtype``; None for a dtype no chain holds."""
    return _BY_DTYPE.get(dtype)


def element_type(dtype: torch.dtype) -> ElementType:
    """The element type of ``dtype``; a FormatError for a dtype no chain holds."""
    found = _BY_DTYPE.get(dtype)
    if found is None:
        raise FormatError(f"dtype {dtype} cannot be held by a chain (it holds {_held()})")
    return found


def is_one_byte(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a one-byte element type (a quantized view's codes)."""
    found = _BY_DTYPE.get(dtype)
    return found is not None and found.one_byte


def one_byte_dtypes() -> tuple[torch.dtype, ...]:
    """The one-byte element dtypes, in table order."""
    return tuple(t.dtype for t in ELEMENT_TYPES if t.one_byte)


def holds_byte_lanes(dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` holds one-byte lanes: a one-byte element type, or the
    integer dtype its bytes are read as (``uint8``). The fingerprint hashes such a tensor's bytes
    as lanes; any other dtype as bf16."""
    return dtype in _BYTE_LANES


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors code of an element dtype; a FormatError for any other dtype."""
    return element_type(dtype).code


def dtype_from_code(code: str, *, where: str) -> torch.dtype:
    """The element dtype of a safetensors code; a FormatError naming ``where`` for any other."""
    found = _BY_CODE.get(code) if isinstance(code, str) else None
    if found is None:
        raise FormatError(f"{where}: dtype {code!r} is not one a chain holds ({_held()})")
    return found.dtype


def lane_bits(dtype: torch.dtype) -> int:
    """How many low bits of a lane an element of ``dtype`` uses (16 or 8)."""
    return element_type(dtype).lane_bits


def lanes(values: torch.Tensor) -> torch.Tensor:
    """The int16 lanes of a tensor of an element dtype: for bf16 a view (no copy), for a
    one-byte dtype a new tensor of its bytes zero-extended. Always 1-D and contiguous for
    one-byte dtypes; a bf16 tensor keeps its shape."""
    return element_type(values.dtype).lanes(values)


def check_lanes(lane: torch.Tensor, dtype: torch.dtype, *, what: str) -> None:
    """A FormatError naming ``what`` if a one-byte dtype's lanes use more than their 8 bits."""
    element_type(dtype).check_lanes(lane, what=what)


def from_lanes(lane: torch.Tensor, dtype: torch.dtype, *, what: str = "values") -> torch.Tensor:
    """Elements of ``dtype`` from their int16 lanes (checked to fit, see :func:`check_lanes`)."""
    return element_type(dtype).from_lanes(lane, what=what)


def write_lanes(flat: torch.Tensor, index: torch.Tensor, lane: torch.Tensor) -> None:
    """``flat[index] = <the elements of lanes lane>`` on a flat tensor of an element dtype, as
    bit patterns (an assignment through float scalars would rewrite NaN payloads)."""
    element_type(flat.dtype).write(flat, index, lane)


def read_lanes(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The lanes of ``flat[index]`` (a flat tensor of an element dtype)."""
    return element_type(flat.dtype).read(flat, index)
