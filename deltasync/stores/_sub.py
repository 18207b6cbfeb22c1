"""A folder of a bucket seen as a bucket of its own (a quantized view's chain lives in one)."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import BinaryIO

from ._base import Store, StreamingStore, check_path, open_read, read_limited, write_stream
from ._conditional import conditional_guarantee

__all__ = ["SubStore", "sub_store"]


class SubStore:
    """Paths of ``parent`` under ``prefix`` (e.g. ``"views/FP8_DYNAMIC/"``), as a :class:`Store`.

    Every operation is the parent's on ``prefix + path``; the parent's guarantees (atomic
    writes per file, bounded reads, streaming, conditional writes) hold. ``url`` is the parent's with the folder
    appended, which :func:`~deltasync.stores.open_store` opens as the same files.
    """

    def __init__(self, parent: Store, prefix: str) -> None:
        if not prefix.endswith("/"):
            raise ValueError(f"a sub-store's prefix ends with '/', got {prefix!r}")
        check_path(prefix[:-1])
        self.parent = parent
        self.prefix = prefix
        self.url = f"{parent.url.rstrip('/')}/{prefix[:-1]}"

    def __repr__(self) -> str:
        return f"SubStore({self.parent!r}, {self.prefix!r})"

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        full = self.prefix + check_path(path)
        if limit is not None:
            return read_limited(self.parent, full, limit)
        return self.parent.read_bytes(full)

    def read_head(self, path: str, limit: int) -> bytes:
        return read_limited(self.parent, self.prefix + check_path(path), limit)

    def write_bytes(self, path: str, data: bytes) -> None:
        self.parent.write_bytes(self.prefix + check_path(path), data)

    def exists(self, path: str) -> bool:
        return self.parent.exists(self.prefix + check_path(path))

    def list(self, prefix: str = "") -> list[str]:
        n = len(self.prefix)
        return [path[n:] for path in self.parent.list(self.prefix + prefix)]

    def delete(self, paths: Iterable[str]) -> None:
        self.parent.delete([self.prefix + check_path(path) for path in paths])

    # Conditional writes (:class:`~deltasync.stores.ConditionalStore`): the parent's, atomic where
    # the parent's are. Where they are not, :func:`~deltasync.stores.write_if` reads, compares and
    # writes through the methods above and never calls these two.

    def conditional_writes(self) -> str | None:
        return conditional_guarantee(self.parent)

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str]:
        return self.parent.read_tagged(self.prefix + check_path(path), limit)  # type: ignore[attr-defined,no-any-return]

    def write_if(self, path: str, data: bytes, tag: str | None) -> str:
        return self.parent.write_if(self.prefix + check_path(path), data, tag)  # type: ignore[attr-defined,no-any-return]


class _StreamingSubStore(SubStore):
    """A :class:`SubStore` of a parent that streams (:class:`StreamingStore`)."""

    @property
    def streams_in_place(self) -> bool:
        """The parent's (see :func:`~deltasync.stores.write_pieces`)."""
        return bool(getattr(self.parent, "streams_in_place", False))

    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        write_stream(self.parent, self.prefix + check_path(path), chunks)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        return open_read(self.parent, self.prefix + check_path(path), 0)


def sub_store(parent: Store, prefix: str) -> SubStore:
    """The folder ``prefix`` of ``parent`` as a store, streaming where the parent streams."""
    cls = _StreamingSubStore if isinstance(parent, StreamingStore) else SubStore
    return cls(parent, prefix)
