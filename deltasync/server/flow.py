"""The update flow of one API-server process: brings the server to version N.

:meth:`UpdateFlow.bring_to` stages the version on every worker while the engine keeps
generating (``deltasync_begin``: the workers' status, and the prefetch's download, decode and
check started, in one call), waits until every worker has it ready, and applies it on every
worker in one call (all ranks or none): between two engine steps with no pause (``inflight``),
or with the engine paused, requests kept and caches emptied, and resumed whatever happened
(``pause``). Then it labels the served weight version. A version already served is a no-op (no
pause); an older one is refused by the workers. Updates never overlap: push requests and the
follower (:mod:`deltasync.server.follower`) take turns on one lock.

The flow drives the engine only through :class:`deltasync.server.seam.Engine` and imports no vLLM.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Literal

from deltasync.protocol import (
    MAX_POLL_S,
    UPDATE_MODES,
    ApplyCall,
    BeginCall,
    StatusCall,
    UpdateAnswer,
    UpdateMode,
    WorkerStatus,
    check_update_mode,
    update_tag,
)

from .metrics import Metrics
from .seam import Engine
from .token_versions import TokenVersionLog

__all__ = ["UpdateFlow", "UpdateOutcome", "VersionedFlow", "served_by"]

logger = logging.getLogger(__name__)

#: How often the flow asks the workers whether a staged version is ready: first after this,
#: then twice as long each time up to MAX_POLL_S (each ask is a call between two engine steps).
_POLL_S = 0.02


@dataclass(frozen=True, kw_only=True)
class UpdateOutcome:
    """What :meth:`UpdateFlow.bring_to` did."""

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


class VersionedFlow:
    """What every update flow of a server shares (the full model's, :class:`UpdateFlow`, and
    the adapters', ``vllm_ext._lora.AdapterFlow``): the engine it drives, the server's token,
    one lock that every update holds, so that none overlaps another, and one version order."""

    def __init__(self, engine: Engine, *, token: str | None) -> None:
        self.engine = engine
        self.token = token
        self.lock = asyncio.Lock()
        """Held by every update, so none overlaps another."""

    @staticmethod
    def order(version: int, served: int | None) -> Literal["served", "older", "newer"]:
        """Where ``version`` stands against the version served: "served" (the update is a
        no-op), "older" or "newer" (also when none is served yet)."""
        if served is None:
            return "newer"
        return "served" if version == served else "older" if version < served else "newer"


class UpdateFlow(VersionedFlow):
    """The one update flow of an API-server process (see the module)."""

    def __init__(
        self, engine: Engine, *, token: str | None, update_mode: UpdateMode = "pause", metrics: Metrics | None = None
    ) -> None:
        super().__init__(engine, token=token)
        self.update_mode = check_update_mode(update_mode, "update mode")
        """The server's mode, for follow mode and for pushes that name none."""
        self.served: int | None = None
        """The version every worker serves (None before the first update)."""
        self.last_update_at: float | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.tokens = TokenVersionLog()
        """Where each version began in each tracked request (every apply goes through it)."""
        self.tokens.hook(engine)
        self.metrics = metrics if metrics is not None else Metrics()
        """This flow's metrics (exposed on ``/metrics`` while the server runs)."""

    async def bring_to(
        self,
        version: int,
        auth: str | None = None,
        *,
        origin: str = "push",
        mode: str | None = None,
        pointer: bytes | None = None,
    ) -> UpdateOutcome:
        """Stage ``version`` while generating, then apply it on every worker: between two engine
        steps with no pause (``mode="inflight"``), or paused with the caches emptied ("pause");
        label it, and resume. ``version`` and ``auth`` were checked where they entered
        (:meth:`deltasync.protocol.VersionRequest.parse`); the workers check the tag.
        ``pointer``: the committed pointer's bytes where the caller read them already (the
        follower), handed to the workers so that none reads it again."""
        start = time.perf_counter()
        mode = mode or self.update_mode
        if mode not in UPDATE_MODES:
            return UpdateOutcome(version=-1, ok=False, status=400,
                                 error=f"mode must be one of {', '.join(UPDATE_MODES)}, got {mode!r}")  # fmt: skip
        async with self.lock:
            if auth is None and self.token is not None and origin == "follow":
                auth = update_tag(self.token, version)  # the follower acts for the server itself
            # One call into the workers says what they serve and starts staging (or finds the
            # version staged already): each call waits for an engine step to end.
            workers = await self._begin(BeginCall(version=version, auth=auth, pointer=pointer))
            served = served_by(workers)
            self.served = served
            # An older version goes on to the workers, which refuse it in their own words.
            if self.order(version, served) == "served":
                return UpdateOutcome(version=version, ok=True, noop=True, seconds=time.perf_counter() - start)
            outcome = await self._stage_and_apply(ApplyCall(version=version, auth=auth), mode, workers)
            outcome = replace(outcome, seconds=time.perf_counter() - start)
            if outcome.ok:
                self.served = outcome.version
                self.last_update_at = time.time()
                self.metrics.record_update(outcome, self.served)
            else:
                self.metrics.failures.inc()
                logger.warning("deltasync: %s update to version %s failed: %s", origin, version, outcome.error)
            return outcome

    async def _stage_and_apply(self, call: ApplyCall, mode: UpdateMode, workers: list[WorkerStatus]) -> UpdateOutcome:
        version = call.version
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
            failed = await self._wait_staged(version)
            if failed is not None:
                # The version cannot be staged (a bad file, a hostile pointer): nothing is paused.
                return UpdateOutcome(version=version, ok=False, error=failed, status=500)
        # A refused staging (a wrong tag, a version not committed or older than served) goes on
        # to the apply, which refuses it in the workers' own words before it writes anything.
        if mode == "inflight":
            return await self._apply_inflight(call)
        outcome = await self._apply_paused(call)
        return replace(outcome, note=note)

    async def _apply_inflight(self, call: ApplyCall) -> UpdateOutcome:
        """The in-place write as one call between two engine steps: no forward pass runs on any
        rank meanwhile, and running requests keep their KV. New requests are salted with the
        version they are admitted at, so none reuses the prefix cache of older weights (see
        :meth:`deltasync.server.seam.Engine.salt`)."""
        version = call.version
        try:
            results, failed_one = await self._apply_and_label(call)
        except Exception as exc:  # noqa: BLE001  (the worker's own message names what was wrong)
            return UpdateOutcome(version=version, ok=False, error=str(exc), status=500, mode="inflight")
        # Nothing pauses (paused_s 0). The engine does not step while the write runs: each
        # worker's apply_s is that standstill. The request's own wall time is longer: each
        # call waits for the engine step in progress, which goes on generating.
        if failed_one is not None:
            return UpdateOutcome(version=version, ok=False, error=failed_one.error, status=500, mode="inflight")
        return UpdateOutcome(version=version, ok=True, results=results, mode="inflight")

    async def _apply_and_label(self, call: ApplyCall) -> tuple[tuple[UpdateAnswer, ...], UpdateAnswer | None]:
        """Apply on every worker and label the served version; the answers, and the first
        worker that reports a failure without raising (only the last worker raises)."""
        results = tuple(call.answers(await self.tokens.apply(self.engine, call)))
        failed_one = next((r for r in results if r.error), None)
        if failed_one is None:
            await self.engine.label(call.version)
        return results, failed_one

    async def _apply_paused(self, call: ApplyCall) -> UpdateOutcome:
        version = call.version
        paused = False
        pause_start = time.perf_counter()
        try:
            self._resumed.clear()
            await self.engine.pause()
            paused = True
            results, failed_one = await self._apply_and_label(call)
        except Exception as exc:  # noqa: BLE001  (the worker's own message names what was wrong)
            status = 500 if paused else 503
            message = str(exc) if paused else f"pausing the server failed ({type(exc).__name__}: {exc})"
            return UpdateOutcome(version=version, ok=False, error=message, status=status)
        finally:
            if paused:
                await self.engine.resume()
            self._resumed.set()
            paused_s = time.perf_counter() - pause_start
        if failed_one is not None:  # a worker reported an error without raising: never a success
            return UpdateOutcome(version=version, ok=False, error=failed_one.error, status=500, paused_s=paused_s)
        return UpdateOutcome(version=version, ok=True, paused_s=paused_s, results=results)

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

    async def _begin(self, call: BeginCall) -> list[WorkerStatus]:
        """Every worker's status, after it was asked to stage the version (``call``): each
        status's ``prefetch`` is the answer to that (None where the call failed)."""
        try:
            answers = await self.engine.call_workers(call)
        except Exception:  # noqa: BLE001  (a worker that cannot answer: the apply reports it)
            return [dataclasses.replace(w, prefetch=None) for w in await self.workers()]
        return call.answers(answers)

    async def workers(self) -> list[WorkerStatus]:
        """Every worker's typed status."""
        call = StatusCall()
        return call.answers(await self.engine.call_workers(call))

    async def admitted(self) -> int | None:
        """The version a request admitted now is served by (waits out an update's pause, and a
        weight change made through the engine's own routes until the served version is known again)."""
        await self._resumed.wait()
        return self.served

    @contextlib.asynccontextmanager
    async def outside_update(self, *, counted: bool = False) -> AsyncIterator[None]:
        """Around a request that may change the weights behind the flow (the engine's own
        weight-update routes, ``deltasync_apply`` called directly): no request is admitted until
        it is over and the served version has been read back from the workers, so no request is
        admitted (and salted) at an older version than the weights it runs on. ``counted``: the
        apply went through :attr:`tokens` (else a new version's token starts are unknown)."""
        async with self.lock:
            self._resumed.clear()
            before = self.served
            try:
                yield
            finally:
                try:
                    self.served = served_by(await self.workers())
                    if not counted and self.served is not None and (before is None or self.served > before):
                        self.tokens.note_unknown(self.served)
                    self.metrics.served.set(-1 if self.served is None else self.served)
                except Exception as exc:  # noqa: BLE001
                    logger.warning("deltasync: cannot read the served version back: %s", exc)
                self._resumed.set()


def served_by(workers: list[WorkerStatus]) -> int | None:
    """The lowest version any worker serves (None if any serves none)."""
    versions = [w.version for w in workers]
    if not versions or any(v is None for v in versions):
        return None
    return min(v for v in versions if v is not None)

