"""A bucket on any filesystem fsspec implements: object stores (s3://, gs://, az://), memory://.

Object stores replace an object in a single PUT, which is atomic, so ``pipe_file`` gives the
per-file atomicity the protocol needs. Backends without atomic single writes (ftp, sftp,
smb) do not; use them only for experiments, or mount them and use a ``LocalStore``.
"""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

import fsspec
from fsspec.core import url_to_fs

from ..errors import ConfigError, NotFoundError, StoreError
from ._base import LimitedReads, check_path, check_prefix, reading
from ._conditional import conflict, content_tag

__all__ = ["FsspecStore", "check_protocol"]

_ASK_SIZE_FROM = 64 << 20
_MEMORY_LOCK = threading.Lock()
"""Held by every conditional write of a ``memory://`` store (they all live in this process)."""
_S3_PROTOCOLS = frozenset({"s3", "s3a"})


def check_protocol(scheme: str, url: str, *, supported: str) -> None:
    """Raise ``ConfigError`` unless fsspec can open ``scheme``, saying what would fix it."""
    try:
        fsspec.get_filesystem_class(scheme)
    except ValueError as e:
        raise ConfigError(
            f"bucket URL {url!r} has the unknown scheme {scheme!r}; supported: {supported}. "
            f"fsspec knows: {', '.join(fsspec.available_protocols())}"
        ) from e
    except ImportError as e:
        raise ConfigError(
            f"bucket URL {url!r} needs an fsspec backend that is not installed: {e}"
        ) from e


