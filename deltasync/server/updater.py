"""One worker's update flow, shared by the weight-transfer engine and the worker extension.

Each worker process of an engine (one per tensor/pipeline-parallel rank) has its own
:class:`WorkerUpdater`, which brings its model to committed versions of the bucket fixed at
start-up, through one of two update targets (:mod:`.target`): the live weights written in
place, or a host copy from which the engine's layerwise reload rebuilds what changed. The
updater reaches its engine only through the worker seam (:class:`~deltasync.server.seam.Worker`). An update is
two-phase: stage and check everything (auth tag, version, files, fingerprints, names,
shapes) while the model is untouched, agree across ranks, then write in one step and agree
again before anything is committed. A failure before the write changes nothing; a failure
during it puts every rank back.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any


from deltasync import ConfigError, DeltaReceiver, DeltaSyncError, FormatError, VersionError
from deltasync.errors import UpdateError
from deltasync.protocol import (
    BUCKET_ENV,
    TEST_HOOKS_ENV,
    ApplyCall,
    Heal,
    PrefetchCall,
    PrefetchState,
    UpdateAnswer,
    WorkerStatus,
    check_update_tag,
)
from deltasync.views.serving import resolve_view

from .checkpoint import ServedCheckpoint
from .config import ServerConfig
from .cpus import Background, BackgroundPolicy, shorten_switch_interval
from .live_target import LiveTarget, plan_in_place
from .reload_target import ReloadTarget
from .seam import Worker
from .target import Refused, Staged, UpdateTarget, agree

__all__ = ["BUCKET_ENV", "TEST_HOOKS_ENV", "ServerConfig", "UpdateError", "WorkerUpdater", "updater_for"]

logger = logging.getLogger(__name__)


class _Prefetch:
    """A background staging of one version."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.state = "running"
        self.error: str | None = None
        self.staged: Staged | None = None
        self.thread: threading.Thread | None = None
        self.background = Background(cpus=None, nice=0)
        """Where and at what priority the thread stages (set when it starts)."""

    def describe(self) -> PrefetchState:
        staged, where = self.staged, self.background
        return PrefetchState(version=self.version, state=self.state, error=self.error,
                             kind=None if staged is None else staged.kind,
                             nbytes=0 if staged is None else staged.nbytes,
                             stage_s=0.0 if staged is None else staged.seconds,
                             cpus=where.cpus, nice=where.nice, idle=where.idle)  # fmt: skip


