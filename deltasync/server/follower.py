"""Follow mode: a watcher of the bucket's committed pointer that runs the one update flow.

The follower reads the pointer and brings the server to the newest version through
:meth:`deltasync.server.flow.UpdateFlow.bring_to` (several versions behind: straight to the newest, in
one staged update; started late or restarted: from the newest anchor, as the workers decide). A
bucket that cannot be read, or a pointer or file that is corrupt, hostile or truncated, changes
nothing served: the error is kept in :attr:`Follower.last_error` (see ``GET /deltasync/status``)
and the reads back off (doubling up to :data:`MAX_BACKOFF`) until the bucket is sound again. The
reads are timed by :class:`deltasync.reader.PollPolicy`: every ``interval`` seconds until the
trainer's commit rhythm is known, then quiet until the next commit is due and every ``interval``
while it is, backing off while the trainer is late or idle. :class:`deltasync.reader.PointerWatch`
reads the pointer conditionally (a metadata read while it is unchanged) where the store can tell.

Engine-neutral: it reaches the engine only through the flow.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from deltasync import DeltaReceiver
from deltasync.errors import ConfigError, UpdateError
from deltasync.protocol import DEFAULT_FOLLOW_INTERVAL, FOLLOW_ENV, FOLLOW_INTERVAL_ENV, WorkerStatus
from deltasync.reader import PointerWatch, PollOptions, PollPolicy

from .config import ServerConfig
from .flow import UpdateFlow, served_by

__all__ = ["DEFAULT_INTERVAL", "MAX_BACKOFF", "FollowConfig", "Follower"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL = DEFAULT_FOLLOW_INTERVAL
#: The longest wait between two reads while the bucket keeps failing.
MAX_BACKOFF = 60.0


@dataclass(frozen=True, kw_only=True)
class FollowConfig:
    """Follow mode's settings, read once from the environment at start-up."""

    enabled: bool = False
    """Read the pointer every ``interval`` and bring the server to each newer version."""
    interval: float = DEFAULT_INTERVAL
    """Seconds between two reads of the pointer."""
    bucket: str | None = None
    """The bucket the server follows (``DELTASYNC_BUCKET``)."""
    view: str | None = None
    """The quantized view whose pointer it reads (``DELTASYNC_VIEW``); None: the bf16 chain's."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval) and self.interval > 0):
            raise ConfigError(f"{FOLLOW_INTERVAL_ENV} must be a positive number of seconds, got {self.interval!r}")
        if self.enabled and not self.bucket:
            raise ConfigError(f"{FOLLOW_ENV}=1 needs the bucket to follow: set DELTASYNC_BUCKET")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FollowConfig:
        return cls.of(ServerConfig.from_env(environ))

    @classmethod
    def of(cls, config: ServerConfig) -> FollowConfig:
        """Follow mode's part of the server's settings."""
        return cls(enabled=config.follow, interval=config.follow_interval, bucket=config.bucket, view=config.view)


class Follower:
    """Reads the followed bucket's pointer and runs ``flow`` for each newer version (see the module)."""

    def __init__(self, flow: UpdateFlow, config: FollowConfig) -> None:
        self.flow = flow
        self.config = config
        self.latest_seen: int | None = None
        """The newest committed version read from the pointer."""
        self.last_error: str | None = None
        """Why the last read or update failed (None after a success)."""
        self._failures = 0
        self._task: asyncio.Task[None] | None = None
        self._receiver: DeltaReceiver | None = None
        self._watch: PointerWatch | None = None
        self._view_known = False
        if config.bucket:
            self._follow_bucket(config.view)
        # The longest quiet wait and the idle time before backing off scale with the interval
        # (60 s and 120 s at the default 2 s): a short interval asks for quick updates.
        i = config.interval
        self.poll = PollPolicy(PollOptions(interval=i, max_interval=max(i, min(MAX_BACKOFF, 30 * i)), idle_after=60 * i))
        """When follow mode reads the pointer next (see :class:`deltasync.reader.PollPolicy`)."""

    def start(self) -> None:
        """Learn what is served and, in follow mode, start following (at the server's start-up)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="deltasync-follow")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def _follow_view(self, workers: list[WorkerStatus]) -> None:
        """Read the pointer of the view the workers serve (their checkpoint's), when the
        environment did not name it: a view commits each version after the bf16 chain does."""
        if not workers:
            return
        self._view_known = True
        view = workers[0].view
        if view is not None and view != self.config.view and self.config.bucket:
            logger.info("deltasync: following view %s of %s (the served checkpoint's)", view, self.config.bucket)
            self.config = replace(self.config, view=view)
            self._follow_bucket(view)

    def _follow_bucket(self, view: str | None) -> None:
        """Read the pointer of ``view``'s chain (None: the bf16 chain) of the followed bucket."""
        assert self.config.bucket
        self._receiver = DeltaReceiver(self.config.bucket, view=view)
        self._watch = PointerWatch(self._receiver.store)

    async def _run(self) -> None:
        flow = self.flow
        try:
            workers = await flow.workers()
            flow.served = served_by(workers)
            flow.metrics.served.set(-1 if flow.served is None else flow.served)
            self._follow_view(workers)
        except Exception as exc:  # noqa: BLE001  (the engine may still be warming up; updates set it)
            logger.warning("deltasync: cannot read the served version at start-up: %s", exc)
        if not self.config.enabled:
            return
        logger.info("deltasync: following %s every %.3g s", self.config.bucket, self.config.interval)
        delay = 0.0
        while True:
            await asyncio.sleep(delay)
            delay = await self.follow_once()

    async def follow_once(self) -> float:
        """One read of the pointer, and an update if it names a newer version; returns the
        seconds to wait before the next read (longer while the bucket keeps failing)."""
        flow = self.flow
        try:
            if not self._view_known:  # the workers were not ready at start-up: ask them now
                self._follow_view(await flow.workers())
            assert self._watch is not None
            pointer = await asyncio.to_thread(self._watch.read)
            self.poll.observe(pointer.version)
            self.latest_seen = pointer.version
            flow.metrics.latest.set(pointer.version)
            if flow.served is None or pointer.version > flow.served:
                # The workers stage from the pointer read here: none reads it again.
                outcome = await flow.bring_to(pointer.version, origin="follow", pointer=self._watch.data)
                if not outcome.ok:
                    raise UpdateError(outcome.error or "the update failed")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001  (reported through the status route; serving goes on)
            self.last_error = f"{type(exc).__name__}: {exc}"
            self._failures = min(self._failures + 1, 32)  # a bounded exponent: it may fail for days
            return min(self.config.interval * 2**self._failures, max(MAX_BACKOFF, self.config.interval))
        self.last_error = None
        self._failures = 0
        return self.poll.delay()

    def status(self) -> dict[str, Any]:
        """Follow mode's part of ``GET /deltasync/status``."""
        served = self.flow.served
        lag = None
        if self.latest_seen is not None:
            lag = self.latest_seen - (served if served is not None else -1)
        return {
            "enabled": self.config.enabled,
            "interval": self.config.interval,
            "rhythm": None if self.poll.rhythm is None else round(self.poll.rhythm[0], 3),
            "latest_seen": self.latest_seen,
            "lag": lag,
            "last_error": self.last_error,
            "last_update_at": self.flow.last_update_at,
        }
