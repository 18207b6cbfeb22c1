"""Conditional writes: replace a file only if it is still the one the writer last saw.

One writer per bucket is enforced with this one primitive. A writer reads the pointer with
its *tag* (:func:`read_tagged`), and every later write of it names that tag
(:func:`write_if`): the store refuses the write, with :class:`~deltasync.errors.ConflictError`
and nothing written, if the file changed since (another writer committed), or, for a tag of
None, if the file exists at all (create-if-absent). A store that can do this atomically has the
optional capability :class:`ConditionalStore`:

- a local folder: under an exclusive ``flock`` of a lock file beside the target, compare, then
  write a temporary file and rename it (the tag is the file's inode, size and mtime);
- ``memory://``: under a lock of this process (the bucket lives in this process only);
- ``s3://`` (s3fs): ``If-Match: <ETag>`` / ``If-None-Match: *`` on the PUT, which S3 (since
  2024) and S3-protocol servers such as moto enforce.

Any other store (a Hub bucket, whose API has no precondition; gs:// and other fsspec
backends) gets the same calls done as read, compare, write: a change between the read and the
write goes unseen. :func:`conditional_guarantee` says which a store has.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, runtime_checkable

from ..errors import ConflictError, NotFoundError
from ._base import Store, read_limited

__all__ = ["ConditionalStore", "conditional_guarantee", "content_tag", "read_tagged", "write_if"]


@runtime_checkable
class ConditionalStore(Protocol):
    """Optional capability: compare-and-swap on one file."""

    def conditional_writes(self) -> str | None:
        """What makes :meth:`write_if` atomic here, in words (None: nothing does, and the
        helpers below fall back to read, compare, write)."""
        ...

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str]:
        """At most the file's first ``limit + 1`` bytes, and its tag: a string that changes
        with every write of the file. ``NotFoundError`` if it is missing."""
        ...

    def write_if(self, path: str, data: bytes, tag: str | None) -> str:
        """Replace the file with ``data`` only if its tag is still ``tag`` (None: only if there
        is no such file); return the new tag. ``ConflictError``, nothing written, otherwise."""
        ...


def content_tag(data: bytes) -> str:
    """The tag of a file's bytes, where a store has no tag of its own."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def conditional_guarantee(store: Store) -> str | None:
    """What makes conditional writes atomic in ``store``, or None where they are emulated."""
    if isinstance(store, ConditionalStore):
        return store.conditional_writes()
    return None


def read_tagged(store: Store, path: str, limit: int) -> tuple[bytes, str]:
    """The file's first ``limit + 1`` bytes at most, and its tag (see :class:`ConditionalStore`);
    ``NotFoundError`` if it is missing."""
    if conditional_guarantee(store) is not None:
        return store.read_tagged(path, limit)  # type: ignore[attr-defined]
    data = read_limited(store, path, limit)
    return data, content_tag(data)


def write_if(store: Store, path: str, data: bytes, tag: str | None, *, limit: int) -> str:
    """Write ``data`` to ``path`` only if the file's tag is still ``tag`` (None: only if it is
    absent); return the new tag, or raise ``ConflictError`` having written nothing.

    Atomic where the store says so (:func:`conditional_guarantee`); elsewhere the file is read
    (at most ``limit + 1`` bytes), compared and then written, and a write by another writer
    between the read and the write goes unseen."""
    if conditional_guarantee(store) is not None:
        return store.write_if(path, data, tag)  # type: ignore[attr-defined]
    try:
        current: str | None = read_tagged(store, path, limit)[1]
    except NotFoundError:
        current = None
    if current != tag:
        raise conflict(store, path, tag, current)
    store.write_bytes(path, data)
    return content_tag(data)


def conflict(store: Store, path: str, expected: str | None, found: str | None) -> ConflictError:
    """The error of a refused conditional write of ``path``."""
    if expected is None:
        why = "it exists already, and this write was to create it"
    elif found is None:
        why = "it was deleted since this writer last read or wrote it"
    else:
        why = "it changed since this writer last read or wrote it"
    return ConflictError(f"conditional write of {path!r} to bucket {store.url} refused: {why}; nothing was written")
