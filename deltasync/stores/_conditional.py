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

:class:`TaggedFile` is what a single writer builds on it: one file it replaces conditionally
(a chain's pointer, the bf16 chain's or a view's), the tag it last read or wrote, and, once a
conditional write or a check found the file changed under it, why it stops.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from ..errors import ConflictError, NotFoundError, WriterConflictError
from ._base import Store, read_limited

__all__ = ["ConditionalStore", "TaggedFile", "conditional_guarantee", "content_tag", "read_tagged", "write_if"]


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


class TaggedFile:
    """One file that one writer replaces conditionally, and whether that writer may go on.

    Every write names the tag this writer last read or wrote (:func:`write_if`). A file
    rewritten with this writer's own bytes (a bucket restored from a copy) is still its own,
    though its tag changed. A refused write, or a check that finds the file changed, stops the
    writer for good: :attr:`stopped` says why, in the words ``changed(what, error)`` gives, and
    every later write raises :class:`~deltasync.errors.WriterConflictError` with them.

    Args:
        store: the bucket (or a folder of it).
        path: the file.
        limit: the most bytes read back from it.
        changed: the reason the writer stops, from what it was doing and the refused write's
            error (None: a check found the change).
    """

    def __init__(self, store: Store, path: str, *, limit: int, changed: Callable[[str, Exception | None], str]) -> None:
        self.store = store
        self.path = path
        self.limit = limit
        self.changed = changed
        self.tag: str | None = None
        """The tag of the file this writer last read or wrote (None: there was none)."""
        self.written: bytes | None = None
        """The bytes of that file."""
        self.known = False
        """The file was read or written once: :attr:`tag` is the one writes are conditional on."""
        self.stopped: str | None = None
        """Why this writer stopped (the file changed under it), or None."""

    @property
    def where(self) -> str:
        return f"{self.store.url}/{self.path}"

    def read(self) -> bytes | None:
        """The file's bytes now (None: there is none); later writes are conditional on its tag."""
        try:
            data, self.tag = read_tagged(self.store, self.path, self.limit)
        except NotFoundError:
            self.tag = self.written = None
            data = None
        self.written, self.known = data, True
        return data

    def check(self) -> None:
        """Raise why this writer stopped, if it did."""
        if self.stopped is not None:
            raise WriterConflictError(self.stopped)

    def write(self, data: bytes, *, what: str) -> None:
        """Replace the file with ``data`` only if it is still the one this writer last read or
        wrote; on a conflict this writer stops, and :class:`WriterConflictError` says why."""
        self.check()
        for attempt in range(2):
            try:
                self.tag = write_if(self.store, self.path, data, self.tag, limit=self.limit)
                break
            except ConflictError as exc:
                if attempt == 0 and self.same_bytes():
                    continue  # rewritten with this writer's own bytes: its tag is taken, and the write tried again
                self.stopped = self.changed(what, exc)
                raise WriterConflictError(self.stopped) from exc
        self.written, self.known = data, True

    def same_bytes(self) -> bool:
        """Whether the file holds the bytes this writer last read or wrote (its tag then
        becomes this writer's)."""
        try:
            data, tag = read_tagged(self.store, self.path, self.limit)
        except NotFoundError:
            return self.written is None and self.tag is None
        if self.written is not None and data == self.written:
            self.tag = tag
            return True
        return False

    def still_ours(self, what: str) -> bool:
        """Whether the file is still the one this writer last read or wrote (one read); if
        not, this writer stops."""
        if self.stopped is not None:
            return False
        try:
            tag: str | None = read_tagged(self.store, self.path, self.limit)[1]
        except NotFoundError:
            tag = None
        if tag != self.tag and not self.same_bytes():
            self.stopped = self.changed(what, None)
            return False
        return True
