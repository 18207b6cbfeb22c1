"""A bucket on any filesystem fsspec implements: object stores (s3://, gs://, az://), memory://.

Object stores replace an object in a single PUT, which is atomic, so ``pipe_file`` gives the
per-file atomicity the protocol needs. Backends without atomic single writes (ftp, sftp,
smb) do not; use them only for experiments, or mount them and use a ``LocalStore``.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import Any, BinaryIO

import fsspec
from fsspec.core import url_to_fs

from ..errors import ConfigError, NotFoundError, StoreError
from ._base import LimitedReads, check_path, check_prefix, reading

__all__ = ["FsspecStore", "check_protocol"]

_ASK_SIZE_FROM = 64 << 20


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
