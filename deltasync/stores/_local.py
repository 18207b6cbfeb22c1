"""A bucket that is a directory: local disk, or a network filesystem mounted on every host."""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import os
import re
import secrets
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO

from ..errors import NotFoundError, StoreError
from ._base import LimitedReads, check_path, check_prefix, reading
from ._conditional import conflict

__all__ = ["LocalStore"]

# Temporary files of in-flight writes: ".<name>.<pid>.<hex>.tmp". Listing hides them so a
# reader never mistakes a half-written file (or one a crashed writer left) for data.
_TEMP_RE = re.compile(r"^\..+\.\d+\.[0-9a-f]+\.tmp$")
# The lock file of conditional writes of "<name>": ".<name>.lock", beside it, hidden too.
_LOCK_RE = re.compile(r"^\..+\.lock$")


class LocalStore(LimitedReads):
    """Files under a root directory; the directory is created on the first write.

    Writes go to a temporary file in the target's own directory, are fsync'ed, then renamed
    over the target with ``os.replace``: a rename within one filesystem is atomic, so readers
    (on this host or through NFS) see either the old file or the new one.
    """

    streams_in_place = True
    """:meth:`write_stream` writes each chunk into the file as it comes (see
    :func:`~deltasync.stores.write_pieces`)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        # Absolute now, so a later chdir cannot move the bucket under a running publisher.
        self.root = Path(root).expanduser().absolute()
        self.url = self.root.as_uri()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _file(self, path: str) -> Path:
        return self.root.joinpath(*check_path(path).split("/"))

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        target = self._file(path)
        try:
            if limit is None:
                return target.read_bytes()
            with open(target, "rb") as f:
                # read(n) allocates n bytes up front: never more than the file holds.
                return f.read(min(limit, os.fstat(f.fileno()).st_size) + 1)
        except FileNotFoundError as e:
            raise NotFoundError(f"{path!r} is not in bucket {self.url} (no file {target})") from e
        except IsADirectoryError as e:
            raise NotFoundError(
                f"{path!r} in bucket {self.url} is a directory, not a file ({target})"
            ) from e
        except OSError as e:
            raise StoreError(f"cannot read {path!r} from bucket {self.url}: {e}") from e

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        target = self._file(path)
        try:
            f = open(target, "rb")  # noqa: SIM115  (returned to the caller, who closes it)
        except FileNotFoundError as e:
            raise NotFoundError(f"{path!r} is not in bucket {self.url} (no file {target})") from e
        except IsADirectoryError as e:
            raise NotFoundError(f"{path!r} in bucket {self.url} is a directory, not a file ({target})") from e
        except OSError as e:
            raise StoreError(f"cannot read {path!r} from bucket {self.url}: {e}") from e
        return reading(f, path, self.url)

    def write_bytes(self, path: str, data: bytes) -> None:
        self.write_stream(path, (data,))

    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        target = self._file(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # os.open rather than mkstemp: mkstemp's 0600 mode would hide the files from
            # rollout servers running as another user; 0666 & umask matches a plain open().
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            try:
                with os.fdopen(fd, "wb") as f:
                    written = flushed = 0
                    for chunk in chunks:
                        written += f.write(chunk)
                        if written - flushed >= _WRITEBACK:
                            f.flush()
                            _start_writeback(f.fileno(), flushed, written - flushed)
                            flushed = written
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as e:
            raise StoreError(
                f"cannot write {path!r} to bucket {self.url}: {e}; check that {self.root} is "
                "writable and on a filesystem with free space"
            ) from e
        _fsync_dir(target.parent)

    def exists(self, path: str) -> bool:
        return self._file(path).is_file()

    # Conditional writes (:class:`~deltasync.stores.ConditionalStore`). The tag of a file is its
    # inode, size and modification time: every write renames a new file into place, so every
    # write gives a new inode (and a new mtime where an inode number comes back).

    def conditional_writes(self) -> str:
        return "an exclusive flock of a lock file beside the file, then a write and a rename"

    def read_tagged(self, path: str, limit: int) -> tuple[bytes, str]:
        with self.open_read(path) as f:
            tag = _stat_tag(os.fstat(f.fileno()))
            return f.read(min(limit, int(tag.split(":")[1])) + 1), tag

    def write_if(self, path: str, data: bytes, tag: str | None) -> str:
        target = self._file(path)
        with self._locked(path, target):
            try:
                current: str | None = _stat_tag(os.stat(target))
            except FileNotFoundError:
                current = None
            except OSError as e:
                raise StoreError(f"cannot check {path!r} in bucket {self.url}: {e}") from e
            if current != tag:
                raise conflict(self, path, tag, current)
            self.write_bytes(path, data)
            return _stat_tag(os.stat(target))

    @contextlib.contextmanager
    def _locked(self, path: str, target: Path) -> Iterator[None]:
        """Hold the exclusive lock of ``path``'s conditional writes (released if the process dies)."""
        lock = target.with_name(f".{target.name}.lock")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as e:
            raise StoreError(f"cannot lock {path!r} in bucket {self.url} ({lock}): {e}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix fully names, not the whole bucket.
        start_dir = prefix.rpartition("/")[0]
        start = self.root.joinpath(*start_dir.split("/")) if start_dir else self.root
        found: list[str] = []
        try:
            for dirpath, _dirnames, filenames in os.walk(start, onerror=_raise):
                rel_dir = Path(dirpath).relative_to(self.root).as_posix()
                for name in filenames:
                    if _TEMP_RE.match(name) or _LOCK_RE.match(name):
                        continue
                    rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                    if rel.startswith(prefix):
                        found.append(rel)
        except OSError as e:
            raise StoreError(f"cannot list {prefix!r} in bucket {self.url}: {e}") from e
        return sorted(found)

    def clean_temp(self, older_than: float) -> builtins.list[str]:  # the method list shadows the type here
        """Delete temporary files of writes last modified more than ``older_than`` seconds ago.

        A writer killed between creating its temporary file and renaming it leaves the file
        behind (listing hides it, but it holds space). Younger ones may be in flight. Returns
        the bucket paths removed.
        """
        if not self.root.is_dir():
            return []
        cutoff = time.time() - older_than
        removed: list[str] = []
        try:
            for dirpath, _dirnames, filenames in os.walk(self.root, onerror=_raise):
                for name in filenames:
                    if not _TEMP_RE.match(name):
                        continue
                    path = Path(dirpath) / name
                    try:
                        if path.stat().st_mtime < cutoff:
                            path.unlink()
                            removed.append(path.relative_to(self.root).as_posix())
                    except FileNotFoundError:
                        pass  # renamed or removed by its writer meanwhile
        except OSError as e:
            raise StoreError(f"cannot clean temporary files in bucket {self.url}: {e}") from e
        return removed

    def delete(self, paths: Iterable[str]) -> None:
        # Validate all first, so a bad path in the batch deletes nothing.
        targets = [(path, self._file(path)) for path in paths]
        for path, target in targets:
            try:
                target.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise StoreError(f"cannot delete {path!r} from bucket {self.url}: {e}") from e


def _stat_tag(st: os.stat_result) -> str:
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _raise(error: OSError) -> None:
    """Fail the listing on unreadable directories, which os.walk would silently skip.

    A directory that does not exist (not created yet, deleted while we walk, or a file) has no
    files to list.
    """
    if not isinstance(error, (FileNotFoundError, NotADirectoryError)):
        raise error


_WRITEBACK = 64 << 20
"""A file written by :meth:`LocalStore.write_stream` has the disk start on each of its first
bytes once this many more are written, so that its closing ``fsync`` waits for the last ones
only: the disk writes while the writer hashes and copies the next."""


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing ``length`` bytes of ``fd`` from ``offset`` to the disk,
    without waiting (Linux: ``POSIX_FADV_DONTNEED`` on dirty pages starts their writeback and
    leaves them cached; pages of the range the kernel had already written back may leave the
    cache, so a reader on this host may read them from the disk. Elsewhere, or where the
    filesystem ignores it, nothing happens and the closing ``fsync`` writes everything, as before)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is not None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            advise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def _fsync_dir(directory: Path) -> None:
    """Persist the rename itself, so after a power loss the pointer never outlives its data.

    Best effort: some platforms and filesystems cannot open or fsync a directory.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
