"""Deltas: the changed elements of one version, in the file a registered codec lays out."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import FormatError
from .codecs import CODECS, BaseLookup, Change, DeltaContext, get_codec
from .container import load_safetensors, safetensors_pieces
from .header import FileHeader, read_header, with_extra_metadata

__all__ = ["encode_delta", "delta_pieces", "decode_delta"]


def encode_delta(
    changes: Mapping[str, Change],
    *,
    version: int,
    anchor: int,
    codec: str,
    total: int,
    fingerprint: str,
    base_fingerprint: str,
    level: int | None = None,
    numels: Mapping[str, int] | None = None,
    part: tuple[int, int] | None = None,
    manifest: str | None = None,
    extra_metadata: Mapping[str, str] | None = None,
) -> bytes:
    """A delta from ``version - 1`` to ``version``: the bytes of :func:`delta_pieces`' file."""
    return b"".join(
        delta_pieces(
            changes, version=version, anchor=anchor, codec=codec, total=total, fingerprint=fingerprint,
            base_fingerprint=base_fingerprint, level=level, numels=numels, part=part, manifest=manifest,
            extra_metadata=extra_metadata,
        )  # fmt: skip
    )


def delta_pieces(
    changes: Mapping[str, Change],
    *,
    version: int,
    anchor: int,
    codec: str,
    total: int,
    fingerprint: str,
    base_fingerprint: str,
    level: int | None = None,
    numels: Mapping[str, int] | None = None,
    part: tuple[int, int] | None = None,
    manifest: str | None = None,
    extra_metadata: Mapping[str, str] | None = None,
) -> list[memoryview]:
    """A delta from ``version - 1`` to ``version``, as its file's pieces in order (the header,
    then each tensor's data where the codec left it: a store writes them one after another, and
    no copy of the file is made). Parameters with no change are left out.

    ``codec`` is a name in :data:`~deltasync.format.codecs.CODECS`; ``level`` its
    compression level (None: the codec's default). ``part=(number, count)`` writes part
    ``number`` of a version split over ``count`` writers (format version 2); its indices are
    still flat indices of the full parameters. ``manifest``: the state's manifest digest
    (:mod:`deltasync.format.manifest`), written to the metadata. ``extra_metadata``: ``x-``
    keys written beside it (a view's identity).
    """
    if codec not in CODECS:
        raise FormatError(f"unknown codec {codec!r} (known: {', '.join(CODECS)})")
    coder = get_codec(codec)
    items = [(name, change) for name, change in changes.items() if change.index.numel()]
    changed = sum(change.index.numel() for _, change in items)
    header = FileHeader(
        kind="delta",
        version=version,
        base=version - 1,
        anchor=anchor,
        codec=codec,
        params=len(items),
        changed=changed,
        total=total,
        fingerprint=fingerprint,
        base_fingerprint=base_fingerprint,
        names=tuple(name for name, _ in items) if coder.lists_names else None,
        part=None if part is None else part[0],
        parts=None if part is None else part[1],
        manifest=manifest,
    )
    tensors = coder.encode_blobs(items, numels=numels, level=coder.default_level if level is None else level)
    metadata = with_extra_metadata(header.to_metadata(), extra_metadata, where=f"delta {version}")
    return safetensors_pieces(tensors, metadata)


def decode_delta(
    data: bytes,
    *,
    where: str,
    numels: Mapping[str, int],
    base_values: BaseLookup,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> tuple[FileHeader, dict[str, Change]]:
    """Decode and validate a delta against the receiver's parameter sizes.

    ``numels`` maps every parameter the receiver holds to its element count; a name not in it
    is an unknown parameter. ``base_values`` gives current values (the zstd codec stores new
    values relative to them). ``dtypes`` gives each parameter's element dtype (None: every one
    bf16, the bf16 chain); values of another dtype are refused. Nothing outside the returned
    objects is changed.
    """
    header = read_header(data, where=where)
    if header.kind != "delta":
        raise FormatError(f"{where}: expected a delta, found an {header.kind}")
    tensors = load_safetensors(data, where=where)
    context = DeltaContext(
        where=where, names=header.names, changed=header.changed, numels=numels, base_values=base_values, dtypes=dtypes
    )
    changes = get_codec(header.codec).decode(tensors, context)
    changed = sum(change.index.numel() for change in changes.values())
    if len(changes) != header.params or changed != header.changed:
        raise FormatError(
            f"{where}: holds {len(changes)} parameters / {changed} changed elements, "
            f"its metadata says {header.params} / {header.changed}"
        )
    return header, changes
