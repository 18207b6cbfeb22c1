"""How often a follower reads a bucket's pointer: cheap while nothing changes, quick when something does.

A follower (a rollout server in follow mode, or any reader that waits for new versions) reads
the bucket's small pointer file again and again. A fixed interval costs the bucket the same
whether or not the trainer publishes: 2 s is 1,800 reads an hour per follower, while an RL
trainer commits a version every minute or so. Two things here cut that down, with no engine in
sight (the vLLM follower uses them; another engine's would too):

- :class:`PollPolicy` times the reads from the trainer's own rhythm. It learns the interval
  between commits from the versions it sees, waits quietly until the next one is due, polls at
  the follower's interval (``DELTASYNC_FOLLOW_INTERVAL``, 2 s by default) while it is due, and
  backs off when the trainer is late or has stopped. Until it knows a rhythm it polls at the
  interval, as a fixed poll does; after ``idle_after`` seconds without a change it backs off too.
- :class:`PointerWatch` reads the pointer conditionally where the store can say cheaply that it
  has not changed: in one request on S3 (a GET with ``If-None-Match: <ETag>``, answered 304
  without a body while nothing changed); elsewhere by a metadata read (a local file's
  ``stat``, an object's ETag or modification time through fsspec, a Hub bucket file's content
  hash from ``get_bucket_paths_info``) and a read of the whole file only when it changed, or
  where the store cannot tell.

Both take a clock, so tests drive them with a fake one.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, NotFoundError, VersionError
from ..format import MAX_POINTER_BYTES, POINTER_PATH, Pointer
from ..protocol.env import DEFAULT_FOLLOW_INTERVAL
from ..stores import Store, read_limited

__all__ = ["PointerWatch", "PollOptions", "PollPolicy", "pointer_tag", "read_if_changed"]


@dataclass(frozen=True, kw_only=True)
class PollOptions:
    """How a :class:`PollPolicy` spaces the reads of the pointer."""

    interval: float = DEFAULT_FOLLOW_INTERVAL
    """Seconds between two reads while a commit is due (and while no rhythm is known)."""
    max_interval: float = 60.0
    """The longest wait between two reads: a trainer that restarts after a pause is seen at most
    this late."""
    idle_after: float = 120.0
    """With no rhythm known yet: seconds after the last change (or the start) during which reads
    keep the plain interval; after that they back off."""
    backoff: float = 0.25
    """Once the trainer is overdue (or idle), wait this fraction of the time it has been overdue
    (at least ``interval``, at most ``max_interval``): a version that comes late is seen at most
    this fraction later again."""
    history: int = 8
    """Commit intervals remembered (the rhythm is their median)."""
    min_history: int = 2
    """Commit intervals needed before the rhythm is used."""

    def __post_init__(self) -> None:
        for name in ("interval", "max_interval", "idle_after", "backoff"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"PollOptions.{name} must be a positive number, got {value!r}")
        if self.max_interval < self.interval:
            raise ConfigError(
                f"PollOptions.max_interval ({self.max_interval}) must be at least interval ({self.interval})"
            )
        if not 1 <= self.min_history <= self.history:
            raise ConfigError(
                f"PollOptions.min_history must be in 1..history ({self.history}), got {self.min_history}"
            )


class PollPolicy:
    """When to read the pointer next, from the versions seen so far (see the module).

    Call :meth:`observe` with the committed version after every successful read; it returns the
    seconds to wait before the next one. The rhythm is the median of the recent intervals
    between changes (a jump of k versions counts as k intervals of a k-th of the time; a change
    is dated to the middle of the gap between the two reads around it when that gap was short).
    The reads wait until ``interval / 2 + 2 * MAD`` (at most half the rhythm) before the next
    commit is due, then poll every ``interval``. Commits that come on time are seen at most
    ``interval`` late, as with a fixed poll; a trainer on a regular 60 s step costs about 2 reads
    a version (120 an hour).
    """

    def __init__(self, options: PollOptions | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options or PollOptions()
        self.clock = clock
        self.reads = 0
        """Reads observed so far."""
        self._start = clock()
        self._version: int | None = None
        self._changed_at: float | None = None
        self._read_at: float | None = None
        self._intervals: deque[float] = deque(maxlen=self.options.history)

    @property
    def rhythm(self) -> tuple[float, float] | None:
        """The trainer's commit interval and its median absolute deviation, once known."""
        if len(self._intervals) < self.options.min_history:
            return None
        median = statistics.median(self._intervals)
        return median, statistics.median(abs(i - median) for i in self._intervals)

    def observe(self, version: int) -> float:
        """Record a read that found ``version`` committed; the seconds to wait before the next."""
        now = self.clock()
        self.reads += 1
        previous, self._read_at = self._read_at, now
        if self._version is None or version < self._version:
            # The first version seen (or a bucket started over): when it was committed is unknown.
            self._version, self._changed_at = version, None
            self._intervals.clear()
        elif version > self._version:
            # Committed since the read before: the middle of that gap, when the gap was short.
            gap = now - previous if previous is not None else math.inf
            at = now - gap / 2 if gap <= 1.5 * self.options.interval else now
            if self._changed_at is not None:
                steps = version - self._version
                self._intervals.extend([(at - self._changed_at) / steps] * min(steps, self.options.history))
            self._version, self._changed_at = version, at
        return self.delay(now)

    def delay(self, now: float | None = None) -> float:
        """The seconds to wait, at ``now``, before the next read."""
        o = self.options
        now = self.clock() if now is None else now
        last = self._start if self._changed_at is None else self._changed_at
        rhythm = self.rhythm
        if rhythm is None:
            overdue = now - last - o.idle_after
        else:
            every, spread = rhythm
            window = min(o.interval / 2 + 2 * spread, every / 2)
            due = last + every
            if now < due - window:
                return max(o.interval, min(due - window - now, o.max_interval))
            overdue = now - (due + window)
        if overdue <= 0:
            return o.interval
        return max(o.interval, min(overdue * o.backoff, o.max_interval))