class FsspecStore(LimitedReads):
    """Files under the root that ``url`` names, through ``fsspec.core.url_to_fs``.

    ``storage_options`` go to the filesystem's constructor (credentials, endpoints, ...).
    """

    def __init__(self, url: str, **storage_options: Any) -> None:
        self.url = url if url.endswith("://") else url.rstrip("/")
        try:
            self.fs, root = url_to_fs(url, **storage_options)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"cannot open bucket URL {url!r} with fsspec: {e}") from e
        self._root = root.rstrip("/")

    def __repr__(self) -> str:
        return f"FsspecStore({self.url!r})"

    def _full(self, path: str) -> str:
        check_path(path)
        return f"{self._root}/{path}" if self._root else path

    def _relative(self, full: str) -> str | None:
        """The bucket path of a path ``fs.find`` returned, or None if it is outside the root."""
        if not self._root:
            # A bare "memory://" root: backends spell the root "" or "/" as they please.
            return full.lstrip("/")
        if full.startswith(self._root + "/"):
            return full[len(self._root) + 1 :]
        return None

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        full = self._full(path)
        try:
            if limit is None:
                return self.fs.cat_file(full)
            if limit >= _ASK_SIZE_FROM:
                # Some backends allocate the whole range up front: never more than the file holds.
                limit = min(limit, self.fs.size(full))
            return self.fs.cat_file(full, start=0, end=limit + 1)
        except FileNotFoundError as e:
            raise NotFoundError(f"{path!r} is not in bucket {self.url}") from e
        except IsADirectoryError as e:
            raise NotFoundError(f"{path!r} in bucket {self.url} is a directory, not a file") from e
        except Exception as e:
            # Backends raise their own types (botocore, aiohttp, ...): one type for callers.
            raise StoreError(f"cannot read {path!r} from bucket {self.url}: {e!r}") from e

    def write_bytes(self, path: str, data: bytes) -> None:
        full = self._full(path)
        try:
            try:
                self.fs.pipe_file(full, bytes(data))
            except FileNotFoundError:
                # Directory-based backends (sftp, smb, file) need the parent first. Object
                # stores never get here, so they pay no extra request per write.
                self.fs.makedirs(full.rpartition("/")[0], exist_ok=True)
                self.fs.pipe_file(full, bytes(data))
        except Exception as e:
            raise StoreError(
                f"cannot write {path!r} to bucket {self.url}: {e!r}; check the URL and that "
                "your credentials may write there"
            ) from e

    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        # Spooled to a local file, then one put: an object store replaces the object in one
        # PUT (or one completed multipart upload), so a failed iteration uploads nothing.
        full = self._full(path)
        with tempfile.NamedTemporaryFile(prefix="deltasync-", suffix=".tmp") as spool:
            for chunk in chunks:
                spool.write(chunk)
            spool.flush()
            try:
                try:
                    self.fs.put_file(spool.name, full)
                except FileNotFoundError:
                    self.fs.makedirs(full.rpartition("/")[0], exist_ok=True)
                    self.fs.put_file(spool.name, full)
            except Exception as e:
                raise StoreError(
                    f"cannot write {path!r} to bucket {self.url}: {e!r}; check the URL and that "
                    "your credentials may write there"
                ) from e

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        full = self._full(path)
        try:
            f = self.fs.open(full, "rb")
        except FileNotFoundError as e:
            raise NotFoundError(f"{path!r} is not in bucket {self.url}") from e
        except IsADirectoryError as e:
            raise NotFoundError(f"{path!r} in bucket {self.url} is a directory, not a file") from e
        except Exception as e:
            raise StoreError(f"cannot read {path!r} from bucket {self.url}: {e!r}") from e
        # Backends raise their own types (botocore, aiohttp, ...) mid-read too.
        return reading(f, path, self.url, (Exception,))

    # Conditional writes (:class:`~deltasync.stores.ConditionalStore`): S3's conditional PUT,
    # or memory:// under one lock of this process. Other backends have none (None below).

    def _kind(self) -> str | None:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        if _S3_PROTOCOLS & set(protocols):
            return "s3"
        return "memory" if "memory" in protocols else None

    def conditional_writes(self) -> str | None:
        kind = self._kind()
        if kind == "s3":
            return "S3 conditional PUT (If-Match: <ETag>, If-None-Match: *)"
        if kind == "memory":
            return "a lock of this process (a memory:// bucket lives in one process)"
        return None

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str]:
        kind = self._kind()
        if kind == "memory":
            with _MEMORY_LOCK:
                data = self.read_bytes(path)
            return data[: limit + 1], content_tag(data)
        if kind != "s3":
            data = self.read_bytes(path, limit=limit)
            return data, content_tag(data)
        got, tag = self._s3_get(path, limit, None)
        assert got is not None  # an unconditional GET has a body
        return got, tag

    def conditional_reads(self) -> bool:
        """Whether :meth:`read_if_changed` is one request here (S3's conditional GET)."""
        return self._kind() == "s3"

    def read_if_changed(self, path: str, tag: str | None, limit: int) -> tuple[bytes | None, str]:
        """One GET of at most the file's first ``limit + 1`` bytes, sent with ``If-None-Match:
        <tag>``: ``(None, tag)`` when the file is still the one ``tag`` names (S3 answers 304
        Not Modified, no body), else its bytes and new tag. On a store without conditional
        reads, a plain read. ``NotFoundError`` if the file is missing."""
        if not self.conditional_reads():
            return self.read_tagged(path, limit)
        return self._s3_get(path, limit, tag)

    def _s3_get(self, path: str, limit: int, unless: str | None) -> tuple[bytes | None, str]:
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(self._full(path))
        condition = {} if unless is None else {"IfNoneMatch": unless}

        async def get() -> tuple[bytes, str]:
            # One GET: the bytes and the ETag of the same object.
            response = await self.fs._call_s3(
                "get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{limit}", **condition
            )
            body = response["Body"]
            try:
                return await body.read(), str(response["ETag"])
            finally:
                body.close()

        # botocore retries a request that fails; a body cut short after its headers is ours to retry.
        attempts = max(1, int(getattr(self.fs, "retries", 5)))
        for attempt in range(attempts):
            try:
                return sync(self.fs.loop, get)
            except FileNotFoundError as e:
                raise NotFoundError(f"{path!r} is not in bucket {self.url}") from e
            except Exception as e:
                if unless is not None and _status(e) == 304:
                    return None, unless
                if attempt + 1 < attempts and not isinstance(e, PermissionError):
                    time.sleep(min(2.0, 0.1 * 2**attempt))
                    continue
                raise StoreError(f"cannot read {path!r} from bucket {self.url}: {e!r}") from e
        raise AssertionError("unreachable")

    def write_if(self, path: str, data: bytes, tag: str | None) -> str:
        kind = self._kind()
        if kind is None:
            raise ConfigError(f"bucket {self.url} cannot write conditionally (fsspec {self.fs.protocol!r})")
        if kind == "memory":
            with _MEMORY_LOCK:
                try:
                    current: str | None = content_tag(self.read_bytes(path))
                except NotFoundError:
                    current = None
                if current != tag:
                    raise conflict(self, path, tag, current)
                self.write_bytes(path, data)
            return content_tag(data)
        full = self._full(path)
        condition = {"IfNoneMatch": "*"} if tag is None else {"IfMatch": tag}
        try:
            response = self.fs.pipe_file(full, bytes(data), **condition)
        except Exception as e:
            if tag is not None and isinstance(e, FileNotFoundError):
                # If-Match on an object that is gone: S3 answers 404.
                raise conflict(self, path, tag, None) from e
            if _precondition_failed(e):
                # A retried PUT whose first attempt landed is refused too: then the object
                # holds exactly these bytes, and the write was this one.
                try:
                    now, now_tag = self.read_tagged(path, len(data))
                except NotFoundError:
                    now, now_tag = b"", None
                if now == data and now_tag is not None:
                    return now_tag
                raise conflict(self, path, tag, now_tag) from e
            raise StoreError(
                f"cannot write {path!r} to bucket {self.url}: {e!r}; check the URL and that "
                "your credentials may write there"
            ) from e
        etag = response.get("ETag") if isinstance(response, dict) else None
        if not etag:
            return self.read_tagged(path, 0)[1]
        return str(etag)

    def exists(self, path: str) -> bool:
        full = self._full(path)
        try:
            return bool(self.fs.isfile(full))
        except Exception as e:
            raise StoreError(f"cannot check {path!r} in bucket {self.url}: {e!r}") from e

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        # Ask the backend only for the deepest directory the prefix fully names.
        start_dir = prefix.rpartition("/")[0]
        start = self._root if not start_dir else self._full(start_dir)
        try:
            found = self.fs.find(start, withdirs=False)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise StoreError(f"cannot list {prefix!r} in bucket {self.url}: {e!r}") from e
        paths = (self._relative(full) for full in found)
        return sorted(p for p in paths if p is not None and p.startswith(prefix))

    def delete(self, paths: Iterable[str]) -> None:
        # Validate all first, so a bad path in the batch deletes nothing. One call per file:
        # fs.rm on a list stops at the first missing file on several backends.
        targets = [(path, self._full(path)) for path in paths]
        for path, full in targets:
            try:
                self.fs.rm_file(full)
            except FileNotFoundError:
                pass
            except Exception as e:
                raise StoreError(f"cannot delete {path!r} from bucket {self.url}: {e!r}") from e


def _responses(error: BaseException) -> Iterator[dict[str, Any]]:
    """The botocore responses along ``error``'s chain (s3fs wraps botocore's errors)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            yield response
        current = current.__cause__ or current.__context__


def _status(error: BaseException) -> int | None:
    """The HTTP status S3 answered with, where ``error`` carries one."""
    for response in _responses(error):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if isinstance(status, int):
            return status
    return None


def _precondition_failed(error: BaseException) -> bool:
    """Whether S3 refused a conditional request (412 Precondition Failed, or 409 for a
    conditional write racing another), through s3fs's translation of botocore's error."""
    for response in _responses(error):
        code = str(response.get("Error", {}).get("Code", ""))
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("PreconditionFailed", "ConditionalRequestConflict", "412") or status == 412:
            return True
    return isinstance(error, FileExistsError)
