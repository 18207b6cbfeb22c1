"""A bucket on the Hugging Face Hub (``hf://buckets/<namespace>/<name>[/<prefix>]``).

Hub buckets are mutable, non-versioned storage: files are uploaded to content-addressed
storage first and a path then flips to the new content in one step, which is the per-file
atomicity the protocol needs. Git repos (models, datasets) would turn every publish into a
commit and never free old versions, so they are not supported.

Only four ``HfApi`` methods are used (``batch_bucket_files``, ``download_bucket_files``,
``list_bucket_tree``, ``get_bucket_paths_info``); tests substitute a fake with the same
signatures through ``api=``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from huggingface_hub.errors import BucketBatchError, BucketNotFoundError, EntryNotFoundError

from ..errors import ConfigError, NotFoundError, StoreError
from ._base import LimitedReads, check_path, check_prefix, reading

if TYPE_CHECKING:
    from huggingface_hub import HfApi

__all__ = ["HfBucketStore"]


class HfBucketStore(LimitedReads):
    """Files under ``prefix`` in the Hub bucket ``bucket_id`` (``"<namespace>/<name>"``).

    ``token`` is used for every call (None: the logged-in token or ``HF_TOKEN``); ``api``
    replaces the ``HfApi`` client, for tests or a custom endpoint.
    """

    def __init__(
        self,
        bucket_id: str,
        prefix: str = "",
        *,
        token: str | bool | None = None,
        api: HfApi | None = None,
    ) -> None:
        parts = bucket_id.split("/") if isinstance(bucket_id, str) else []
        if len(parts) != 2 or not all(parts) or "@" in bucket_id:
            raise ConfigError(
                f"bucket id {bucket_id!r} must be '<namespace>/<name>', e.g. 'me/policy-sync'"
            )
        prefix = prefix.strip("/")
        if prefix:
            try:
                check_path(prefix)
            except ConfigError as e:
                raise ConfigError(f"invalid prefix in bucket {bucket_id!r}: {e}") from None
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(token=token)
        self.api = api
        self.bucket_id = bucket_id
        self.prefix = prefix
        self._token = token
        self.url = f"hf://buckets/{bucket_id}" + (f"/{prefix}" if prefix else "")

    def __repr__(self) -> str:
        return f"HfBucketStore({self.bucket_id!r}, {self.prefix!r})"

    def _remote(self, path: str) -> str:
        check_path(path)
        return f"{self.prefix}/{path}" if self.prefix else path

    def _error(self, action: str, what: str, error: Exception) -> StoreError:
        """Turn a huggingface_hub failure into a StoreError that says how to fix it."""
        if isinstance(error, BucketNotFoundError):
            return StoreError(
                f"cannot {action} {what}: bucket {self.bucket_id!r} does not exist or your token "
                f"cannot access it. Create it (`hf buckets create {self.bucket_id} --private`), "
                "or log in / set HF_TOKEN to a token with access to it"
            )
        return StoreError(f"cannot {action} {what} in bucket {self.url}: {error!r}")

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        with self._download(path) as f:
            if limit is None:
                return f.read()
            # read(n) allocates n bytes up front: never more than the file holds.
            return f.read(min(limit, os.fstat(f.fileno()).st_size) + 1)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        return self._download(path)

    @contextlib.contextmanager
    def _download(self, path: str) -> Iterator[BinaryIO]:
        """The file, downloaded to disk (memory holds only what the caller reads of it)."""
        remote = self._remote(path)
        # Downloads write the destination in place, so download into a private directory and
        # read from there: no other reader can see a half-written file.
        with tempfile.TemporaryDirectory(prefix="deltasync-hf-") as tmp:
            local = Path(tmp) / "download"
            try:
                self.api.download_bucket_files(
                    self.bucket_id,
                    [(remote, str(local))],
                    raise_on_missing_files=True,
                    token=self._token,
                )
            except EntryNotFoundError as e:
                raise NotFoundError(f"{path!r} is not in bucket {self.url}") from e
            except Exception as e:
                raise self._error("read", repr(path), e) from e
            try:
                f = open(local, "rb")  # noqa: SIM115  (returned to the caller, who closes it)
            except FileNotFoundError as e:
                raise StoreError(
                    f"cannot read {path!r} from bucket {self.url}: the download reported "
                    "success but wrote no file"
                ) from e
            with reading(f, path, self.url):
                yield f

    def write_bytes(self, path: str, data: bytes) -> None:
        remote = self._remote(path)
        try:
            # batch_bucket_files takes bytes, not other buffers (it checks isinstance(bytes)).
            self.api.batch_bucket_files(
                self.bucket_id, add=[(bytes(data), remote)], token=self._token
            )
        except Exception as e:
            raise self._error("write", repr(path), e) from e

    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        remote = self._remote(path)
        # Spooled to a local file, then uploaded from its path: a single path flips to the new
        # content in one step, and a failed iteration uploads nothing.
        with tempfile.TemporaryDirectory(prefix="deltasync-hf-") as tmp:
            local = Path(tmp) / "upload"
            with open(local, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
            try:
                self.api.batch_bucket_files(self.bucket_id, add=[(str(local), remote)], token=self._token)
            except Exception as e:
                raise self._error("write", repr(path), e) from e

    def exists(self, path: str) -> bool:
        remote = self._remote(path)
        try:
            infos = self.api.get_bucket_paths_info(self.bucket_id, [remote], token=self._token)
            found = [info.path for info in infos]
        except Exception as e:
            raise self._error("check", repr(path), e) from e
        return remote in found

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        # The server matches prefixes lexically, but pass only the deepest directory the
        # prefix fully names and filter here, so the result does not hinge on that detail.
        server_prefix = full.rpartition("/")[0] or None
        root = f"{self.prefix}/" if self.prefix else ""
        try:
            # list_bucket_tree is a generator: errors surface while iterating, so consume it here.
            entries = list(
                self.api.list_bucket_tree(
                    self.bucket_id, server_prefix, recursive=True, token=self._token
                )
            )
        except EntryNotFoundError:
            return []
        except Exception as e:
            raise self._error("list", repr(prefix), e) from e
        found = [
            entry.path[len(root) :]
            for entry in entries
            if getattr(entry, "type", None) == "file"
            and entry.path.startswith(root)
            and entry.path.startswith(full)
        ]
        return sorted(found)

    def delete(self, paths: Iterable[str]) -> None:
        remotes = [self._remote(path) for path in paths]
        if not remotes:
            return
        try:
            self.api.batch_bucket_files(self.bucket_id, delete=remotes, token=self._token)
        except BucketBatchError as e:
            # Deleting a file that is already gone is fine; anything else is a real failure.
            failed = [failure.get("path") for failure in e.failures]
            if any(p is None for p in failed):
                raise self._error("delete", f"{len(remotes)} file(s)", e) from e
            try:
                still_there = [
                    info.path
                    for info in self.api.get_bucket_paths_info(
                        self.bucket_id, failed, token=self._token
                    )
                ]
            except Exception as e2:  # noqa: BLE001  (reported with the first error)
                raise self._error("delete", f"{len(remotes)} file(s)", e2) from e
            if still_there:
                raise StoreError(f"cannot delete {still_there} from bucket {self.url}: {e}") from e
        except Exception as e:
            raise self._error("delete", f"{len(remotes)} file(s)", e) from e
