"""Where published versions live: one small ``Store`` protocol and its backends.

``open_store(url)`` picks the backend from the URL; every backend passes the same
conformance suite (``tests/stores/test_conformance.py``).
"""

from __future__ import annotations

from ._base import (
    BoundedReadStore,
    LimitedReads,
    Store,
    StreamingStore,
    TempCleaningStore,
    open_read,
    read_buffer,
    read_limited,
    write_pieces,
    write_stream,
)
from ._conditional import ConditionalStore, TaggedFile, conditional_guarantee, read_tagged, write_if
from ._fsspec import FsspecStore
from ._hf import HfBucketStore
from ._local import LocalStore
from ._open import open_store

__all__ = [
    "BoundedReadStore",
    "ConditionalStore",
    "FsspecStore",
    "HfBucketStore",
    "LimitedReads",
    "LocalStore",
    "Store",
    "StreamingStore",
    "TaggedFile",
    "TempCleaningStore",
    "conditional_guarantee",
    "open_read",
    "open_store",
    "read_buffer",
    "read_limited",
    "read_tagged",
    "write_if",
    "write_pieces",
    "write_stream",
]
