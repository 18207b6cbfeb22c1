"""An in-memory stand-in for the four ``HfApi`` bucket methods that ``HfBucketStore`` uses.

No offline Hub server exists for buckets, so the store's tests run against this fake. It
copies the real methods' signatures (``test_fake_matches_real_signatures`` keeps them in
step), returns the real ``BucketFile`` / ``BucketFolder`` objects, and raises the real
exception types, built the way huggingface_hub builds them:

- a missing file in ``download_bucket_files(..., raise_on_missing_files=True)``:
  ``EntryNotFoundError``; without the flag, a warning and no file;
- an unknown bucket: ``BucketNotFoundError``, made by ``hf_raise_for_status`` itself from a
  404 response with ``X-Error-Code: RepoNotFound``, as the Hub answers;
- a failed batch operation: ``BucketBatchError`` with ``failures``.

Where the real server's behaviour is not documented, the fake takes the harsher reading so
the store must cope with both: deleting a missing file is reported as a failed operation,
the tree listing matches prefixes lexically, includes folder entries when recursive, and
comes back unsorted.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

import httpx2
from huggingface_hub import BucketFile, BucketFolder
from huggingface_hub.errors import BucketBatchError, EntryNotFoundError
from huggingface_hub.utils import hf_raise_for_status

# The bucket every fake Hub holds unless told otherwise.
BUCKET_ID = "me/deltasync-test"

# The methods HfBucketStore calls; the signature test checks exactly these.
USED_METHODS = (
    "batch_bucket_files",
    "download_bucket_files",
    "list_bucket_tree",
    "get_bucket_paths_info",
)


class FakeBucketApi:
    """Buckets held in dicts: ``files[bucket_id][path]`` is the raw API record of a file,
    and ``blobs[xet_hash]`` its content (content-addressed, as on the Hub)."""

    endpoint = "https://huggingface.co"

    def __init__(self, buckets: Iterable[str] = (BUCKET_ID,)) -> None:
        self.files: dict[str, dict[str, dict[str, object]]] = {b: {} for b in buckets}
        self.blobs: dict[str, bytes] = {}

    # -- helpers ---------------------------------------------------------------------------

    def _bucket(self, bucket_id: str, method: str, route: str) -> dict[str, dict[str, object]]:
        if bucket_id not in self.files:
            request = httpx2.Request(method, f"{self.endpoint}/api/buckets/{bucket_id}/{route}")
            response = httpx2.Response(
                404,
                headers={"X-Error-Code": "RepoNotFound", "X-Error-Message": "Bucket not found"},
                request=request,
            )
            hf_raise_for_status(response)  # raises BucketNotFoundError, as for the real API
        return self.files[bucket_id]

    def _put(self, bucket: dict[str, dict[str, object]], path: str, data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        # The Hub's timestamp format (milliseconds, "Z"); BucketFile refuses others.
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        bucket[path] = {
            "type": "file",
            "path": path,
            "size": len(data),
            "xetHash": digest,
            "mtime": now,
            "uploadedAt": now,
        }

    # -- the HfApi subset (same signatures as huggingface_hub.HfApi) --------------------------

    def batch_bucket_files(
        self,
        bucket_id: str,
        *,
        add: list[tuple[str | Path | bytes, str]] | None = None,
        copy: list[tuple[str, str, str, str]] | None = None,
        delete: list[str] | None = None,
        token: str | bool | None = None,
    ):
        if copy:
            raise NotImplementedError("FakeBucketApi does not implement server-side copies")
        bucket = self._bucket(bucket_id, "POST", "batch")
        sent = len(add or []) + len(delete or [])
        for source, destination in add or []:
            data = source if isinstance(source, bytes) else Path(source).read_bytes()
            self._put(bucket, destination, data)
        failures = []
        for path in delete or []:
            if bucket.pop(path, None) is None:
                failures.append({"path": path, "error": "File not found"})
        if failures:
            request = httpx2.Request("POST", f"{self.endpoint}/api/buckets/{bucket_id}/batch")
            status = 422 if len(failures) == sent else 200
            error = BucketBatchError(
                f"Failed to apply {len(failures)} out of {sent} operation(s) on bucket "
                f"'{bucket_id}':\n" + "\n".join(f"  - {f['path']}: {f['error']}" for f in failures),
                response=httpx2.Response(status, json={"failed": failures}, request=request),
            )
            error.failures = failures
            raise error

    def download_bucket_files(
        self,
        bucket_id: str,
        files: list[tuple[str | BucketFile, str | Path]],
        *,
        raise_on_missing_files: bool = False,
        token: str | bool | None = None,
    ) -> None:
        if len(files) == 0:
            return
        bucket = self._bucket(bucket_id, "POST", "paths-info")
        str_paths = [path for path, _ in files if not isinstance(path, BucketFile)]
        missing = [path for path in str_paths if path not in bucket]
        if missing:
            if raise_on_missing_files:
                listed = ", ".join(missing)
                raise EntryNotFoundError(
                    f"{len(missing)} file(s) not found in bucket '{bucket_id}': {listed}"
                )
            for path in missing:
                warnings.warn(
                    f"File '{path}' not found in bucket '{bucket_id}'. Skipping.", stacklevel=2
                )
        for remote, local in files:
            if isinstance(remote, BucketFile):
                xet_hash = remote.xet_hash
            elif remote in bucket:
                xet_hash = str(bucket[remote]["xetHash"])
            else:
                continue
            dest = Path(local).absolute()
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(self.blobs[xet_hash])  # in place, as the real download does

    def list_bucket_tree(
        self,
        bucket_id: str,
        prefix: str | None = None,
        *,
        recursive: bool | None = None,
        token: str | bool | None = None,
    ) -> Iterable[BucketFile | BucketFolder]:
        # A generator, like the real method: errors surface on iteration, not on the call.
        bucket = self._bucket(bucket_id, "GET", "tree")
        prefix = prefix or ""
        entries: dict[str, BucketFile | BucketFolder] = {}
        for path, record in bucket.items():
            if not path.startswith(prefix):
                continue
            parts = path.split("/")
            folders = ["/".join(parts[:i]) for i in range(1, len(parts))]
            if recursive:
                entries[path] = BucketFile(**record)
                for folder in folders:
                    if folder.startswith(prefix):
                        entries[folder] = BucketFolder(type="directory", path=folder)
            else:
                depth = prefix.count("/")
                if len(parts) == depth + 1:
                    entries[path] = BucketFile(**record)
                else:
                    folder = folders[depth]
                    entries[folder] = BucketFolder(type="directory", path=folder)
        for path in sorted(entries, reverse=True):
            yield entries[path]

    def get_bucket_paths_info(
        self,
        bucket_id: str,
        paths: Iterable[str],
        *,
        token: str | bool | None = None,
    ) -> Iterable[BucketFile]:
        bucket = self._bucket(bucket_id, "POST", "paths-info")
        for path in paths:
            if path in bucket:
                yield BucketFile(**bucket[path])
