"""The storage protocol every bucket backend implements, and the path rules they share.

The trainer and the rollout servers never talk weight bytes to each other: they meet in a
bucket. Everything the publisher and receiver need from a bucket is a handful of whole-file
operations on relative paths, so the protocol is exactly that and nothing more. Keeping it
this small is what lets one conformance suite prove every backend equivalent.
"""

from __future__ import annotations

import contextlib
import hashlib
from concurrent.futures import Future, ThreadPoolExecutor
import io
import os
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import BinaryIO, Protocol, runtime_checkable

from ..errors import ConfigError, DeltaSyncError, StoreError

__all__ = [
    "BoundedReadStore",
    "LimitedReads",
    "Store",
    "StreamingStore",
    "TempCleaningStore",
    "check_path",
    "check_prefix",
    "open_read",
    "read_buffer",
    "read_into_buffer",
    "read_limited",
    "reading",
    "write_pieces",
    "write_stream",
]

_EXAMPLE = "'anchors/00000000.safetensors'"


@runtime_checkable
class Store(Protocol):
    """Whole-file operations on relative POSIX paths inside one bucket.

    Paths look like ``"anchors/00000000.safetensors"`` or ``"latest.json"``: no leading
    ``/``, no ``..`` or ``.`` segments, no backslashes, no empty segments. Each write is
    atomic per file (a reader sees the old bytes or the new, never a mix), which is what the
    protocol's "data first, pointer last" commit relies on. Nothing is atomic across files.
    """

    url: str
    """The canonical URL of the bucket, as ``open_store`` would accept it."""

    def read_bytes(self, path: str) -> bytes:
        """Return the whole file; ``NotFoundError`` if it is missing, ``StoreError`` otherwise.

        (The built-in stores also take ``limit``: see :class:`BoundedReadStore`.)
        """
        ...

    def write_bytes(self, path: str, data: bytes) -> None:
        """Create or replace the file atomically."""
        ...

    def exists(self, path: str) -> bool:
        """Whether a file (not a directory) exists at ``path``."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """Sorted relative paths of all files, recursively, whose path starts with ``prefix``.

        ``prefix`` is a plain string prefix: ``"anchors/"`` lists a directory,
        ``"deltas/0000001"`` lists the files whose names start that way.
        """
        ...

    def delete(self, paths: Iterable[str]) -> None:
        """Delete the files; a file that is already gone is not an error."""
        ...


# Optional capabilities. A store may add any of these to the five methods of :class:`Store`;
# deltasync checks for each with ``isinstance`` (they are runtime-checkable protocols, matched
# by method name) and does without where a store lacks one, as the helpers below say. A
# custom store with the five methods alone works.


@runtime_checkable
class BoundedReadStore(Protocol):
    """Optional capability: read a file's first bytes only, so that an oversized file in a
    hostile bucket (a pointer, a part) is never held whole. Without it a file is read whole,
    then refused for its size (see :func:`read_limited`)."""

    def read_head(self, path: str, limit: int) -> bytes:
        """At most the file's first ``limit + 1`` bytes: a longer file returns its first
        ``limit + 1`` bytes, so the caller sees that it is too long without holding all of it.
        Errors as :meth:`Store.read_bytes`."""
        ...


@runtime_checkable
class TempCleaningStore(Protocol):
    """Optional capability: remove what writes killed midway left behind (the publisher's
    housekeeping; without it there is nothing to clean)."""

    def clean_temp(self, older_than: float) -> list[str]:
        """Delete the temporary files of writes last modified more than ``older_than`` seconds
        ago; return the bucket paths removed."""
        ...


@runtime_checkable
class StreamingStore(Protocol):
    """Optional capabilities a :class:`Store` may add, so that big files (anchors) never need
    to be whole in memory. A store without them works through :func:`write_stream` and
    :func:`open_read`, which then hold one whole file."""

    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        """Create or replace the file atomically with the concatenated chunks, holding at most
        one chunk at a time. If the iteration raises, the file is left as it was."""
        ...

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        """The file, open for reading (``read`` and ``readinto``), so that a reader can take it
        in pieces of its choosing, straight into its own buffers. ``NotFoundError`` if it is
        missing, ``StoreError`` if opening or a read fails."""
        ...


def read_into_buffer(f: BinaryIO, size: int) -> bytearray:
    """At most ``size`` bytes of an open binary file, read into one new buffer (no second copy)."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = f.readinto(view[got:])  # type: ignore[attr-defined]
        if not n:
            break
        got += n
    del view
    del buffer[got:]
    return buffer


_PARALLEL_HASH = 1 << 20
"""Chunks of at least this many bytes are hashed in another thread while the store writes them."""


def write_stream(store: Store, path: str, chunks: Iterable[bytes | memoryview]) -> tuple[int, str]:
    """Write the chunks as one file (streamed where the store can); return its size and SHA-256.

    A large chunk is hashed in a helper thread while the store writes it (both release the GIL),
    and the next chunk is asked for only once both are done with it."""
    digest, size = hashlib.sha256(), 0

    def counted() -> Iterable[bytes | memoryview]:
        nonlocal size
        pending: Future[None] | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-sha256") as hashing:
            for chunk in chunks:
                n = len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                size += n
                if n >= _PARALLEL_HASH:
                    pending = hashing.submit(digest.update, chunk)
                else:
                    digest.update(chunk)
                yield chunk
                if pending is not None:
                    pending.result()
                    pending = None

    if isinstance(store, StreamingStore):
        store.write_stream(path, counted())
    else:
        store.write_bytes(path, b"".join(counted()))
    return size, digest.hexdigest()


