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

__all__ = ["ANCHOR_PART_BYTES", "AnchorSource", "anchor_parts", "encode_anchor", "anchor_stream", "decode_anchor"]

ANCHOR_PART_BYTES = 1 << 29
"""A single writer's anchor larger than this (512 MiB) is written as parts of about this size,
each holding whole tensors, in parallel (format version 2's split anchor, which every reader
reads): their SHA-256s, copies and writes run on several cores at once."""

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


def anchor_parts(sources: Sequence[AnchorSource], part_bytes: int) -> list[list[AnchorSource]]:
    """A single writer's whole tensors (``sources``, each ``begin == 0`` and ``end`` its size)
    laid out as the parts of a split anchor of about ``part_bytes`` each: one list of sources per
    part, every part listing every tensor, whole in the one part that holds it and as an empty
    range in the others (at its start before that part, at its end after). Tensors go to parts in
    name order, each to the part its middle byte falls in (an empty tensor to the part of the one
    before it, or of the first nonempty one); one list (the sources as given) when
    the anchor fits in one part. It depends on the names, sizes and dtypes alone, so the same
    state splits the same way on any machine."""
    if part_bytes < 1:
        raise ValueError(f"part_bytes must be 1 or more, got {part_bytes}")
    ordered = sorted(sources, key=lambda s: s.name)
    sizes = [(s.end - s.begin) * s.dtype.itemsize for s in ordered]
    total = sum(sizes)
    parts = max(1, math.ceil(total / part_bytes))
    if parts == 1 or len(ordered) == 1:
        return [list(sources)]
    share, at, middles = total / parts, 0, []
    for size in sizes:
        middles.append(min(parts - 1, int((at + size / 2) // share)) if size else None)
        at += size
    # An empty tensor goes with the tensor before it (the first nonempty one, at the start): it
    # never makes a part of its own.
    home: list[int] = []
    for middle in middles:
        home.append(middle if middle is not None else home[-1] if home else next(m for m in middles if m is not None))
    used = sorted(set(home))  # a part no middle falls in (next to a tensor larger than a part) is left out
    number = {p: n for n, p in enumerate(used)}
    out: list[list[AnchorSource]] = [[] for _ in used]
    for source, p in zip(ordered, home):
        if source.begin != 0 or source.end != math.prod(source.shape):
            raise FormatError(f"anchor part planning takes whole tensors; {source.name!r} is elements {source.begin}..{source.end}")
        n, size = number[p], source.end
        for k, listed in enumerate(out):
            if k == n:
                listed.append(source)
            else:
                edge = 0 if k < n else size
                listed.append(AnchorSource(source.name, source.shape, edge, edge, lambda: (), source.dtype))
    return out


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
