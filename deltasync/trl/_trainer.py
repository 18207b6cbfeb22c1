"""``AsyncGRPOTrainer(delta_sync=...)``: TRL's async GRPO trainer with weights shipped as deltas.

Everything but the weight sync is TRL's. Each sync publishes a version into the bucket while
vLLM keeps generating, lets the servers download and decode it (still generating), and only
then asks them to pause, swap the new weights in and resume. The version TRL uses for
staleness is the version the servers report serving: a server that failed to apply does not
advance it.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trl.experimental.async_grpo import AsyncGRPOConfig as _TRLAsyncGRPOConfig
from trl.experimental.async_grpo import AsyncGRPOTrainer as _TRLAsyncGRPOTrainer
from trl.experimental.async_grpo.async_rollout_worker import (
    _AsyncRolloutLoop as _TRLLoop,
)

from ..control.client import BaseRolloutClient, RolloutClient, ServerResult, UpdateReport
from ..errors import ConfigError
from ..trainer.publisher import DeltaPublisher, PublishFuture, PublishResult
from ._config import DeltaSyncConfig
from ._cpu_compat import async_grpo_cpu_patches, bf16_training_available, has_cuda
from ._lora import choose_peft_sync, start_peft_sync
from ._rollout import drain_on_stop
from ._token_lag import TokenLagQueue, VersionedRolloutLoop

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "DeltaSyncConfig"]

logger = logging.getLogger("deltasync.trl")


@dataclass
class AsyncGRPOConfig(_TRLAsyncGRPOConfig):
    """TRL's ``AsyncGRPOConfig``, except that where bf16 training is unavailable (no bf16-capable
    accelerator, see :func:`~deltasync.trl.bf16_training_available`) ``bf16=True`` (TRL's
    default) becomes fp32 training with a warning, instead of transformers' refusal. Anywhere
    bf16 is available, CUDA, XPU or MPS alike, ``bf16`` is left as given."""

    def __post_init__(self) -> None:
        wants_bf16 = self.bf16 is True or (self.bf16 is None and not self.fp16)  # type: ignore[has-type]  # None: TRL's default, True
        if wants_bf16 and not self.use_cpu and not bf16_training_available():
            warnings.warn(
                "AsyncGRPOConfig: bf16=True needs a bf16-capable accelerator and none is available here; "
                "training in fp32 instead (bf16=False). Pass bf16=False to silence this, or use_cpu=True "
                "for bf16 autocast on the CPU.",
                UserWarning,
                stacklevel=3,
            )
            self.bf16 = False
        super().__post_init__()


class _DeltaWeightTransfer:
    """TRL's weight-transfer hooks, for a trainer whose sync is :meth:`AsyncGRPOTrainer._sync_weight_merged`.

    TRL calls ``init_weight_transfer`` at train begin and ``destroy`` at the end; ``pause`` /
    ``send_weights`` / ``resume`` are never reached because the trainer overrides the sync.
    """

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer

    def init_weight_transfer(self) -> None:
        # TRL calls this on the main process only; the publisher is built by the first sync,
        # which every process runs (building it is collective with several processes).
        pass

    def pause(self) -> None:  # pragma: no cover - the overridden sync never calls it
        raise RuntimeError("delta sync pauses servers itself")

    def send_weights(self, iterator: Any) -> None:  # pragma: no cover
        raise RuntimeError("delta sync publishes weights itself")

    def resume(self) -> None:  # pragma: no cover
        raise RuntimeError("delta sync resumes servers itself")

    def destroy(self) -> None:
        self.trainer._stop_delta_sync()


class AsyncGRPOTrainer(_TRLAsyncGRPOTrainer):
    """TRL's ``AsyncGRPOTrainer``, with ``delta_sync=True`` (or a :class:`DeltaSyncConfig`) to ship
    weights as sparse bf16 deltas through a bucket instead of NCCL.

    On a machine without CUDA it also swaps TRL's flash-attention-only training attention for an
    exact pure-PyTorch one and turns off the MFU metrics that need a GPU.
    """

    def __init__(self, *args: Any, delta_sync: bool | DeltaSyncConfig = False, **kwargs: Any) -> None:
        if delta_sync is True:
            delta_sync = DeltaSyncConfig()
        elif delta_sync is False:
            delta_sync = None  # type: ignore[assignment]
        elif not isinstance(delta_sync, DeltaSyncConfig):
            raise ConfigError(f"delta_sync must be True, False or a DeltaSyncConfig, got {type(delta_sync).__name__}")
        if delta_sync is not None and kwargs.get("weight_transfer") is not None:
            raise ConfigError("delta_sync and weight_transfer both set: delta sync is a weight transfer; pass one")
        self._delta_config: DeltaSyncConfig | None = delta_sync  # type: ignore[assignment]
        self._publisher: DeltaPublisher | None = None
        self._client: BaseRolloutClient | None = None
        self.delta_history: list[dict[str, Any]] = []
        """One record per sync: version, kind, bytes, changed fraction, upload and paused seconds."""
        self._sync_pool: ThreadPoolExecutor | None = None
        self._sync_job: tuple[Future[dict[str, Any]], float] | None = None
        if delta_sync is not None:
            kwargs["weight_transfer"] = _DeltaWeightTransfer(self)
        if has_cuda():
            super().__init__(*args, **kwargs)
        else:
            with async_grpo_cpu_patches():
                super().__init__(*args, **kwargs)
        if getattr(self, "rollout_worker", None) is not None:  # the main process's
            drain_on_stop(self.rollout_worker)  # so the run ends when training does, not 15 s later
            if delta_sync is not None and getattr(self.rollout_worker, "_loop_cls", None) is _TRLLoop:
                # Its child tags every token with the version that sampled it (started at train begin).
                self.rollout_worker._loop_cls = VersionedRolloutLoop
        self._peft_sync: str | None = None
        if delta_sync is not None:
            self._peft_sync = choose_peft_sync(self, delta_sync)  # type: ignore[arg-type]  # None unless a PEFT model

    # ------------------------------------------------------------------ lifecycle

    def _start_delta_sync(self) -> None:
        # Called by the first sync on every process: publishing is collective, talking to servers is not.
        if self._publisher is not None:
            return
        config = self._delta_config
        assert config is not None
        bucket = config.bucket or os.path.join(self.args.output_dir, "deltasync-bucket")
        urls = config.server_urls or [self.args.vllm_server_base_url]
        token = config.server_token()
        if self._peft_sync is not None:
            self._publisher, self._client = start_peft_sync(
                self, self._peft_sync, bucket, urls, token, config, config.publish
            )
            logger.info("delta sync: bucket %s, servers %s", self._publisher.store.url, ", ".join(urls))
            return
        self._publisher = DeltaPublisher(
            bucket, self.accelerator.unwrap_model(self.model), self.optimizer, options=config.publish
        )
        if self.accelerator.is_main_process:
            self._client = RolloutClient(urls, token=token, timeout=config.timeout)
            layout = self._publisher.detector.layout
            logger.info(
                "delta sync: bucket %s, servers %s%s", self._publisher.store.url, ", ".join(urls),
                "" if layout is None else f", {layout.description} ({layout.parts} file(s) per version)",
            )

    def _stop_delta_sync(self) -> None:
        try:
            self._finish_sync_job()
        finally:
            if self._sync_pool is not None:
                self._sync_pool.shutdown(wait=True)
            if self._publisher is not None:
                self._publisher.close()
            if self._client is not None:
                self._client.close()  # its open connections; a later call would open new ones

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            if not self.accelerator.is_main_process:  # TRL calls destroy() on the main process only
                self._stop_delta_sync()

    def get_train_dataloader(self) -> Any:
        queue = getattr(self, "rollout_queue", None)
        if self._delta_config is None or queue is None:
            return super().get_train_dataloader()
        # TRL's dataset reads samples through this: their tokens are logged by lag and masked
        # beyond max_token_lag (see deltasync.trl._token_lag).
        self.rollout_queue = TokenLagQueue(queue, lambda: self.model_version, self._metrics["train"],
                                           max_staleness=self.args.max_staleness,
                                           max_token_lag=self._delta_config.max_token_lag)  # fmt: skip
        try:
            return super().get_train_dataloader()
        finally:
            self.rollout_queue = queue

    @property
    def delta_publisher(self) -> DeltaPublisher | None:
        """The publisher (exists from train begin on, on every process)."""
        return self._publisher

    @property
    def rollout_client(self) -> BaseRolloutClient | None:
        return self._client

    # ------------------------------------------------------------------ the sync

    def _sync_weight_merged(self, t0: float) -> tuple[float, float, float]:
        if self._delta_config is None:
            return super()._sync_weight_merged(t0)
        self.accelerator.wait_for_everyone()
        t_barrier = time.time()
        self._start_delta_sync()
        assert self._publisher is not None
        main = self.accelerator.is_main_process
        if self._delta_config.background:
            if main:
                self._finish_sync_job()  # one version in flight: the one before must be served first
            # Collective with several processes: every rank captures its changes; each writes its
            # own part in the background and rank 0 commits.
            future = self._publisher.submit()
            if main:
                if self._sync_pool is None:
                    self._sync_pool = ThreadPoolExecutor(1, thread_name_prefix="deltasync-sync")
                job = self._sync_pool.submit(self._serve_version, future, time.time(), synced_at=t0)
            t_end = time.time()
            if main:
                self._sync_job = (job, t_end - t0)
                self._metrics["train"]["sync/blocked_s"].append(t_end - t0)
            # TRL turns these marks into perf/weight_sync_{pause,barrier,transfer}_s: the loop was
            # not paused, it waited at the barrier, then for the capture.
            return t0, t_barrier, t_end
        # Blocking: collective with several processes, each rank writes its part, rank 0 commits.
        result = self._publisher.publish()  # servers keep generating meanwhile
        if main:
            t_published = time.time()
            record = self._serve_version(result, t_barrier, published_at=t_published, synced_at=t0)
            record["blocked_s"] = time.time() - t0
            self._add_record(record)
            self._metrics["train"]["sync/blocked_s"].append(record["blocked_s"])
            self.accelerator.wait_for_everyone()
            # TRL turns these marks into perf/weight_sync_{pause,barrier,transfer}_s: report the
            # servers' paused time, the barrier, and the upload.
            t_pause = t0 + record["paused_s"]
            t_bar = t_pause + (t_barrier - t0)
            return t_pause, t_bar, t_bar + (t_published - t_barrier)
        self.accelerator.wait_for_everyone()
        now = time.time()
        return now, now, now

    def _serve_version(
        self, published: PublishFuture | PublishResult, started: float, *, synced_at: float,
        published_at: float | None = None,
    ) -> dict[str, Any]:
        """Wait for the version's commit, let the servers stage it while generating, then update
        them; move ``model_version`` to what they report serving. Main process only; in the
        background it runs in its own thread, one version at a time."""
        assert self._client is not None and self._delta_config is not None
        result = published if isinstance(published, PublishResult) else published.result()
        t_published = published_at or time.time()
        if self._delta_config.follow:
            # The servers move by themselves: wait until they report the version, never assume it.
            t_staged = time.time()
            assert isinstance(self._client, RolloutClient)  # adapter mode refuses follow
            states = self._client.wait_served(result.version, timeout=self._delta_config.timeout)
            report = UpdateReport(version=result.version, results=[
                ServerResult(url=s.url, ok=s.ok and s.version is not None and s.version >= result.version,
                             version=s.version, fingerprint=s.fingerprint,
                             error=s.error or (None if s.version is not None and s.version >= result.version
                                               else f"still serving {s.version} (follow: {s.follow})"))
                for s in states.values()
            ])  # fmt: skip
        else:
            if self._delta_config.prefetch and isinstance(self._client, RolloutClient):
                # Servers download and decode while still generating; pause only once staged.
                # (Adapter versions load while the servers generate: nothing to stage.)
                self._client.prefetch(result.version)
                self._client.wait_prefetched(result.version, timeout=self._delta_config.timeout)
            t_staged = time.time()
            if isinstance(self._client, RolloutClient):
                report = self._client.update(result.version, mode=self._delta_config.update_mode)
            else:
                report = self._client.update(result.version)
        record = self._make_record(result, report, t_published - started, t_staged - t_published)
        record["total_s"] = time.time() - synced_at  # from the sync's start until the servers answered
        served = [r.version for r in report.results if r.version is not None]
        if served:
            # What every server serves at least: samples are tagged with it for staleness.
            self.model_version = min(served)
        if self.rollout_worker:
            self.rollout_worker.update_model_version(self.model_version)
        return record

    def _finish_sync_job(self) -> None:
        """Wait for the background sync in flight and log it; a failed publish is raised here
        (in the training loop), as a blocking sync would have raised it."""
        pending, self._sync_job = self._sync_job, None
        if pending is not None:
            job, blocked_s = pending
            record = job.result()
            record["blocked_s"] = blocked_s
            self._add_record(record)

    def _make_record(self, result: PublishResult, report: UpdateReport, upload_s: float, prefetch_s: float) -> dict[str, Any]:
        for r in report.results:
            if not r.ok:
                logger.warning("delta sync: %s did not apply version %s: %s", r.url, result.version, r.error)
        return {
            "version": result.version,
            "kind": result.kind,
            "nbytes": result.nbytes,
            "changed_fraction": result.changed_fraction,
            "upload_s": upload_s,
            "prefetch_s": prefetch_s,
            "paused_s": report.paused_s,
            "capture_s": result.blocked_s,
            "anchor_scheduled": result.anchor_scheduled,
            "served": [r.version for r in report.results],
            "failed": {r.url: r.error for r in report.results if not r.ok},
            "fingerprint": result.fingerprint,
            **self._view_record(result),
        }

    def _view_record(self, result: PublishResult) -> dict[str, Any]:
        """The quantized view's part of a sync's record (nothing without a view)."""
        view = None if self._delta_config is None else self._delta_config.view
        if view is None or self._publisher is None:
            return {}
        return {"view": view, "view_nbytes": result.view_nbytes.get(view), "view_fingerprint": self._publisher.view_fingerprint(view)}

    def _add_record(self, record: dict[str, Any]) -> None:
        """Log a sync's record (training thread only: TRL reads and clears the metrics there)."""
        metrics = self._metrics["train"]
        metrics["delta/changed_fraction"].append(record["changed_fraction"])
        metrics["delta/bytes"].append(float(record["nbytes"]))
        metrics["delta/kind"].append(1.0 if record["kind"] == "anchor" else 0.0)
        metrics["sync/upload_s"].append(record["upload_s"])
        metrics["sync/prefetch_s"].append(record["prefetch_s"])
        metrics["sync/paused_s"].append(record["paused_s"])
        metrics["sync/version"].append(float(record["version"]))
        metrics["sync/failed_servers"].append(float(len(record["failed"])))
        self.delta_history.append(record)
