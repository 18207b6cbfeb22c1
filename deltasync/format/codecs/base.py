"""What every delta codec shares: :class:`Change`, the :class:`Codec` interface, and checks."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, TypeAlias

import torch

from ...errors import FormatError

__all__ = ["Change", "BaseLookup", "Blob", "Table", "DeltaContext", "Codec", "as_tensor", "check_index", "known_numel"]


@dataclass(frozen=True)
class Change:
    """The changed elements of one parameter: sorted flat indices and their new values."""

    index: torch.Tensor
    """int64, 1-D, strictly increasing."""
    new: torch.Tensor
    """1-D, the new values, in the parameter's element dtype (bf16 in the bf16 chain; see
    :mod:`deltasync.format.dtypes`)."""
    old: torch.Tensor | None = None
    """1-D, the values they replace, same dtype (needed to encode with the zstd codec)."""
    invalid: torch.Tensor | None = None
    """Positions (into ``index``) whose value did not decode to an element of the dtype (a
    one-byte code whose coded difference leaves its byte); a reader that holds one of those
    elements refuses the delta. A reader that holds only some elements decodes the others
    against zeros, so only it can tell (see :meth:`deltasync.reader.chain.Overlay.advance`)."""


BaseLookup = Callable[[str, torch.Tensor], torch.Tensor]
"""(parameter name, int64 indices) -> the receiver's current values there, in the
parameter's element dtype."""

Blob: TypeAlias = torch.Tensor | bytes
"""A tensor of a file being written: a tensor, or the bytes of a 1-D uint8 tensor (compressed
data, written from where it lies)."""


def as_tensor(blob: Blob) -> torch.Tensor:
    """``blob`` as a tensor (bytes are copied into a new 1-D uint8 tensor)."""
    if isinstance(blob, torch.Tensor):
        return blob
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)


Table = tuple[list[str], list[list[str]]]
"""A table ``deltasync inspect`` prints: its column names and its rows."""


@dataclass(frozen=True, kw_only=True)
class DeltaContext:
    """What a codec decodes a delta's tensors with: the file's metadata and the receiver's state."""

    where: str
    """The file, as errors name it."""
    names: tuple[str, ...] | None
    """The metadata key ``names`` (for a codec that :attr:`~Codec.lists_names`)."""
    changed: int
    """The metadata key ``changed``: elements the file sets."""
    numels: Mapping[str, int]
    """Every parameter the receiver holds, with its element count."""
    base_values: BaseLookup
    """The receiver's current values (a codec may store new values relative to them)."""
    dtypes: Mapping[str, torch.dtype] | None = None
    """Every parameter's element dtype (None: all bf16, the bf16 chain). A delta whose values
    have another dtype is refused."""

    def dtype(self, name: str) -> torch.dtype:
        """Parameter ``name``'s element dtype."""
        return torch.bfloat16 if self.dtypes is None else self.dtypes[name]


class Codec(ABC):
    """How a delta's changes become the tensors of its file, and back.

    A codec is one module that subclasses this and one entry in the registry
    (:mod:`deltasync.format.codecs`). The file around the tensors (header, metadata, counts
    checked against them) is :func:`~deltasync.format.encode_delta`'s and
    :func:`~deltasync.format.decode_delta`'s: a codec sees only the changes and the tensors.
    """

    name: ClassVar[str]
    """The value of the metadata key ``codec`` in the files it writes."""
    lists_names: ClassVar[bool] = False
    """Whether its files list the changed parameters, in the order their elements are stored,
    in the metadata key ``names`` (a codec whose tensor names do not say so itself)."""
    levels: ClassVar[range | None] = None
    """The compression levels it takes (``PublishOptions.zstd_level``); None: it takes none."""
    default_level: ClassVar[int | None] = None
    """The level it uses when none is given."""

    @abstractmethod
    def encode(
        self, items: Sequence[tuple[str, Change]], *, numels: Mapping[str, int] | None, level: int | None
    ) -> dict[str, torch.Tensor]:
        """The tensors of a file holding ``items`` (each with at least one changed element).

        ``numels`` maps parameter names to element counts, when the caller knows them;
        ``level`` is one of :attr:`levels` (None for a codec that takes none)."""

    def encode_blobs(
        self, items: Sequence[tuple[str, Change]], *, numels: Mapping[str, int] | None, level: int | None
    ) -> dict[str, Blob]:
        """:meth:`encode`, where a 1-D uint8 tensor may be given as its bytes (what a file is
        written from: a codec that compresses need not copy its output into tensors)."""
        return dict(self.encode(items, numels=numels, level=level))

    @abstractmethod
    def decode(self, tensors: Mapping[str, torch.Tensor], delta: DeltaContext) -> dict[str, Change]:
        """The changes in a file's ``tensors``, each checked against ``delta.numels`` (a name
        not in it is an unknown parameter); anything else is a :class:`FormatError` naming
        ``delta.where``."""

    @abstractmethod
    def describe(
        self, tensors: Mapping[str, torch.Tensor], *, names: tuple[str, ...] | None, changed: int
    ) -> list[Table]:
        """The tables ``deltasync inspect`` prints for a delta of this codec."""


def check_index(index: torch.Tensor, name: str, numel: int, where: str) -> None:
    """A FormatError unless the int64 ``index`` is strictly increasing within ``0 .. numel - 1``."""
    if index.numel() == 0:
        return
    if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
        raise FormatError(f"{where}: indices of parameter {name!r} are not strictly increasing")
    if int(index[0]) < 0 or int(index[-1]) >= numel:
        bad = int(index[-1]) if int(index[-1]) >= numel else int(index[0])
        raise FormatError(
            f"{where}: index {bad} of parameter {name!r} is out of range (it has {numel} elements)"
        )


def known_numel(name: str, numels: Mapping[str, int], where: str) -> int:
    """The element count of parameter ``name``; a FormatError if the receiver has no such parameter."""
    if name not in numels:
        raise FormatError(f"{where}: unknown parameter {name!r} (not in the receiver's state)")
    return numels[name]
