"""The API-server side of every update: one flow that brings the server to version N, and
follow mode, which runs that flow whenever the bucket commits a newer version.

Both run in the API-server process, where vLLM's pause and resume live:

- :meth:`ServerSync.bring_to` stages the version on every worker while the engine keeps
  generating (``deltasync_begin``: the workers' status, and the prefetch's download, decode and
  check started, in one call), waits until every worker has it ready, and applies it on every
  worker in one ``collective_rpc`` (all ranks or none): between two engine steps with no pause
  (``inflight``), or with the scheduler paused in ``keep`` mode, caches emptied, and resumed
  whatever happened (``pause``). Then it labels the served weight version. A version already served is a no-op (no pause); an older one is
  refused by the workers. Updates never overlap: push requests and the follower take turns.
- Follow mode reads the bucket's committed pointer and brings the server to the newest version
  (several versions behind: straight to the newest, in one staged update; started late or
  restarted: from the newest anchor, as the workers decide). A bucket that cannot be read, or a
  pointer or file that is corrupt, hostile or truncated, changes nothing served: the error is
  kept in :attr:`ServerSync.last_error` (see ``GET /deltasync/status``) and the reads back off
  (doubling up to :data:`MAX_BACKOFF`) until the bucket is sound again. The reads are timed by
  :class:`deltasync.reader.poll.PollPolicy`: every ``interval`` seconds until the trainer's commit
  rhythm is known, then quiet until the next commit is due and every ``interval`` while it is,
  backing off while the trainer is late or idle. :class:`deltasync.reader.poll.PointerWatch` reads the
  pointer conditionally (a metadata read while it is unchanged) where the store can tell.

The push route (``POST /deltasync/update``), the follower and the status route are wired in by
:class:`vllm_ext.UpdateMiddleware`. vLLM's own five weight-update routes (the ``"delta"``
weight-transfer backend) reach the same worker-side update (``WorkerUpdater.update``); their
pause and resume are the caller's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from deltasync import DeltaReceiver
from deltasync.errors import ConfigError, UpdateError
from deltasync.protocol import (
    DEFAULT_FOLLOW_INTERVAL,
    FOLLOW_ENV,
    FOLLOW_INTERVAL_ENV,
    MAX_POLL_S,
    UPDATE_MODE_ENV,
    UPDATE_MODES,
    UpdateAnswer,
    UpdateMode,
    WorkerStatus,
    check_update_mode,
    update_tag,
)
from deltasync.reader import PointerWatch, PollOptions, PollPolicy

from ._config import ServerConfig
from ._token_versions import TokenVersionLog

__all__ = ["UPDATE_MODE_ENV", "UPDATE_MODES", "FollowConfig", "ServerSync", "UpdateOutcome", "cache_salt"]

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL = DEFAULT_FOLLOW_INTERVAL  # the name this module exported
#: The longest wait between two reads while the bucket keeps failing.
MAX_BACKOFF = 60.0
#: How often the flow asks the workers whether a staged version is ready: first after this,
#: then twice as long each time up to MAX_POLL_S (each ask is a call between two engine steps).
_POLL_S = 0.02




def update_mode_from_env(environ: Mapping[str, str] = os.environ) -> str:
    return ServerConfig.from_env(environ).update_mode


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


@dataclass(frozen=True, kw_only=True)
class UpdateOutcome:
    """What :meth:`ServerSync.bring_to` did."""

    version: int
    ok: bool
    noop: bool = False
    """The version was already served: nothing was paused or applied."""
    paused_s: float = 0.0
    seconds: float = 0.0
    results: tuple[UpdateAnswer, ...] = ()
    error: str | None = None
    status: int = 200
    """The HTTP status the push route answers with."""
    mode: UpdateMode = "pause"
    """How it was applied: "pause" or "inflight"."""
    note: str | None = None
    """Why an "inflight" update was applied with a pause instead."""


class ServerSync:
    """The update flow and the follower of one API-server process (see the module)."""

    def __init__(self, engine: Any, *, token: str | None, follow: FollowConfig, update_mode: UpdateMode = "pause") -> None:
        update_mode = check_update_mode(update_mode, "update mode")
        self.engine = engine
        self.token = token
        self.config = follow
        self.update_mode = update_mode
        """The server's mode, for follow mode and for pushes that name none."""
        self.served: int | None = None
        """The version every worker serves (None before the first update)."""
        self.latest_seen: int | None = None
        self.last_error: str | None = None
        self.last_update_at: float | None = None
        self._lock = asyncio.Lock()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._task: asyncio.Task[None] | None = None
        self._receiver: DeltaReceiver | None = None
        self._watch: PointerWatch | None = None
        if follow.bucket:
            self._follow_bucket(follow.view)
        # The longest quiet wait and the idle time before backing off scale with the interval
        # (60 s and 120 s at the default 2 s): a short interval asks for quick updates.
        i = follow.interval
        self.poll = PollPolicy(PollOptions(interval=i, max_interval=max(i, min(MAX_BACKOFF, 30 * i)), idle_after=60 * i))
        """When follow mode reads the pointer next (see :class:`deltasync.reader.poll.PollPolicy`)."""
        self.tokens = TokenVersionLog()
        """Where each version began in each tracked request (every apply goes through it)."""
        from . import _metrics

        self.metrics = _metrics.metrics()

    # ------------------------------------------------------------------ the flow

    async def bring_to(
        self, version: object, auth: object = None, *, origin: str = "push", mode: str | None = None
    ) -> UpdateOutcome:
        """Stage ``version`` while generating, then apply it on every worker: between two engine
        steps with no pause (``mode="inflight"``), or paused with the caches emptied ("pause");
        label it, and resume."""
        start = time.perf_counter()
        mode = mode or self.update_mode
        if mode not in UPDATE_MODES:
            return UpdateOutcome(version=-1, ok=False, status=400,
                                 error=f"mode must be one of {', '.join(UPDATE_MODES)}, got {mode!r}")  # fmt: skip
        async with self._lock:
            if auth is None and self.token is not None and origin == "follow" and isinstance(version, int):
                auth = update_tag(self.token, version)  # the follower acts for the server itself
            # One call into the workers says what they serve and starts staging (or finds the
            # version staged already): each call waits for an engine step to end.
            workers = await self._begin(version, auth)
            served = _served(workers)
            self.served = served
            if isinstance(version, int) and not isinstance(version, bool) and version == served:
                return UpdateOutcome(version=version, ok=True, noop=True, seconds=time.perf_counter() - start)
            outcome = await self._stage_and_apply(version, auth, mode, workers)
            outcome = _replace(outcome, seconds=time.perf_counter() - start)
            if outcome.ok:
                self.served = outcome.version
                self.last_update_at = time.time()
                self.metrics.record_update(outcome, self.served)
            else:
                self.metrics.failures.inc()
                logger.warning("deltasync: %s update to version %s failed: %s", origin, version, outcome.error)
            return outcome

    async def _stage_and_apply(self, version: object, auth: object, mode: UpdateMode, workers: list[WorkerStatus]) -> UpdateOutcome:
        safe_version = version if isinstance(version, int) and not isinstance(version, bool) else -1
        note = None
        if mode == "inflight":
            reload = [w for w in workers if w.mode != "in-place"]
            if reload:
                # The reload path rebuilds whole modules: only the in-place writer can run between
                # two engine steps without a pause.
                fallback = sorted({name for w in reload for name in w.fallback})
                note = (f"in-flight updates need every parameter patched in place; {len(fallback)} fall back to the "
                        f"reload (e.g. {fallback[0] if fallback else 'all'}), so this update paused")  # fmt: skip
                mode = "pause"
        # Staging (download, decode, check on every worker) started in _begin; the engine
        # generates meanwhile.
        jobs = [w.prefetch for w in workers]
        refused = any(j is None or j.state == "refused" for j in jobs)
        if not refused and not all(j is not None and j.state == "ready" for j in jobs):
            failed = await self._wait_staged(safe_version)
            if failed is not None:
                # The version cannot be staged (a bad file, a hostile pointer): nothing is paused.
                return UpdateOutcome(version=safe_version, ok=False, error=failed, status=500)
        # A refused staging (a wrong tag, a version not committed or older than served) goes on
        # to the apply, which refuses it in the workers' own words before it writes anything.
        if mode == "inflight":
            return await self._apply_inflight(safe_version, version, auth)
        outcome = await self._apply_paused(safe_version, version, auth)
        return _replace(outcome, note=note)

    async def _apply_inflight(self, safe_version: int, version: object, auth: object) -> UpdateOutcome:
        """The in-place write as one ``collective_rpc``, which the engine core runs between two
        steps: no forward pass runs on any rank meanwhile, and running requests keep their KV.
        New requests are salted with the version they are admitted at, so none reuses the
        prefix cache of older weights (see :func:`cache_salt`)."""
        try:
            results, failed_one = await self._apply_and_label(version, auth)
        except Exception as exc:  # noqa: BLE001  (the worker's own message names what was wrong)
            return UpdateOutcome(version=safe_version, ok=False, error=str(exc), status=500, mode="inflight")
        # Nothing pauses (paused_s 0). The engine does not step while the write runs: each
        # worker's apply_s is that standstill. The request's own wall time is longer: each
        # collective_rpc waits for the engine step in progress, which goes on generating.
        if failed_one is not None:
            return UpdateOutcome(version=safe_version, ok=False, error=failed_one.error, status=500, mode="inflight")
        return UpdateOutcome(version=safe_version, ok=True, results=results, mode="inflight")

    async def _apply_and_label(self, version: object, auth: object) -> tuple[tuple[UpdateAnswer, ...], UpdateAnswer | None]:
        """Apply on every worker and label the served version; the answers, and the first
        worker that reports a failure without raising (only the last worker raises)."""
        raw = await self.tokens.apply(self.engine, version, auth)  # type: ignore[arg-type]
        results = tuple(UpdateAnswer.from_answer(r) for r in raw)
        failed_one = next((r for r in results if r.error), None)
        if failed_one is None:
            await self.engine.update_weight_version(str(version))
        return results, failed_one

    async def _apply_paused(self, safe_version: int, version: object, auth: object) -> UpdateOutcome:
        paused = False
        pause_start = time.perf_counter()
        try:
            self._resumed.clear()
            await _pause(self.engine)
            paused = True
            results, failed_one = await self._apply_and_label(version, auth)
        except Exception as exc:  # noqa: BLE001  (the worker's own message names what was wrong)
            status = 500 if paused else 503
            message = str(exc) if paused else f"pausing the server failed ({type(exc).__name__}: {exc})"
            return UpdateOutcome(version=safe_version, ok=False, error=message, status=status)
        finally:
            if paused:
                await self.engine.resume_generation()
            self._resumed.set()
            paused_s = time.perf_counter() - pause_start
        if failed_one is not None:  # a worker reported an error without raising: never a success
            return UpdateOutcome(version=safe_version, ok=False, error=failed_one.error, status=500, paused_s=paused_s)
        return UpdateOutcome(version=safe_version, ok=True, paused_s=paused_s, results=results)

    async def _wait_staged(self, version: int) -> str | None:
        """Wait until every worker has ``version`` staged (it was found still staging); the
        first failure's message, or None."""
        delay = _POLL_S
        while True:
            await asyncio.sleep(delay)
            delay = min(2 * delay, MAX_POLL_S)
            workers = await self.workers()
            jobs = [w.prefetch for w in workers]
            if any(j is None or j.version != version for j in jobs):
                # Already served (the workers answered "applied"), or replaced: the apply decides.
                return None
            failed = next((j for j in jobs if j is not None and j.state == "failed"), None)
            if failed is not None:
                # The workers' own wording for a refused update (the push route has always said it).
                kind, _, detail = (failed.error or "").partition(": ")
                reason = f"({kind}): {detail}" if detail and kind.isidentifier() else f": {failed.error}"
                served = "the checkpoint it started with" if self.served is None else f"version {self.served}"
                return f"deltasync: update to version {version} refused {reason}; still serving {served}"
            if all(j is not None and j.state in ("ready", "applied") for j in jobs):
                return None

    async def _begin(self, version: object, auth: object) -> list[WorkerStatus]:
        """Every worker's status, after it was asked to stage ``version`` (``deltasync_begin``):
        each status's ``prefetch`` is the answer to that (None where the call failed)."""
        try:
            answers = await self.engine.collective_rpc("deltasync_begin", args=(version, auth))
        except Exception:  # noqa: BLE001  (a worker that cannot answer: the apply reports it)
            return [dataclasses.replace(w, prefetch=None) for w in await self.workers()]
        return [WorkerStatus.from_answer(a) for a in answers]

    async def workers(self) -> list[WorkerStatus]:
        """Every worker's typed status."""
        answers = await self.engine.collective_rpc("deltasync_status")
        return [WorkerStatus.from_answer(a) for a in answers]

    async def admitted(self) -> int | None:
        """The version a request admitted now is served by (waits out an update's pause, and a
        weight change made through vLLM's own routes until the served version is known again)."""
        await self._resumed.wait()
        return self.served

    @contextlib.asynccontextmanager
    async def outside_update(self, *, counted: bool = False) -> AsyncIterator[None]:
        """Around a request that may change the weights behind the flow (vLLM's weight-update
        routes, ``deltasync_apply`` through ``/collective_rpc``): no request is admitted until it
        is over and the served version has been read back from the workers, so no request is
        admitted (and salted) at an older version than the weights it runs on. ``counted``: the
        apply went through :attr:`tokens` (else a new version's token starts are unknown)."""
        async with self._lock:
            self._resumed.clear()
            before = self.served
            try:
                yield
            finally:
                try:
                    self.served = _served(await self.workers())
                    if not counted and self.served is not None and (before is None or self.served > before):
                        self.tokens.note_unknown(self.served)
                    self.metrics.served.set(-1 if self.served is None else self.served)
                except Exception as exc:  # noqa: BLE001
                    logger.warning("deltasync: cannot read the served version back: %s", exc)
                self._resumed.set()

    # ------------------------------------------------------------------ follow mode

    def start(self) -> None:
        """Learn what is served and, in follow mode, start following (at the server's start-up)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="deltasync-follow")

    _view_known = False

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

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        try:
            workers = await self.workers()
            self.served = _served(workers)
            self.metrics.served.set(-1 if self.served is None else self.served)
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
        try:
            if not self._view_known:  # the workers were not ready at start-up: ask them now
                self._follow_view(await self.workers())
            assert self._watch is not None
            pointer = await asyncio.to_thread(self._watch.read)
            self.poll.observe(pointer.version)
            self.latest_seen = pointer.version
            self.metrics.latest.set(pointer.version)
            if self.served is None or pointer.version > self.served:
                outcome = await self.bring_to(pointer.version, origin="follow")
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

    _failures = 0

    def follow_status(self) -> dict[str, Any]:
        lag = None
        if self.latest_seen is not None:
            lag = self.latest_seen - (self.served if self.served is not None else -1)
        return {
            "enabled": self.config.enabled,
            "interval": self.config.interval,
            "rhythm": None if self.poll.rhythm is None else round(self.poll.rhythm[0], 3),
            "latest_seen": self.latest_seen,
            "lag": lag,
            "last_error": self.last_error,
            "last_update_at": self.last_update_at,
        }


def cache_salt(version: int | None, client_salt: object = None) -> str:
    """The prefix-cache salt of a request admitted at ``version``: requests admitted at
    different versions never share prefix-cache blocks; a client's own salt still separates
    its requests from others' (combined through a hash, within vLLM's 128 characters)."""
    salt = f"deltasync-v{'base' if version is None else version}"
    if isinstance(client_salt, str) and client_salt:
        salt += "-" + hashlib.sha256(client_salt.encode()).hexdigest()[:40]
    return salt


def _served(workers: list[WorkerStatus]) -> int | None:
    """The lowest version any worker serves (None if any serves none)."""
    versions = [w.version for w in workers]
    if not versions or any(v is None for v in versions):
        return None
    return min(v for v in versions if v is not None)


def _replace(outcome: UpdateOutcome, **changes: Any) -> UpdateOutcome:
    from dataclasses import replace

    return replace(outcome, **changes)


async def _pause(engine: Any) -> None:
    """``engine.pause_generation(mode="keep", clear_cache=True)`` without its 20 ms sleep, which
    only orders the outputs of aborted requests (``keep`` aborts none)."""
    core = getattr(engine, "engine_core", None)
    if core is None or not hasattr(core, "pause_scheduler_async"):
        await engine.pause_generation(mode="keep", clear_cache=True)
        return
    renderer = getattr(engine, "renderer", None)
    if renderer is not None and hasattr(renderer, "clear_mm_cache_async"):
        await renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode="keep", clear_cache=True)


def token_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    return ServerConfig.from_env(environ).token
