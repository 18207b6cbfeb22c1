"""The raw codec: per parameter, its flat indices (int32, or int64 when needed) and new
values in the parameter's element dtype (bf16 in the bf16 chain), as plain tensors ``<name>:indices`` and ``<name>:values`` (readable with safe_open alone)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ...errors import FormatError
from ..dtypes import ELEMENT_DTYPES
from .base import Change, Codec, DeltaContext, Table, check_index, known_numel

__all__ = ["RawCodec"]

INDEX_SUFFIX = ":indices"
VALUE_SUFFIX = ":values"
INT32_LIMIT = 2**31 - 1


class RawCodec(Codec):
    name = "raw"

    def encode(
        self, items: Sequence[tuple[str, Change]], *, numels: Mapping[str, int] | None, level: int | None
    ) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for name, change in items:
            wide = (numels is not None and numels[name] > INT32_LIMIT) or int(change.index[-1]) > INT32_LIMIT
            tensors[name + INDEX_SUFFIX] = change.index.to(torch.int64 if wide else torch.int32)
            new = change.new
            tensors[name + VALUE_SUFFIX] = new if new.dtype in ELEMENT_DTYPES else new.to(torch.bfloat16)
        return tensors

    def decode(self, tensors: Mapping[str, torch.Tensor], delta: DeltaContext) -> dict[str, Change]:
        where, numels = delta.where, delta.numels
        changes: dict[str, Change] = {}
        for key in sorted(tensors):
            if key.endswith(INDEX_SUFFIX):
                name = key[: -len(INDEX_SUFFIX)]
            elif key.endswith(VALUE_SUFFIX):
                name = key[: -len(VALUE_SUFFIX)]
                if name + INDEX_SUFFIX not in tensors:
                    raise FormatError(f"{where}: parameter {name!r} has values but no indices")
                continue
            else:
                raise FormatError(f"{where}: unexpected tensor {key!r} in a raw delta")
            numel = known_numel(name, numels, where)
            index = tensors[key]
            values = tensors.get(name + VALUE_SUFFIX)
            if values is None:
                raise FormatError(f"{where}: parameter {name!r} has indices but no values")
            if index.dtype not in (torch.int32, torch.int64) or index.dim() != 1:
                raise FormatError(f"{where}: indices of parameter {name!r} must be a 1-D int32/int64 tensor, got {index.dtype} {tuple(index.shape)}")
            dtype = delta.dtype(name)
            if values.dtype != dtype or values.dim() != 1:
                raise FormatError(f"{where}: values of parameter {name!r} must be a 1-D {str(dtype).removeprefix('torch.')} tensor, got {values.dtype} {tuple(values.shape)}")
            if values.numel() != index.numel():
                raise FormatError(f"{where}: parameter {name!r} has {index.numel()} indices but {values.numel()} values")
            index = index.to(torch.int64)
            check_index(index, name, numel, where)
            changes[name] = Change(index=index, new=values)
        return changes

    def describe(
        self, tensors: Mapping[str, torch.Tensor], *, names: tuple[str, ...] | None, changed: int
    ) -> list[Table]:
        rows = [
            [key.removesuffix(INDEX_SUFFIX), str(tensors[key].numel()), str(tensors[key].dtype).removeprefix("torch.")]
            for key in sorted(k for k in tensors if k.endswith(INDEX_SUFFIX))
        ]
        return [(["parameter", "changed", "index dtype"], rows)]
