"""A store wrapper for benchmarks: adds a fixed latency to every request and counts requests,
bytes and seconds by operation, as a remote bucket would bill and slow them."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Hashable, Iterable, Iterator
from typing import Any, BinaryIO

from deltasync.reader.poll import pointer_tag
from deltasync.format import POINTER_PATH
from deltasync.stores import Store

__all__ = ["CountingStore"]


class CountingStore:
    """``inner`` with ``latency`` seconds added before every request, and counts of them.

    Every call is one request (a whole read, a write, a listing, a metadata read of the pointer
    through ``change_tag``), as on an object store or a Hub bucket. ``requests[op]``,
    ``bytes_read``, ``bytes_written`` and ``seconds[op]`` (wall time, the latency included) are
    kept under a lock, so threads may share one.
    """

    def __init__(self, inner: Store, latency: float = 0.0) -> None:
        self.inner = inner
        self.url = inner.url
        self.latency = latency
        self.requests: Counter[str] = Counter()
        self.seconds: Counter[str] = Counter()
        self.bytes_read = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CountingStore({self.inner!r}, latency={self.latency})"

    @contextlib.contextmanager
    def _request(self, op: str) -> Iterator[None]:
        start = time.perf_counter()
        if self.latency:
            time.sleep(self.latency)
        try:
            yield
        finally:
            with self._lock:
                self.requests[op] += 1
                self.seconds[op] += time.perf_counter() - start

    def _read(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def counts(self) -> dict[str, Any]:
        """A copy of the counts: ``requests`` (total), ``by_op``, ``bytes_read``, ``bytes_written``."""
        with self._lock:
            return {"requests": sum(self.requests.values()), "by_op": dict(self.requests),
                    "bytes_read": self.bytes_read, "bytes_written": self.bytes_written}  # fmt: skip

    # ------------------------------------------------------------------ the store's methods

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        with self._request("read"):
            data = self.inner.read_bytes(path) if limit is None else self.inner.read_bytes(path, limit=limit)  # type: ignore[call-arg]
        self._read(len(data))
        return data

    def read_head(self, path: str, limit: int) -> bytes:
        return self.read_bytes(path, limit=limit)

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[BinaryIO]:
        with self._request("read"):
            opened = self.inner.open_read(path)  # type: ignore[attr-defined]
        with opened as f:
            yield _CountingFile(f, self)  # type: ignore[misc]

    def write_bytes(self, path: str, data: bytes) -> None:
        with self._request("write"):
            self.inner.write_bytes(path, data)
        with self._lock:
            self.bytes_written += len(data)

    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        size = 0

        def counted() -> Iterator[bytes | memoryview]:
            nonlocal size
            for chunk in chunks:
                size += len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                yield chunk

        with self._request("write"):
            self.inner.write_stream(path, counted())  # type: ignore[attr-defined]
        with self._lock:
            self.bytes_written += size

    def exists(self, path: str) -> bool:
        with self._request("exists"):
            return self.inner.exists(path)

    def list(self, prefix: str = "") -> list[str]:
        with self._request("list"):
            return self.inner.list(prefix)

    def delete(self, paths: Iterable[str]) -> None:
        with self._request("delete"):
            self.inner.delete(list(paths))

    def clean_temp(self, older_than: float) -> list[str]:
        clean = getattr(self.inner, "clean_temp", None)
        return [] if clean is None else clean(older_than)

    def change_tag(self, path: str) -> Hashable | None:
        """The inner store's metadata token of the pointer (one request), as
        :func:`deltasync.reader.poll.pointer_tag` reads it."""
        if path != POINTER_PATH:
            return None
        with self._request("stat"):
            return pointer_tag(self.inner)


class _CountingFile:
    """An open file of the inner store whose reads count as the wrapper's bytes read."""

    def __init__(self, f: BinaryIO, owner: CountingStore) -> None:
        self._f, self._owner = f, owner

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self._owner._read(len(data))
        return data

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        self._owner._read(n or 0)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)