class WorkerUpdater:
    """Applies committed versions from the bucket to one worker's model.

    Args:
        worker: the worker's engine (:class:`~deltasync.server.seam.Worker`; vLLM's:
            :class:`vllm_ext._worker.VllmWorker`).
        config: bucket and token; default: read from the environment now.
    """

    def __init__(self, worker: Worker, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig.from_env()
        self.background = BackgroundPolicy(self.config.staging_cpus, self.config.staging_nice)
        """Where and at what priority this worker's background threads run."""
        shorten_switch_interval()
        self.worker = worker
        self.model = worker.model
        self.rank = worker.rank
        self.checkpoint: ServedCheckpoint = worker.checkpoint()
        self.view = resolve_view(self.config.view, self.checkpoint.view, self.checkpoint.path)
        """The quantized view followed (None: the bf16 chain)."""
        self.last_rank = worker.is_last_rank()
        self.last: UpdateAnswer | None = None
        self.last_error: dict[str, Any] | None = None
        self.last_heal: Heal | None = None
        """The last version built from an anchor because a delta file was corrupt or missing."""
        self._receiver: DeltaReceiver | None = None
        self._prefetch: _Prefetch | None = None
        live, self.fallback = plan_in_place(worker, self.checkpoint, self.background)
        """Checkpoint names rebuilt through the engine's layerwise reload, and why."""
        self.target: UpdateTarget[Any] = (
            ReloadTarget(worker, self.checkpoint) if live is None
            else LiveTarget(live, self.checkpoint, self.rank)
        )  # fmt: skip

    @property
    def mode(self) -> str:
        """"in-place" (every delta is written into the live weights) or "reload" (some or all
        parameters, listed in ``fallback``, are rebuilt through vLLM's layerwise reload)."""
        return self.target.mode

    # ------------------------------------------------------------------ public

    def status(self) -> dict[str, Any]:
        """What this worker serves: a :class:`~deltasync.protocol.messages.WorkerStatus` as plain data
        (the answer of ``deltasync_status``).

        ``fingerprint`` is that of the weights served: in "in-place" mode hashed from the live
        weights (summed over every rank), in "reload" mode that of the copy they were loaded from.
        """
        self.target.settle()
        target = self.target
        version, fingerprint = target.served()
        return WorkerStatus(
            rank=self.rank,
            # Weights that changed behind deltasync's back are no version at all.
            version=None if target.tainted else version,
            fingerprint=fingerprint,
            mode=target.mode,
            fallback=tuple(sorted(self.fallback)),
            tainted=target.tainted,
            host_copy_bytes=target.host_copy_bytes,
            bucket=self.config.bucket,
            auth=self.config.token is not None,
            checkpoint=self.checkpoint.path,
            last_update=self.last,
            last_error=None if self.last_error is None else dict(self.last_error),
            prefetch=None if self._prefetch is None else self._prefetch.describe(),
            view=self.view,
            last_heal=self.last_heal,
        ).to_json()

    def prefetch(self, version: object, auth: object = None) -> dict[str, Any]:
        """Start staging ``version`` in a background thread; the engine keeps generating.
        Returns a :class:`~deltasync.protocol.messages.PrefetchState` as plain data (the answer
        of :class:`~deltasync.protocol.PrefetchCall`); a refusal is raised by the last worker."""
        self._forget_offer()
        return self._start_prefetch(version, auth, raise_refusal=True).to_json()

    def _start_prefetch(self, version: object, auth: object, *, raise_refusal: bool) -> PrefetchState:
        """:meth:`prefetch`, its arguments parsed here, where the call enters the worker."""
        self.target.settle()
        checked: int | None = None
        try:
            request = PrefetchCall.parse(version, auth)
            version = checked = request.version
            check_update_tag(self.config.token, version, request.auth)
            self._check_not_older(version)
            job = self._prefetch
            if job is not None and job.version == version and job.state != "failed":
                # Already staging or staged, after the same checks: the call returns without
                # reading the bucket (it runs between two engine steps).
                return job.describe()
            receiver = self._open_receiver()
            latest = receiver.latest()
            if version > latest:
                raise VersionError(
                    f"version {version} is not committed in {receiver.store.url} (the newest is {latest})"
                )
        except DeltaSyncError as exc:
            return self._refuse_prefetch(version, checked, f"deltasync: prefetch of version {version} refused: {exc}",
                                         raise_refusal)  # fmt: skip
        if job is not None and job.thread is not None and job.thread.is_alive():
            return self._refuse_prefetch(version, version, f"deltasync: prefetch of version {version} refused: version "
                                                           f"{job.version} is still being prefetched; update to it or "
                                                           "wait until it is ready", raise_refusal)  # fmt: skip
        job = _Prefetch(version)
        if self.target.served()[0] == version:
            job.state = "applied"
            return job.describe()
        # Not a daemon (see ``inplace.release_later``): an exit waits for the prefetch, whose
        # reads end by themselves, rather than abort in torch's destructors.
        job.thread = threading.Thread(target=self._run_prefetch, args=(job, receiver), name=f"deltasync-prefetch-{version}")
        self._prefetch = job
        job.thread.start()
        return job.describe()

    def begin(self, version: object, auth: object = None, pointer: object = None) -> dict[str, Any]:
        """:meth:`prefetch` and :meth:`status` in one call (:class:`~deltasync.protocol.BeginCall`):
        the status, whose ``prefetch`` is this call's answer (``"refused"`` with the reason where
        the version or tag is wrong; this call never raises for that).

        The update flow starts with it: one call into the workers, between two engine steps,
        tells it what is served and whether ``version`` is staged already. ``pointer``: the
        bytes of the committed pointer as the follower just read them, so that no worker reads
        it again (:meth:`deltasync.DeltaReceiver.offer_pointer`); bytes that do not parse are
        dropped, and the worker reads the bucket's pointer itself."""
        self._forget_offer()
        if pointer is not None and self.config.bucket:
            try:
                if not isinstance(pointer, bytes):
                    raise FormatError(f"the pointer offered is {type(pointer).__name__}, not bytes")
                self._open_receiver().offer_pointer(pointer)
            except DeltaSyncError as exc:
                logger.warning("deltasync: the pointer the follower read is not used (%s); reading the bucket's", exc)
        job = self._start_prefetch(version, auth, raise_refusal=False)
        return {**self.status(), "prefetch": job.to_json()}

    def update(self, version: object, auth: object = None) -> dict[str, Any]:
        """Stage, check and apply ``version``; returns what was done (a
        :class:`~deltasync.protocol.messages.UpdateAnswer` as plain data: the answer of
        :class:`~deltasync.protocol.ApplyCall`, whose arguments are parsed here).

        On any failure the served weights and version stay those from before the call, and
        :class:`UpdateError` is raised (by the last worker only: see :meth:`_fail`).
        """
        target = self.target
        target.settle()
        start = time.perf_counter()
        staged: Staged | None = None
        error: str | None = None
        prefetched = False
        self._forget_offer()
        checked: int | None = None
        try:
            request = ApplyCall.parse(version, auth)
            version = checked = request.version
            check_update_tag(self.config.token, version, request.auth)
            receiver = self._open_receiver()
            self._check_not_older(version)
            staged = self._take_prefetched(version)
            prefetched = staged is not None
            if staged is None:
                staged = target.stage(version, receiver)
        except Exception as exc:  # noqa: BLE001  (every worker must reach the agreement below)
            error = f"({type(exc).__name__}): {exc}"
        # No worker may touch its model unless every worker can: the model would end up
        # half old, half new.
        try:
            staged = target.agree(error, staged)
        except Refused as exc:
            return self._fail(version, checked, f"deltasync: update to version {version} {exc}; "
                                                f"still serving {target.served_text()}")  # fmt: skip
        answer = UpdateAnswer(version=staged.version, fingerprint=staged.fingerprint, kind=staged.kind,
                              mode=target.answer_mode, nbytes=staged.nbytes, prefetched=prefetched,
                              stage_s=staged.seconds if prefetched else time.perf_counter() - start,
                              healed=staged.healed)  # fmt: skip
        if staged.kind != "none":
            start = time.perf_counter()
            applied = target.apply(staged)
            error = agree(self.worker.gather, applied.error)
            if error is not None:
                # Every worker puts the previous state back, those whose writes worked too.
                return self._fail(staged.version, staged.version,
                                  f"deltasync: {error}; {target.rollback(staged, applied, error)}")  # fmt: skip
            target.commit(staged, applied)
            if staged.healed is not None:
                self.last_heal = staged.healed
            answer = replace(answer, apply_s=time.perf_counter() - start, changed=applied.changed,
                             sent=applied.sent, extra=applied.extra)  # fmt: skip
        self.last = replace(answer, time=time.time())
        return answer.to_json()

    def verify(self) -> dict[str, Any]:
        """Recompute the served fingerprint in full and compare; in place, a mismatch makes
        the next update load the newest anchor instead of building on these weights."""
        self.target.settle()
        return self.target.verify()

    # ------------------------------------------------------------------ internals

    def _fail(self, version: object, checked: int | None, message: str, *, raising: bool = True) -> dict[str, Any]:
        """Report a failure of the call for ``version`` (as the call named it; ``checked``: the
        version it parsed to, None if it was none): the last worker raises it, the others
        answer with it. ``raising=False`` (a refused ``deltasync_begin``): every worker answers.

        vLLM's multiprocess executor reads the workers' answers in rank order and stops at
        the first error, leaving later workers' answers queued, where the next call would
        read them. Raising only on the last worker keeps every queue drained.
        """
        self.last_error = {"version": version, "error": message, "time": time.time()}
        if not self.last_rank:
            logger.error("%s", message)
        elif raising:
            raise UpdateError(message)
        return UpdateAnswer(version=checked, error=message).to_json()

    def _refuse_prefetch(self, version: object, checked: int | None, message: str, raising: bool) -> PrefetchState:
        self._fail(version, checked, message, raising=raising)
        return PrefetchState(version=checked, state="refused", error=message)

    def _check_not_older(self, version: int) -> None:
        served = self.target.served()[0]
        if served is not None and version < served:
            raise VersionError(f"version {version} is older than the served version {served}")

    def _forget_offer(self) -> None:
        """Drop a pointer offered by an earlier ``begin`` and not used: a call without one reads
        the bucket's."""
        if self._receiver is not None:
            self._receiver.offer_pointer(None)

    def _open_receiver(self) -> DeltaReceiver:
        if self._receiver is None:
            if not self.config.bucket:
                raise ConfigError(
                    f"this server follows no bucket: start it with {BUCKET_ENV}=<bucket URL> "
                    "(the URL the trainer's DeltaPublisher writes to)"
                )
            self._receiver = DeltaReceiver(self.config.bucket, view=self.view)
        return self._receiver

    def _take_prefetched(self, version: int) -> Staged | None:
        job, self._prefetch = self._prefetch, None
        if job is None:
            return None
        if job.thread is not None:
            job.thread.join()  # it reads the served state: never let it overlap an apply
        staged = job.staged
        if (
            staged is None
            or job.version != version
            or (staged.from_version, staged.from_fingerprint) != self.target.served()
        ):
            return None
        return staged

    def _run_prefetch(self, job: _Prefetch, receiver: DeltaReceiver) -> None:
        job.background = self.background.enter()
        try:
            staged = self.target.stage(job.version, receiver)
        except Exception as exc:  # noqa: BLE001  (reported through status; update re-stages)
            job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        job.staged, job.state = staged, "ready"


#: The attribute of a worker's model that holds the worker's updater.
UPDATER_ATTR = "_deltasync_updater"


def updater_for(worker: Worker) -> WorkerUpdater:
    """The updater of ``worker``'s model (one per worker), created on first use and held by the model.

    The worker extension and the "delta" weight-transfer engine of a worker both reach its
    model (the engine is given nothing else), so the model holds the one updater they share:
    one receiver, one served state. Both run on the worker's main thread (vLLM creates the
    engine when the model is loaded and runs every ``collective_rpc`` there), so the first
    use creates it once."""
    model = worker.model
    updater = vars(model).get(UPDATER_ATTR)
    if updater is None:
        updater = WorkerUpdater(worker)
        setattr(model, UPDATER_ATTR, updater)  # a plain attribute: not a parameter, buffer or module
    return updater
