"""The container: safetensors files, written byte for byte as the safetensors library writes
them (with the metadata keys sorted, so that the same content always gives the same bytes;
the library orders metadata keys at random), and read with the library after their tensor
table was checked."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as _st_load

from ..errors import FormatError
from .limited_json import MAX_COUNT, check_int

__all__ = [
    "MAX_HEADER_BYTES",
    "TensorChunks",
    "TensorSpan",
    "check_tensor_table",
    "safetensors_bytes",
    "safetensors_pieces",
    "safetensors_stream",
    "tensor_spans",
    "load_safetensors",
    "load_tensors",
]

MAX_HEADER_BYTES = 100 << 20
"""The largest safetensors header a reader parses (the safetensors library's own limit)."""

_ST_DTYPES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2, "U8": 1, "I8": 1, "F8_E4M3": 1, "BOOL": 1}


def check_tensor_table(table: Mapping[str, Any], data_bytes: int, where: str) -> None:
    """Every tensor's dtype, shape and offsets, checked before the safetensors library sees them."""

    def bad(field: str, problem: str) -> FormatError:
        return FormatError(f"{where}: not a readable safetensors file ({field} {problem})")

    for name, info in table.items():
        if name == "__metadata__":
            continue
        field = f"tensor {name[:80]!r}"
        if not isinstance(info, dict):
            raise bad(field, "must be an object in the safetensors header")
        dtype = info.get("dtype")
        itemsize = _ST_DTYPES.get(dtype) if isinstance(dtype, str) else None
        if itemsize is None:
            raise bad(field, f"has an unsupported dtype {dtype!r:.40}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or len(shape) > 8:
            raise bad(field, "has an invalid shape (a list of at most 8 sizes)")
        numel = 1
        for dim in shape:
            numel *= check_int(dim, where=where, field=f"{field} shape")
            if numel > MAX_COUNT:
                raise bad(field, f"claims more than {MAX_COUNT} elements")
        if not isinstance(offsets, list) or len(offsets) != 2:
            raise bad(field, "has invalid data_offsets")
        begin = check_int(offsets[0], where=where, field=f"{field} data_offsets")
        end = check_int(offsets[1], where=where, field=f"{field} data_offsets")
        if not begin <= end <= data_bytes or end - begin != numel * itemsize:
            raise bad(field, f"data_offsets {offsets} do not fit its shape {shape} or the {data_bytes} data bytes of the file")


_DTYPES = {
    torch.float64: ("F64", 8),
    torch.int64: ("I64", 8),
    torch.float32: ("F32", 4),
    torch.int32: ("I32", 4),
    torch.bfloat16: ("BF16", 2),
    torch.float16: ("F16", 2),
    torch.int16: ("I16", 2),
    torch.uint8: ("U8", 1),
    torch.int8: ("I8", 1),
    torch.float8_e4m3fn: ("F8_E4M3", 1),
    torch.bool: ("BOOL", 1),
}


def safetensors_bytes(tensors: Mapping[str, torch.Tensor | bytes], metadata: Mapping[str, str]) -> bytes:
    """Serialize like ``safetensors.torch.save``, with metadata keys sorted (deterministic).
    A value given as bytes is a 1-D uint8 tensor's data."""
    return b"".join(safetensors_pieces(tensors, metadata))


def safetensors_pieces(tensors: Mapping[str, torch.Tensor | bytes], metadata: Mapping[str, str]) -> list[memoryview]:
    """:func:`safetensors_bytes`, as the file's pieces in order (the header, then each tensor's
    data where it lies: nothing is copied), for a store to write one after another."""
    items = [
        TensorChunks(name, torch.uint8, (len(t),), lambda t=t: (t,))  # type: ignore[misc]
        if isinstance(t, bytes)
        else TensorChunks(name, t.dtype, tuple(t.shape), lambda t=t: (t.detach().reshape(-1),))  # type: ignore[misc]
        for name, t in tensors.items()
    ]
    return list(safetensors_stream(items, metadata))


@dataclass(frozen=True)
class TensorChunks:
    """A tensor to serialize, given by its flat values in consecutive chunks (so that no
    serializer ever needs the whole tensor, or the whole file, in memory at once)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[torch.Tensor | bytes]]
    """Yields 1-D tensors of ``dtype`` that together hold the flat values, in order (of a uint8
    tensor: also its bytes)."""


def safetensors_stream(tensors: Sequence[TensorChunks], metadata: Mapping[str, str]) -> Iterator[memoryview]:
    """The bytes of a safetensors file, header first, then each tensor's data chunk by chunk.

    The layout is the safetensors library's (tensors ordered by alignment, then name; the
    header padded with spaces to 8 bytes), with metadata keys sorted. A chunk may be a view of
    the caller's memory: it is valid until the next one is asked for.
    """
    order = sorted(tensors, key=lambda t: (-_DTYPES[t.dtype][1], t.name))
    header: dict[str, Any] = {"__metadata__": {key: metadata[key] for key in sorted(metadata)}}
    offset = 0
    for item in order:
        nbytes = math.prod(item.shape) * _DTYPES[item.dtype][1]
        header[item.name] = {"dtype": _DTYPES[item.dtype][0], "shape": list(item.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    yield memoryview(struct.pack("<Q", len(text)) + text)
    for item in order:
        expected, written = header[item.name]["data_offsets"][1] - header[item.name]["data_offsets"][0], 0
        for chunk in item.chunks():
            if isinstance(chunk, bytes):
                if item.dtype != torch.uint8:
                    raise FormatError(f"{item.name!r}: a chunk of bytes in a {item.dtype} tensor")
                data = memoryview(chunk)
            else:
                if chunk.dtype != item.dtype:
                    raise FormatError(f"{item.name!r}: a chunk of {chunk.dtype} in a {item.dtype} tensor")
                data = memoryview(chunk.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
            if not data.nbytes:
                continue
            written += data.nbytes
            if written > expected:
                break
            yield data
        if written != expected:
            raise FormatError(f"{item.name!r}: its chunks hold {written} bytes, its shape {list(item.shape)} needs {expected}")


@dataclass(frozen=True)
class TensorSpan:
    """Where a tensor's bytes lie in a file's data section (after the header)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def tensor_spans(table: Mapping[str, Any], *, where: str, data_bytes: int) -> list[TensorSpan]:
    """The tensors of a table :func:`check_tensor_table` checked, in data order; they must tile the
    ``data_bytes`` data bytes exactly (no overlap, no gap, nothing after the last)."""
    spans = sorted(
        (
            TensorSpan(name, _TORCH_DTYPES[info["dtype"]], tuple(info["shape"]), *info["data_offsets"])
            for name, info in table.items()
            if name != "__metadata__"
        ),
        key=lambda span: (span.begin, span.end),
    )
    position = 0
    for span in spans:
        if span.begin != position:
            raise FormatError(
                f"{where}: not a readable safetensors file (tensor {span.name[:80]!r} starts at data byte {span.begin}, "
                f"the tensors before it end at {position}: overlapping or with gaps)"
            )
        position = span.end
    if position != data_bytes:
        raise FormatError(f"{where}: not a readable safetensors file ({data_bytes - position} bytes after the last tensor)")
    return spans


