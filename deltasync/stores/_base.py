"""The storage protocol every bucket backend implements, and the URL dispatcher.

The trainer and the rollout servers never talk weight bytes to each other: they meet in a
bucket. Everything the publisher and receiver need from a bucket is a handful of whole-file
operations on relative paths, so the protocol is exactly that and nothing more. Keeping it
this small is what lets one conformance suite prove every backend equivalent.
"""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Iterable
from typing import Protocol, runtime_checkable
from urllib.parse import unquote, urlsplit

from .._errors import ConfigError

__all__ = ["Store", "check_path", "check_prefix", "open_store", "read_limited"]

# A URL is recognised by an explicit "scheme://": a bare "C:\dir" or "dir:x" stays a path.
_URL_RE = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://")
_EXAMPLE = "'anchors/00000000.safetensors'"
_SUPPORTED = (
    "a local directory path or file:///abs/dir, hf://buckets/<namespace>/<name>[/<prefix>], "
    "or any URL whose scheme fsspec implements (memory://, s3://, gs://, ...)"
)


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

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """Return the whole file; ``NotFoundError`` if it is missing, ``StoreError`` otherwise.

        With ``limit``, read at most ``limit + 1`` bytes: a longer file returns its first
        ``limit + 1`` bytes, so the caller sees that it is too long without holding all of it.
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


def read_limited(store: Store, path: str, limit: int) -> bytes:
    """``store.read_bytes(path, limit=limit)``, for stores that predate ``limit`` too.

    A custom store whose ``read_bytes`` takes no ``limit`` is read whole (its own business).
    """
    try:
        takes_limit = "limit" in inspect.signature(store.read_bytes).parameters
    except (TypeError, ValueError):
        takes_limit = False
    if takes_limit:
        return store.read_bytes(path, limit=limit)
    return store.read_bytes(path)


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


def open_store(bucket: str | os.PathLike[str] | Store) -> Store:
    """Open the bucket that ``bucket`` names.

    - a ``Store`` is returned as is (so every API taking a bucket also takes a custom store);
    - a plain path or ``file://`` URL opens a ``LocalStore`` (its directory appears on first write);
    - ``hf://buckets/<namespace>/<name>[/<prefix>]`` opens an ``HfBucketStore``;
    - any other ``scheme://`` URL that fsspec knows opens an ``FsspecStore``.
    """
    if isinstance(bucket, Store) and not isinstance(bucket, (str, os.PathLike)):
        return bucket
    if isinstance(bucket, os.PathLike):
        bucket = os.fspath(bucket)
    if not isinstance(bucket, str):
        raise ConfigError(
            f"bucket {bucket!r} must be a path, a URL or a Store, not {type(bucket).__name__}; "
            f"supported: {_SUPPORTED}"
        )
    if bucket == "":
        raise ConfigError(f"bucket is empty; supported: {_SUPPORTED}")

    match = _URL_RE.match(bucket)
    if match is None:
        from ._local import LocalStore

        return LocalStore(bucket)

    scheme = match.group("scheme").lower()
    if scheme == "file":
        from ._local import LocalStore

        return LocalStore(_file_url_to_path(bucket))
    if scheme == "hf":
        from ._hf import HfBucketStore

        bucket_id, prefix = _parse_hf_bucket_url(bucket)
        return HfBucketStore(bucket_id, prefix)

    from ._fsspec import FsspecStore, check_protocol

    check_protocol(scheme, bucket, supported=_SUPPORTED)
    return FsspecStore(bucket)


def _file_url_to_path(url: str) -> str:
    """Turn ``file:///abs/dir`` (or ``file://localhost/abs/dir``) into ``/abs/dir``."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ConfigError(
            f"bucket URL {url!r} names the host {parts.netloc!r}; file:// URLs must be local "
            "(file:///abs/dir). Mount the remote directory and pass its local path instead."
        )
    if parts.query or parts.fragment:
        raise ConfigError(f"bucket URL {url!r} has a query or fragment; use file:///abs/dir")
    path = unquote(parts.path)
    if not path:
        raise ConfigError(f"bucket URL {url!r} names no directory; use file:///abs/dir")
    return path


def _parse_hf_bucket_url(url: str) -> tuple[str, str]:
    """Split ``hf://buckets/<ns>/<name>[/<prefix>]`` into ``("<ns>/<name>", "<prefix>")``.

    Only buckets qualify: model, dataset and space repos are git-versioned, so every publish
    would be a commit, and old versions could never really be deleted.
    """
    body = url[len("hf://") :].strip("/")
    fix = "use hf://buckets/<namespace>/<name>[/<prefix>], e.g. hf://buckets/me/policy-sync"
    head, _, rest = body.partition("/")
    if head != "buckets":
        what = {"datasets": "a dataset repo", "spaces": "a Space", "models": "a model repo"}.get(
            head, "a model repo"
        )
        raise ConfigError(
            f"bucket URL {url!r} names {what}, not a Hugging Face bucket; deltasync publishes "
            f"through Hub buckets (mutable, non-versioned storage): {fix}"
        )
    segments = rest.split("/") if rest else []
    if len(segments) < 2 or not segments[0] or not segments[1]:
        raise ConfigError(
            f"bucket URL {url!r} does not name a bucket: it needs both a namespace and a bucket "
            f"name; {fix}"
        )
    namespace, name, *prefix = segments
    if "@" in name:
        raise ConfigError(f"bucket URL {url!r}: buckets have no revisions, drop the '@...'; {fix}")
    return f"{namespace}/{name}", "/".join(prefix)
