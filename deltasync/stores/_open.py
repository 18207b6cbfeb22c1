"""``open_store``: the URL dispatcher that picks a backend (the backends import only ``_base``).

A URL's scheme picks its backend in :data:`OPENERS`, the one registry of the built-in backends;
a path without a scheme is a local directory, and any other scheme goes to fsspec."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from urllib.parse import unquote, urlsplit

from ..errors import ConfigError
from ._base import Store
from ._fsspec import FsspecStore, check_protocol
from ._hf import HfBucketStore
from ._local import LocalStore

__all__ = ["open_store"]

# A URL is recognised by an explicit "scheme://": a bare "C:\dir" or "dir:x" stays a path.
_URL_RE = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*)://")
_SUPPORTED = (
    "a local directory path or file:///abs/dir, hf://buckets/<namespace>/<name>[/<prefix>], "
    "or any URL whose scheme fsspec implements (memory://, s3://, gs://, ...)"
)


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
        return LocalStore(bucket)

    scheme = match.group("scheme").lower()
    opener = OPENERS.get(scheme)
    if opener is not None:
        return opener(bucket)
    check_protocol(scheme, bucket, supported=_SUPPORTED)
    return FsspecStore(bucket)


def _open_local(url: str) -> Store:
    return LocalStore(_file_url_to_path(url))


def _open_hf(url: str) -> Store:
    bucket_id, prefix = _parse_hf_bucket_url(url)
    return HfBucketStore(bucket_id, prefix)


OPENERS: Mapping[str, Callable[[str], Store]] = MappingProxyType({"file": _open_local, "hf": _open_hf})
"""URL scheme -> the function that opens a bucket URL of that scheme (read-only; other schemes
go to fsspec)."""


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
