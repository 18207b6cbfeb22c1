"""The storage protocol every bucket backend implements, and the path rules they share.

The trainer and the rollout servers never talk weight bytes to each other: they meet in a
bucket. Everything the publisher and receiver need from a bucket is a handful of whole-file
operations on relative paths, so the protocol is exactly that and nothing more. Keeping it
this small is what lets one conformance suite prove every backend equivalent.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from .._errors import ConfigError

__all__ = ["Store", "check_path", "check_prefix", "read_limited"]

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