def load_safetensors(data: bytes | bytearray, *, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, copied out by the library (a FormatError if it cannot)."""
    try:
        return _st_load(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise FormatError(f"{where}: not a readable safetensors file ({exc})") from exc


_TORCH_DTYPES = {code: dtype for dtype, (code, _) in _DTYPES.items()}


def load_tensors(data: bytes | bytearray, *, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a file whose header :func:`~deltasync.format.read_header` accepted.

    From a ``bytearray`` they are views of it (no copy); the buffer must then be left alone.
    From ``bytes`` the safetensors library copies them out.
    """
    if not isinstance(data, bytearray):
        return load_safetensors(data, where=where)
    (length,) = struct.unpack("<Q", data[:8])
    start = 8 + length
    spans = tensor_spans(json.loads(bytes(data[8:start])), where=where, data_bytes=len(data) - start)
    out: dict[str, torch.Tensor] = {}
    for span in spans:
        itemsize = _DTYPES[span.dtype][1]
        if (start + span.begin) % itemsize:
            return load_safetensors(data, where=where)  # misaligned: let the library copy it
        if span.end > span.begin:
            count = (span.end - span.begin) // itemsize
            out[span.name] = torch.frombuffer(data, dtype=span.dtype, count=count, offset=start + span.begin).view(span.shape)
        else:
            out[span.name] = torch.empty(span.shape, dtype=span.dtype)
    return out