def open_read(store: Store, path: str, limit: int) -> AbstractContextManager[BinaryIO]:
    """:meth:`StreamingStore.open_read` where the store has it; else the file's first
    ``limit + 1`` bytes at most, read whole (:func:`read_limited`) and opened in memory."""
    if isinstance(store, StreamingStore):
        return store.open_read(path)
    return contextlib.nullcontext(io.BytesIO(read_limited(store, path, limit)))


def write_pieces(store: Store, path: str, pieces: Sequence[bytes | memoryview]) -> tuple[int, str]:
    """Write a file held in memory as ``pieces`` (a delta: its header and its compressed
    streams); return its size and SHA-256.

    A store that writes a stream where it lies (``streams_in_place``: a local folder) takes the
    pieces one after another, each large one hashed while the store writes it
    (:func:`write_stream`): no copy of the file is made. Any other store gets them joined, in
    one ``write_bytes`` (a remote store would first spool a stream to a local file), hashed
    meanwhile in a helper thread."""
    if getattr(store, "streams_in_place", False):
        return write_stream(store, path, pieces)
    data = b"".join(pieces)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="deltasync-sha256") as hashing:
        digest = hashing.submit(lambda: hashlib.sha256(data).hexdigest())
        store.write_bytes(path, data)
        return len(data), digest.result()


def read_buffer(store: Store, path: str, limit: int) -> bytearray:
    """The file's first ``limit + 1`` bytes at most, in one new writable buffer (so that
    tensors can be views of it), never allocating more than the file holds where its size is
    known."""
    with open_read(store, path, limit) as f:
        return read_into_buffer(f, min(limit + 1, _size(f, limit + 1)))


def _size(f: BinaryIO, default: int) -> int:
    """The size of an open file, where it can tell (a local file, an fsspec file)."""
    try:
        return os.fstat(f.fileno()).st_size
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        size = getattr(f, "size", None)
        if isinstance(size, int):
            return size
        if isinstance(f, io.BytesIO):
            return f.getbuffer().nbytes
        return default


@contextlib.contextmanager
def reading(
    f: BinaryIO, path: str, url: str, errors: tuple[type[BaseException], ...] = (OSError,)
) -> Iterator[BinaryIO]:
    """Yield an open file of a store, closing it after, and turning a failed read (one of
    ``errors``) into a :class:`StoreError` (deltasync's own errors pass through)."""
    with f:
        try:
            yield f
        except errors as e:
            if isinstance(e, DeltaSyncError):
                raise
            raise StoreError(f"cannot read {path!r} from bucket {url}: {e!r}") from e


def read_limited(store: Store, path: str, limit: int) -> bytes:
    """At most the first ``limit + 1`` bytes of the file where the store can read only those
    (:class:`BoundedReadStore`); else the whole file, for the caller to refuse if too long."""
    if isinstance(store, BoundedReadStore):
        return store.read_head(path, limit)
    return store.read_bytes(path)


class LimitedReads:
    """Base class of stores whose ``read_bytes`` takes ``limit`` (the built-in ones): it gives
    them :meth:`BoundedReadStore.read_head`."""

    def read_head(self, path: str, limit: int) -> bytes:
        return self.read_bytes(path, limit=limit)  # type: ignore[attr-defined]


def check_path(path: str) -> str:
    """Return ``path`` if it is a valid file path inside a bucket, else raise ``ConfigError``.

    Backends join these paths onto a root directory or key prefix; a path that could climb
    out of the root, or that different backends would spell differently, must never reach
    them.
    """
    if not isinstance(path, str):
        raise ConfigError(
            f"bucket path {path!r} must be a str, not {type(path).__name__}; use a relative POSIX "
            f"path such as {_EXAMPLE}"
        )
    problem = _path_problem(path, allow_partial_last=False)
    if problem:
        raise ConfigError(
            f"invalid bucket path {path!r}: {problem}; use a relative POSIX path such as {_EXAMPLE}"
        )
    return path


def check_prefix(prefix: str) -> str:
    """Return ``prefix`` if it is a valid listing prefix, else raise ``ConfigError``.

    A prefix may be empty, end with ``/``, or end part-way through a name; its complete
    segments follow the same rules as a path.
    """
    if not isinstance(prefix, str):
        raise ConfigError(f"list prefix {prefix!r} must be a str, not {type(prefix).__name__}")
    if prefix == "":
        return prefix
    problem = _path_problem(prefix, allow_partial_last=True)
    if problem:
        raise ConfigError(
            f"invalid list prefix {prefix!r}: {problem}; use a relative POSIX prefix such as "
            "'anchors/' or '' for everything"
        )
    return prefix


def _path_problem(path: str, *, allow_partial_last: bool) -> str | None:
    """Say what is wrong with ``path``, or return None if nothing is."""
    if path == "":
        return "it is empty"
    if "\\" in path:
        return "backslashes are not allowed, separate segments with '/'"
    if "\x00" in path:
        return "NUL characters are not allowed"
    if path.startswith("/"):
        return "absolute paths are not allowed, paths are relative to the bucket root"
    segments = path.split("/")
    last = len(segments) - 1
    for i, segment in enumerate(segments):
        if segment in (".", ".."):
            return f"{segment!r} segments are not allowed"
        if segment == "" and not (allow_partial_last and i == last):
            return "empty segments ('//' or a trailing '/') are not allowed"
    return None
