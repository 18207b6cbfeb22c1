"""Anchors: the complete state of a version, every parameter under its checkpoint name, in
its element dtype (bf16 in the bf16 chain; codes and scales in a quantized view)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..errors import FormatError
from .container import TensorChunks, load_tensors, safetensors_stream
from .dtypes import ELEMENT_DTYPES
from .header import FileHeader, read_header, with_extra_metadata

__all__ = ["AnchorSource", "encode_anchor", "anchor_stream", "decode_anchor"]

_HOLDS = "anchors hold bfloat16 (or, in a quantized view, F8_E4M3 / I8 codes)"


def encode_anchor(
    state: Mapping[str, torch.Tensor],
    *,
    version: int,
    fingerprint: str,
    extra_metadata: Mapping[str, str] | None = None,
    manifest: str | None = None,
) -> bytes:
    """An anchor: every parameter, in its element dtype (bf16 in the bf16 chain), under its
    checkpoint name.

    ``extra_metadata``: further metadata keys, each starting with ``x-`` (e.g. the PEFT
    adapter config of an adapter bucket, see :mod:`deltasync.trainer.lora`); readers that do not
    know a key ignore it. ``manifest``: the state's manifest digest
    (:mod:`deltasync.format.manifest`), written to the metadata."""
    for name, tensor in state.items():
        if tensor.dtype not in ELEMENT_DTYPES:
            raise FormatError(f"anchor {version}: parameter {name!r} is {tensor.dtype}, {_HOLDS}")
    sources = [
        AnchorSource(name, tuple(t.shape), 0, t.numel(), lambda t=t: (t.detach().reshape(-1),), t.dtype)  # type: ignore[misc]
        for name, t in state.items()
    ]
    total = sum(t.numel() for t in state.values())
    stream = anchor_stream(
        sources, version=version, fingerprint=fingerprint, total=total, extra_metadata=extra_metadata, manifest=manifest
    )
    return b"".join(stream)


@dataclass(frozen=True)
class AnchorSource:
    """Flat elements ``begin .. end - 1`` of parameter ``name`` (full shape ``shape``), given
    as consecutive bf16 chunks, for :func:`anchor_stream`."""

    name: str
    shape: tuple[int, ...]
    begin: int
    end: int
    chunks: Callable[[], Iterable[torch.Tensor]]
    dtype: torch.dtype = torch.bfloat16
    """The element dtype (see :mod:`deltasync.format.dtypes`)."""


def anchor_stream(
    sources: Sequence[AnchorSource],
    *,
    version: int,
    fingerprint: str,
    total: int,
    part: int | None = None,
    parts: int | None = None,
    extra_metadata: Mapping[str, str] | None = None,
    manifest: str | None = None,
) -> Iterator[memoryview]:
    """The bytes of an anchor (or of part ``part`` of ``parts`` of a split anchor), chunk by chunk.

    A single-file anchor holds every parameter whole, in its shape; a part holds a 1-D slice
    of each parameter (format version 2). The bytes are those :func:`encode_anchor` and
    :func:`~deltasync.reader.parts.encode_anchor_part` give, without the whole file in memory.
    """
    ordered = sorted(sources, key=lambda s: s.name)
    if parts is None and any(s.begin != 0 or s.end != math.prod(s.shape) for s in ordered):
        raise FormatError(f"anchor {version}: a single-file anchor holds every parameter whole")
    header = FileHeader(
        kind="anchor",
        version=version,
        base=None,
        anchor=version,
        codec="raw",
        params=len(ordered),
        changed=sum(s.end - s.begin for s in ordered),
        total=total,
        fingerprint=fingerprint,
        part=part,
        parts=parts,
        slices=None if parts is None else tuple((s.name, tuple(s.shape), s.begin, s.end) for s in ordered),
        manifest=manifest,
    )
    meta = with_extra_metadata(header.to_metadata(), extra_metadata, f"anchor {version}")
    tensors = [
        TensorChunks(s.name, s.dtype, s.shape if parts is None else (s.end - s.begin,), s.chunks) for s in ordered
    ]
    return safetensors_stream(tensors, meta)


def decode_anchor(data: bytes | bytearray, *, where: str) -> tuple[FileHeader, dict[str, torch.Tensor]]:
    """An anchor's header and tensors. From a ``bytearray`` (what stores' ``read_buffer``
    gives) the tensors are views of it: the file and its tensors are never both in memory."""
    header = read_header(data, where=where)  # type: ignore[arg-type]
    if header.kind != "anchor":
        raise FormatError(f"{where}: expected an anchor, found a {header.kind}")
    tensors = load_tensors(data, where=where)
    total = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in ELEMENT_DTYPES:
            raise FormatError(f"{where}: parameter {name!r} is {tensor.dtype}, {_HOLDS}")
        total += tensor.numel()
    if len(tensors) != header.params or total != header.total:
        raise FormatError(
            f"{where}: holds {len(tensors)} parameters / {total} elements, "
            f"its metadata says {header.params} / {header.total}"
        )
    return header, tensors