def pointer_tag(store: Store, path: str = POINTER_PATH) -> Hashable | None:
    """A cheap token that changes whenever the file ``path`` (by default the pointer) may have
    changed (one metadata read), or None where the store cannot give one (the file is then read
    whole).

    A store may give its own through a ``change_tag(path)`` method; the built-in ones use a local
    file's ``stat`` (inode, size, modification time: every write replaces the file), an fsspec
    object's ETag, checksum or modification time, and a Hub bucket file's content hash; a folder
    of a bucket (a view's chain) asks its parent. ``NotFoundError`` if the file is missing.
    """
    own = getattr(store, "change_tag", None)
    if callable(own):
        return own(path)  # type: ignore[no-any-return]
    from ..stores import FsspecStore, HfBucketStore, LocalStore
    from ..stores._sub import SubStore

    if isinstance(store, SubStore):
        return pointer_tag(store.parent, store.prefix + path)
    if isinstance(store, LocalStore):
        try:
            st = os.stat(store.root / path)
        except FileNotFoundError as exc:
            raise NotFoundError(f"{path!r} is not in bucket {store.url}") from exc
        return (st.st_ino, st.st_size, st.st_mtime_ns)
    if isinstance(store, FsspecStore):
        try:
            info: dict[str, Any] = store.fs.info(store._full(path))
        except FileNotFoundError as exc:
            raise NotFoundError(f"{path!r} is not in bucket {store.url}") from exc
        keys = ("ETag", "etag", "Content-MD5", "md5", "Digest", "mtime", "LastModified", "last_modified", "created")
        found = tuple((k, str(info[k])) for k in keys if info.get(k) is not None)
        # Size alone would miss a pointer rewritten at the same length: no tag then.
        return (info.get("size"), found) if found else None
    if isinstance(store, HfBucketStore):
        remote = store._remote(path)
        infos = [i for i in store.api.get_bucket_paths_info(store.bucket_id, [remote], token=store._token) if i.path == remote]
        if not infos:
            raise NotFoundError(f"{path!r} is not in bucket {store.url}")
        found = tuple(str(getattr(infos[0], k, None)) for k in ("xet_hash", "size", "mtime"))  # type: ignore[misc]
        return found if getattr(infos[0], "xet_hash", None) else None
    return None


def read_if_changed(store: Store, path: str, tag: Hashable | None, limit: int) -> tuple[bytes | None, Hashable | None]:
    """The file ``path`` (at most ``limit + 1`` bytes) and its tag, or ``(None, tag)`` while it is
    still the file ``tag`` names: one conditional GET on S3 (``If-None-Match``, answered 304
    without a body), else a :func:`pointer_tag` read and, when that changed or says nothing, the
    file. A tag of None reads the file. ``NotFoundError`` if it is missing."""
    from ..stores import FsspecStore
    from ..stores._sub import SubStore

    if isinstance(store, SubStore):
        return read_if_changed(store.parent, store.prefix + path, tag, limit)
    if isinstance(store, FsspecStore) and store.conditional_reads():
        return store.read_if_changed(path, tag if isinstance(tag, str) else None, limit)
    try:
        new = pointer_tag(store, path)
    except NotFoundError:
        new = None  # the read says it in its own words
    if new is not None and new == tag:
        return None, tag
    return read_limited(store, path, limit), new


class PointerWatch:
    """Reads a bucket's pointer, conditionally where the store can tell it has not changed.

    :meth:`read` returns the committed pointer; while the file is as it was, it returns the
    pointer it read last without downloading it again: on S3 one conditional GET (304 Not
    Modified), elsewhere one metadata request (see :func:`read_if_changed`). A store that cannot
    tell is read whole every time. :attr:`data` holds the bytes of the pointer returned, which a
    follower hands to the readers it drives (:meth:`deltasync.DeltaReceiver.offer_pointer`) so
    they need not read it again.
    """

    def __init__(self, store: Store) -> None:
        self.store = store
        self._tag: Hashable | None = None
        self._pointer: Pointer | None = None
        self.data: bytes | None = None
        """The bytes of the pointer :meth:`read` returned last."""
        self.full_reads = 0
        """Reads of the whole pointer file."""
        self.tag_reads = 0
        """Reads that found the pointer unchanged."""

    def read(self) -> Pointer:
        """The bucket's committed pointer (``VersionError`` if none is committed)."""
        where = f"{self.store.url}/{POINTER_PATH}"
        known = self._tag if self._pointer is not None else None
        try:
            data, tag = read_if_changed(self.store, POINTER_PATH, known, MAX_POINTER_BYTES)
        except NotFoundError as exc:
            self.full_reads += 1
            raise VersionError(f"{where}: no version is committed in this bucket yet") from exc
        if data is None and self._pointer is not None:
            self.tag_reads += 1
            return self._pointer
        assert data is not None
        self.full_reads += 1
        pointer = Pointer.from_bytes(data, where=where)
        self._tag, self._pointer, self.data = tag, pointer, data
        return pointer
