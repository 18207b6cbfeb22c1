"""The delta codecs, by the name a file's metadata key ``codec`` gives.

This registry is the one place codecs are known: :func:`~deltasync.format.encode_delta`,
:func:`~deltasync.format.decode_delta`, the file header's check of ``codec``,
``PublishOptions`` and ``deltasync inspect`` all look a codec up here. A new codec is one
module (a :class:`Codec` subclass) and one :func:`register_codec` line below; a new codec
is also a new format (docs/protocol.md), which readers of older versions refuse.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..registry import Names
from .base import BaseLookup, Change, Codec, DeltaContext, Table
from .raw import RawCodec
from .zstd import ZstdCodec

__all__ = [
    "CODECS",
    "BaseLookup",
    "Change",
    "Codec",
    "DeltaContext",
    "Table",
    "get_codec",
    "register_codec",
    "unregister_codec",
]

_REGISTRY: dict[str, Codec] = {}

CODECS: Sequence[str] = Names(_REGISTRY)
"""The names of the codecs this deltasync reads and writes ("raw", "zstd")."""


def get_codec(name: str) -> Codec:
    """The codec registered as ``name`` (``KeyError`` if none is)."""
    return _REGISTRY[name]


def register_codec(codec: Codec) -> None:
    """Make ``codec`` known under ``codec.name`` (a ``ValueError`` if that name is taken)."""
    if codec.name in _REGISTRY:
        raise ValueError(f"a codec named {codec.name!r} is already registered")
    _REGISTRY[codec.name] = codec


def unregister_codec(name: str) -> None:
    """Forget the codec ``name`` (``KeyError`` if none is registered)."""
    del _REGISTRY[name]


register_codec(RawCodec())
register_codec(ZstdCodec())
