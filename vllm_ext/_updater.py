"""One worker's update logic, shared by the weight-transfer engine and the worker extension.

Each vLLM worker process (one per tensor/pipeline-parallel rank) has its own
:class:`WorkerUpdater`: its own :class:`~deltasync.DeltaReceiver` (an exact HF-named bf16
copy of the weights) following the bucket fixed at start-up, and the served checkpoint's
parameter names and shapes. An update is two-phase: stage and check everything (auth tag,
version, files, fingerprints, names, shapes) while the model is untouched, then reload the
changed modules in one step through vLLM's loaders (which shard for tensor parallelism),
and only then commit the receiver. A failure before the reload changes nothing.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch

from deltasync import (
    ConfigError,
    DeltaReceiver,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    StagedUpdate,
    VersionError,
)
from deltasync._auth import TOKEN_ENV, check_update_tag
from deltasync._errors import UpdateError

from ._checkpoint import read_checkpoint_shapes, resolve_model_dir
from ._inplace import InPlaceState, LiveStaged, release_freed_memory, release_later, wait_for_device
from ._plain_gemm import PLAIN_GEMM_ENV, plain_gemm_enabled
from ._reload import reload_groups, reload_weights
from ._weight_map import discover

__all__ = ["BUCKET_ENV", "TEST_HOOKS_ENV", "ServerConfig", "UpdateError", "WorkerUpdater", "updater_for"]

logger = logging.getLogger(__name__)

#: The environment variable naming the bucket a server follows.
BUCKET_ENV = "DELTASYNC_BUCKET"
#: "1" enables the test-only RPCs (changing a live element, failing after a write).
TEST_HOOKS_ENV = "DELTASYNC_TEST_HOOKS"

# Checkpoint tensors that are not parameters: vLLM skips them when loading, and a trainer's
# state never holds them.
_NOT_PARAMETERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """What a server reads from its environment once, at start-up."""

    bucket: str | None
    """The bucket it follows (``DELTASYNC_BUCKET``); no request can name another."""
    token: str | None
    """The shared secret (``DELTASYNC_TOKEN``); None leaves updates unauthenticated."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ServerConfig:
        return cls(bucket=environ.get(BUCKET_ENV) or None, token=environ.get(TOKEN_ENV) or None)


class _Prefetch:
    """A background staging of one version."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.state = "running"
        self.error: str | None = None
        self.staged: StagedUpdate | None = None
        self.thread: threading.Thread | None = None

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "state": self.state, "error": self.error}
        if self.staged is not None:
            out.update(kind=self.staged.kind, nbytes=self.staged.nbytes, stage_s=self.staged.seconds)
        return out


class WorkerUpdater:
    """Applies committed versions from the bucket to one worker's model.

    Args:
        model: the worker's model (``worker.model_runner.get_model()``).
        vllm_config: the worker's ``VllmConfig``.
        config: bucket and token; default: read from the environment now.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any, config: ServerConfig | None = None) -> None:
        self.config = config or ServerConfig.from_env()
        self.model = model
        self.vllm_config = vllm_config
        model_config = vllm_config.model_config
        self.packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
        text_config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
        self.tied = bool(getattr(text_config, "tie_word_embeddings", False))
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.expected, self.checkpoint = self._read_checkpoint(model_config)
        self.last_rank = _is_last_rank()
        self.last: dict[str, Any] | None = None
        self.last_error: dict[str, Any] | None = None
        self._receiver: DeltaReceiver | None = None
        self._prefetch: _Prefetch | None = None
        self._fail_after_write = False
        self._anchor_timing: dict[str, float] = {}
        self.fallback: dict[str, str] = {}
        self.live: InPlaceState | None = self._plan_in_place()

    @property
    def mode(self) -> str:
        """"in-place" (every delta is written into the live weights) or "reload" (some or all
        parameters, listed in ``fallback``, are rebuilt through vLLM's layerwise reload)."""
        return "in-place" if self.live is not None and not self.live.host else "reload"

    # ------------------------------------------------------------------ public

    def status(self) -> dict[str, Any]:
        """Plain data about what this worker serves (the answer of ``deltasync_status``).

        ``fingerprint`` is that of the weights served: in "in-place" mode hashed from the live
        weights (summed over every rank), in "reload" mode that of the copy they were loaded from.
        """
        self._settle()
        receiver = self._receiver
        live = self.live
        if live is not None:
            # Weights that changed behind deltasync's back are no version at all.
            version, fp = (None if live.tainted else live.version), live.fingerprint
        else:
            version = None if receiver is None else receiver.version
            fp = None if receiver is None else receiver.fingerprint
        return {
            "rank": self.rank,
            "version": version,
            "fingerprint": fp,
            "mode": self.mode,
            "fallback": sorted(self.fallback),
            "tainted": None if live is None else live.tainted,
            "host_copy_bytes": live.host_bytes if live is not None
                               else 0 if receiver is None else sum(t.nbytes for t in receiver.state_dict().values()),
            "bucket": self.config.bucket,
            "auth": self.config.token is not None,
            "checkpoint": self.checkpoint,
            "last_update": None if self.last is None else dict(self.last),
            "last_error": None if self.last_error is None else dict(self.last_error),
            "prefetch": None if self._prefetch is None else self._prefetch.describe(),
        }

    def prefetch(self, version: object, auth: object = None) -> dict[str, Any]:
        """Start staging ``version`` in a background thread; the engine keeps generating."""
        self._settle()
        try:
            version = _check_version(version)
            check_update_tag(self.config.token, version, auth)
            receiver = self._open_receiver()
            latest = receiver.latest()
            if version > latest:
                raise VersionError(
                    f"version {version} is not committed in {receiver.store.url} (the newest is {latest})"
                )
            self._check_not_older(version)
        except DeltaSyncError as exc:
            return self._fail(version, f"deltasync: prefetch of version {version} refused: {exc}")
        job = self._prefetch
        if job is not None and job.version == version and job.state != "failed":
            return job.describe()
        if job is not None and job.thread is not None and job.thread.is_alive():
            return self._fail(version, f"deltasync: prefetch of version {version} refused: version {job.version} "
                                       "is still being prefetched; update to it or wait until it is ready")  # fmt: skip
        job = _Prefetch(version)
        if self._served_state()[0] == version:
            job.state = "applied"
            return job.describe()
        job.thread = threading.Thread(
            target=self._run_prefetch, args=(job, receiver), name=f"deltasync-prefetch-{version}", daemon=True
        )
        self._prefetch = job
        job.thread.start()
        return job.describe()

    def update(self, version: object, auth: object = None) -> dict[str, Any]:
        """Stage, check and apply ``version``; returns what was done (plain data).

        On any failure the served weights and version stay those from before the call, and
        :class:`UpdateError` is raised (by the last worker only: see :meth:`_fail`).
        """
        self._settle()
        if self.live is not None:
            return self._update_live(version, auth)
        start = time.perf_counter()
        staged: StagedUpdate | None = None
        error: str | None = None
        prefetched = False
        try:
            version = _check_version(version)
            check_update_tag(self.config.token, version, auth)
            receiver = self._open_receiver()
            self._check_not_older(version)
            staged = self._take_prefetched(version)  # type: ignore[assignment]
            prefetched = staged is not None
            if staged is None:
                staged = receiver.stage(version)
            self._validate(staged)
        except Exception as exc:  # noqa: BLE001  (every worker must reach the agreement below)
            error = f"({type(exc).__name__}): {exc}"
        # No worker may touch its model unless every worker can: the model would end up
        # half old, half new.
        error = _agree(error)
        if error is not None:
            return self._fail(version, f"deltasync: update to version {version} refused {error}; "
                                       f"still serving {self._served()}")  # fmt: skip
        assert staged is not None
        stage_s = staged.seconds if prefetched else time.perf_counter() - start
        result: dict[str, Any] = {
            "version": staged.version,
            "fingerprint": staged.fingerprint,
            "kind": staged.kind,
            "nbytes": staged.nbytes,
            "prefetched": prefetched,
            "stage_s": stage_s,
            "apply_s": 0.0,
            "changed": 0,
            "sent": 0,
        }
        if staged.kind != "none":
            start = time.perf_counter()
            try:
                result.update(self._reload(staged))
                wait_for_device(self.model.parameters())  # queued CUDA kernels count in apply_s
            except Exception as exc:  # noqa: BLE001
                error = f"loading version {staged.version} into the model failed ({type(exc).__name__}: {exc})"
            error = _agree(error)
            if error is not None:
                # Every worker puts the previous state back, those whose load worked too.
                return self._fail(staged.version, f"deltasync: {error}; {self._restore()}")
            result["apply_s"] = time.perf_counter() - start
            self._open_receiver().apply(staged)
        self.last = {**result, "time": time.time()}
        return result


    # ------------------------------------------------------------------ in-place mode

    def _plan_in_place(self) -> InPlaceState | None:
        """Map the checkpoint onto the live weights; None (reload mode) if any name does not map."""
        from vllm.config import set_current_vllm_config
        from vllm.platforms import current_platform

        reason = None
        if self.expected is None:
            reason = "the served checkpoint's parameter names and shapes are unknown"
        elif current_platform.is_cpu() and not plain_gemm_enabled():
            reason = f"vLLM's CPU build repacks linear weights for its kernels (set {PLAIN_GEMM_ENV}=1 to keep them plain)"
        if reason is not None:
            self.fallback = {name: reason for name in self.expected or {"*": ()}}
            logger.info("deltasync: reload mode: %s", reason)
            return None
        assert self.expected is not None
        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            weight_map = discover(self.model, self.expected)
        fallback: dict[str, str] = {}
        for theirs in _gather(weight_map.fallback):  # every rank decides alike
            fallback.update(theirs)
        names = [n for n in self.expected if n not in weight_map.ignored]
        # A parameter that falls back takes the rest of its vLLM module along: the layerwise
        # reload rebuilds a module only from all of its parts.
        host = reload_groups(sorted(n for n in fallback if n in names), names, self.packed) if fallback else []
        self.fallback = {n: fallback.get(n, "reloaded with the rest of its vLLM module") for n in host}
        if len(host) == len(names):
            name, why = next(iter(sorted(fallback.items())))
            logger.warning("deltasync: reload mode: no parameter can be patched in place (e.g. %s: %s)", name, why)
            return None
        live = InPlaceState(
            self.model, weight_map, _gather, _rank_index(), self._load_dense,
            host={n: self.expected[n] for n in host}, reload=self._reload_host,
            groups=lambda changed: reload_groups(changed, host, self.packed),
        )  # fmt: skip
        if host:
            name, why = next(iter(sorted(fallback.items())))
            logger.warning("deltasync: %d of %d checkpoint tensors fall back to the layerwise reload (e.g. %s: %s); "
                           "the other %d are patched in place", len(host), len(names), name, why,
                           len(names) - len(host))  # fmt: skip
        logger.info("deltasync: in-place mode: %d checkpoint tensors mapped in %.2f s; served fingerprint %s",
                    len(names) - len(host), time.perf_counter() - start, live.fingerprint)  # fmt: skip
        return live

    def _reload_host(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Rebuild whole modules from the host copy of the parameters that fall back."""
        _, partial = reload_weights(self.model, self.vllm_config, iter(weights))
        if partial:
            raise UpdateError(f"modules {', '.join(partial[:5])} were loaded only in part")

    def _load_dense(self, weights: Any) -> None:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():  # type: ignore[arg-type]
            self.model.load_weights(weights)

    def _stage_live(self, version: int, receiver: DeltaReceiver, *, dense: bool = False) -> LiveStaged:
        """Stage in-place: deltas on the served weights, or (catch-up) the newest anchor and
        the deltas after it, decoded in full for a dense load."""
        live = self.live
        assert live is not None
        pointer = receiver.pointer()
        if version > pointer.version:
            raise VersionError(f"version {version} is not committed in {receiver.store.url} (the newest is {pointer.version})")
        self._check_not_older(version)
        own = (
            not dense
            and live.tainted is None
            and pointer.replays_from(live.version, live.fingerprint)
        )
        if own:
            return live.stage_deltas(receiver, pointer, version)
        full = DeltaReceiver(receiver.store).stage(version)  # a transient copy, dropped after the load
        self._validate(full)
        return LiveStaged(
            from_version=live.version,
            from_fingerprint=live.fingerprint,
            version=full.version,
            kind="anchor",
            fingerprint=full.fingerprint,
            names=full.names,
            changed=full.changed,
            nbytes=full.nbytes,
            seconds=full.seconds,
            dense=full,
        )

    def _update_live(self, version: object, auth: object) -> dict[str, Any]:
        live = self.live
        assert live is not None
        start = time.perf_counter()
        staged: LiveStaged | None = None
        error: str | None = None
        prefetched = False
        try:
            version = _check_version(version)
            check_update_tag(self.config.token, version, auth)
            receiver = self._open_receiver()
            staged = self._take_prefetched(version)  # type: ignore[assignment]
            prefetched = staged is not None
            if staged is None:
                staged = self._stage_live(version, receiver)
        except Exception as exc:  # noqa: BLE001  (every worker must reach the agreement below)
            error = f"({type(exc).__name__}): {exc}"
        # One round trip: every rank's error and fingerprint shares.
        answers = _gather((error, None if staged is None else staged.shares))
        error = next((e for e, _ in answers if e is not None), None)
        if error is not None:
            return self._fail(version, f"deltasync: update to version {version} refused {error}; "
                                       f"still serving {self._served()}")  # fmt: skip
        assert staged is not None
        fingerprint = staged.fingerprint
        if staged.kind == "delta":
            try:
                fingerprint = live.check_chain(staged, [shares for _, shares in answers])
            except IntegrityError as exc:  # the same on every rank: all shares are known to all
                logger.warning("deltasync: %s; loading the newest anchor instead", exc)
                error = None
                try:
                    staged = self._stage_live(version, self._open_receiver(), dense=True)
                except Exception as exc2:  # noqa: BLE001
                    error = f"({type(exc2).__name__}): {exc2}"
                error = _agree(error)
                if error is not None:
                    return self._fail(version, f"deltasync: update to version {version} refused: {exc}; "
                                               f"loading the anchor instead failed {error}; "
                                               f"still serving {self._served()}")  # fmt: skip
        stage_s = staged.seconds if prefetched else time.perf_counter() - start
        result: dict[str, Any] = {
            "version": staged.version,
            "fingerprint": staged.fingerprint,
            "kind": staged.kind,
            "mode": "in-place",
            "nbytes": staged.nbytes,
            "prefetched": prefetched,
            "stage_s": stage_s,
            "apply_s": 0.0,
            "changed": len(staged.names),
            "sent": len(staged.writes),
        }
        apply_start = time.perf_counter()
        if staged.kind == "delta":
            failure = self._write_live(staged, fingerprint)
        elif staged.kind == "anchor":
            failure = self._load_live(staged)
        else:
            failure = None
        if failure is not None:
            return failure
        result["apply_s"] = time.perf_counter() - apply_start
        if staged.kind == "anchor":
            result.update(self._anchor_timing, served_hash="after the pause")
        self.last = {**result, "time": time.time()}
        return result

    def _write_live(self, staged: LiveStaged, fingerprint: str) -> dict[str, Any] | None:
        live = self.live
        assert live is not None
        undo: list[Any] = []
        error: str | None = None
        try:
            undo = live.write(staged)
            if self._fail_after_write:
                self._fail_after_write = False
                raise UpdateError(f"a failure injected after rank {self.rank} wrote (test hook)")
        except Exception as exc:  # noqa: BLE001
            undo = getattr(exc, "undo", undo)
            error = f"writing version {staged.version} on rank {self.rank} failed ({type(exc).__name__}: {exc})"
        error = _agree(error)
        if error is not None:
            try:
                live.rollback(undo)  # every rank, those whose writes worked too
            except Exception as exc:  # noqa: BLE001  (a module of the host part could not be rebuilt)
                live.tainted = f"restoring the previous weights failed ({type(exc).__name__}: {exc})"
                return self._fail(staged.version, f"deltasync: {error}; {live.tainted}: the next update loads "
                                                  "the newest anchor again")  # fmt: skip
            return self._fail(staged.version, f"deltasync: {error}; every rank put its previous values back: "
                                              f"still serving {self._served()}")  # fmt: skip
        live.commit(staged.version, fingerprint)
        release_later(staged.writes, undo)  # after the pause: freeing tens of MB is not free
        return None

    def _load_live(self, staged: LiveStaged) -> dict[str, Any] | None:
        live = self.live
        assert live is not None
        error: str | None = None
        start = time.perf_counter()
        try:
            live.load_anchor(staged.dense.tensors())
        except Exception as exc:  # noqa: BLE001
            error = f"loading version {staged.version} on rank {self.rank} failed ({type(exc).__name__}: {exc})"
        staged.dense = None  # drop the transient copy, and give its memory back to the system
        release_freed_memory()
        self._anchor_timing = {"load_s": time.perf_counter() - start}
        error = _agree(error)
        if error is not None:
            served = live.full_fingerprint()
            live.tainted, live.fingerprint = error, served
            return self._fail(staged.version, f"deltasync: {error}; the served weights are not those of any "
                                              "version: the next update loads the newest anchor again")  # fmt: skip
        # The full hash of the served weights runs after the pause, while the engine generates;
        # the next call of any kind waits for it (:meth:`_settle`) before trusting the state.
        live.commit(staged.version, staged.fingerprint)
        live.start_full_hash()
        return None

    def _settle(self) -> None:
        """Finish a full hash of the served weights started after an anchor (a collective: every
        worker calls this first in every deltasync call)."""
        if self.live is not None and self.live.pending is not None:
            self.live.settle()

    def verify(self) -> dict[str, Any]:
        """Recompute the served fingerprint in full and compare (in-place mode); a mismatch
        makes the next update load the newest anchor instead of building on these weights."""
        self._settle()
        if self.live is not None:
            expected = self.live.fingerprint
            out = self.live.verify()
            return {**out, "expected": expected, "mode": "in-place"}
        receiver = self._receiver
        ok = receiver is not None and receiver.verify()
        return {"ok": ok, "fingerprint": None if receiver is None else receiver.fingerprint,
                "expected": None if receiver is None else receiver.fingerprint,
                "version": None if receiver is None else receiver.version, "mode": "reload"}  # fmt: skip

    # ------------------------------------------------------------------ test hooks

    def _check_hooks(self) -> None:
        if os.environ.get(TEST_HOOKS_ENV) != "1":
            raise ConfigError(f"test hooks are off; start the server with {TEST_HOOKS_ENV}=1")

    def test_poke(self, name: str, index: int, bits: int) -> bool:
        """Change one live element (test only)."""
        self._check_hooks()
        self._settle()
        if self.live is None:
            raise ConfigError("poke needs in-place mode")
        return self.live.poke(name, index, bits)

    def test_fail_after_write(self, rank: int) -> None:
        """Make the next in-place write fail on ``rank`` after it wrote (test only)."""
        self._check_hooks()
        self._fail_after_write = rank == self.rank

    def test_tensor_bytes(self) -> dict[str, int]:
        """Bytes of CPU tensors alive in this process, beyond the model's parameters, that are
        shaped like a checkpoint tensor: what an HF-named copy would be made of (test only)."""
        import gc

        self._check_hooks()
        gc.collect()
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters() if p.numel()}
        params |= {b.untyped_storage().data_ptr() for b in self.model.buffers() if b.numel()}
        shapes = {tuple(shape) for shape in (self.expected or {}).values()}
        seen: set[int] = set()
        total = 0
        largest = 0
        for obj in gc.get_objects():
            if (
                isinstance(obj, torch.Tensor)
                and obj.device.type == "cpu"
                and not obj.is_meta
                and tuple(obj.shape) in shapes
            ):
                try:
                    ptr = obj.untyped_storage().data_ptr()
                except RuntimeError:
                    continue
                if ptr in params or ptr in seen or ptr == 0:
                    continue
                seen.add(ptr)
                n = obj.untyped_storage().nbytes()
                total += n
                largest = max(largest, n)
        return {"bytes": total, "largest": largest}

    # ------------------------------------------------------------------ internals

    def _fail(self, version: object, message: str) -> dict[str, Any]:
        """Report a failure: the last worker raises it, the others return it.

        vLLM's multiprocess executor reads the workers' answers in rank order and stops at
        the first error, leaving later workers' answers queued, where the next call would
        read them. Raising only on the last worker keeps every queue drained.
        """
        self.last_error = {"version": version, "error": message, "time": time.time()}
        if self.last_rank:
            raise UpdateError(message)
        logger.error("%s", message)
        return {"version": version, "error": message}

    def _reload(self, staged: StagedUpdate) -> dict[str, Any]:
        """Load the staged values into the model; the receiver is not committed here."""
        receiver = self._open_receiver()
        changed = staged.names
        if staged.kind == "anchor":
            send = changed
        else:
            send = reload_groups(changed, list(receiver.state_dict()), self.packed)
        _, partial = reload_weights(self.model, self.vllm_config, ((n, staged.tensor(n)) for n in send))
        if partial:
            # A module got part of its elements: the groups did not cover this model's
            # layout. Rebuild every module from the full new state.
            logger.warning(
                "deltasync: %d modules were loaded only in part (%s); reloading every parameter",
                len(partial), ", ".join(partial[:5]),
            )  # fmt: skip
            send = list(receiver.state_dict()) if staged.kind == "delta" else changed
            _, partial = reload_weights(self.model, self.vllm_config, ((n, staged.tensor(n)) for n in send))
            if partial:
                raise UpdateError(f"modules {', '.join(partial[:5])} were still loaded only in part")
        return {"changed": len(changed), "sent": len(send)}

    def _restore(self) -> str:
        """Reload the state from before the failed update; say what is served now."""
        receiver = self._open_receiver()
        try:
            if receiver.version is not None:
                weights = iter(receiver.state_dict().items())
            else:
                from vllm.model_executor.model_loader import get_model_loader

                loader = get_model_loader(self.vllm_config.load_config)
                weights = iter(loader.get_all_weights(self.vllm_config.model_config, self.model))
            reload_weights(self.model, self.vllm_config, weights)
        except Exception:  # noqa: BLE001
            logger.exception("deltasync: restoring the previous weights failed")
            return "restoring the previous weights failed too: restart this server"
        return f"the weights were restored: still serving {self._served()}"

    def _check_not_older(self, version: int) -> None:
        served = self._served_state()[0]
        if served is not None and version < served:
            raise VersionError(f"version {version} is older than the served version {served}")

    def _served(self) -> str:
        version = self._served_state()[0]
        if version is None:
            return "the checkpoint it started with"
        return f"version {version}"

    def _open_receiver(self) -> DeltaReceiver:
        if self._receiver is None:
            if not self.config.bucket:
                raise ConfigError(
                    f"this server follows no bucket: start it with {BUCKET_ENV}=<bucket URL> "
                    "(the URL the trainer's DeltaPublisher writes to)"
                )
            self._receiver = DeltaReceiver(self.config.bucket)
        return self._receiver

    def _served_state(self) -> tuple[int | None, str | None]:
        """The version and fingerprint served (before the first update: version None)."""
        if self.live is not None:
            return self.live.version, self.live.fingerprint
        receiver = self._receiver
        return (None, None) if receiver is None else (receiver.version, receiver.fingerprint)

    def _take_prefetched(self, version: int) -> StagedUpdate | LiveStaged | None:
        job, self._prefetch = self._prefetch, None
        if job is None:
            return None
        if job.thread is not None:
            job.thread.join()  # it reads the receiver's state: never let it overlap an apply
        staged = job.staged
        if (
            staged is None
            or job.version != version
            or (staged.from_version, staged.from_fingerprint) != self._served_state()
        ):
            return None
        return staged

    def _run_prefetch(self, job: _Prefetch, receiver: DeltaReceiver) -> None:
        try:
            staged: StagedUpdate | LiveStaged
            if self.live is not None:
                staged = self._stage_live(job.version, receiver)
            else:
                staged = receiver.stage(job.version)
                self._validate(staged)
        except Exception as exc:  # noqa: BLE001  (reported through status; update re-stages)
            job.state, job.error = "failed", f"{type(exc).__name__}: {exc}"
            return
        job.staged, job.state = staged, "ready"

    def _validate(self, staged: StagedUpdate) -> None:
        """Refuse parameter names and shapes that the served checkpoint does not have."""
        if staged.kind == "none" or self.expected is None:
            return
        expected = self.expected
        names = sorted(staged.names)  # the first problem reported is always the same one
        where = f"version {staged.version}"
        if staged.kind == "anchor":
            have = set(names)
            missing = [
                n for n in sorted(expected)
                if n not in have and not n.endswith(_NOT_PARAMETERS) and not (n == _TIED_HEAD and self.tied)
            ]  # fmt: skip
        else:
            missing = []
        unknown = [n for n in names if n not in expected]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"{len(missing)} parameters of the served checkpoint are missing (e.g. {missing[0]})")
            if unknown:
                parts.append(f"{len(unknown)} are not in the served checkpoint (e.g. {unknown[0]})")
            raise FormatError(
                f"{where} does not fit the served model {self.checkpoint}: {'; '.join(parts)}. The bucket holds "
                "another model's weights, or the server was started from another checkpoint"
            )
        for name in names:
            shape = tuple(staged.shape(name))
            if shape != expected[name]:
                raise FormatError(
                    f"{where}: {name} has shape {list(shape)}, the served checkpoint's is {list(expected[name])}"
                )

    @staticmethod
    def _read_checkpoint(model_config: Any) -> tuple[dict[str, tuple[int, ...]] | None, str]:
        model = str(model_config.model)
        directory = resolve_model_dir(model, revision=getattr(model_config, "revision", None))
        if directory is None:
            logger.warning(
                "deltasync: cannot find the safetensors files of %s; updates are not checked against its "
                "parameter names and shapes", model,
            )
            return None, model
        try:
            return read_checkpoint_shapes(directory), str(directory)
        except (OSError, ValueError, DeltaSyncError) as exc:
            logger.warning("deltasync: cannot read the checkpoint of %s (%s); updates are not checked against it",
                           model, exc)
            return None, str(directory)


def _check_version(version: object) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise VersionError(f"the version must be a non-negative integer, got {version!r}")
    return version


def _parallel_groups() -> list[Any]:
    """This engine's tensor- and pipeline-parallel groups (none in a plain process)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return [get_tp_group(), get_pp_group()]
    except (ImportError, AssertionError):  # vLLM's distributed state is not initialised
        return []


def _is_last_rank() -> bool:
    """Whether this worker answers last in vLLM's executor (rank order: pipeline, then tensor)."""
    return all(group.rank_in_group == group.world_size - 1 for group in _parallel_groups())


def _rank_index() -> int:
    """This worker's position in :func:`_gather`'s answer."""
    index, size = 0, 1
    for group in _parallel_groups():
        index += group.rank_in_group * size
        size *= group.world_size
    return index


def _gather(obj: Any) -> list[Any]:
    """``obj`` of every worker of this engine, in :func:`_rank_index` order (the same list on all)."""
    items = [obj]
    for group in _parallel_groups():
        if group.world_size > 1:
            out: list[Any] = [None] * group.world_size
            torch.distributed.all_gather_object(out, items, group=group.cpu_group)
            items = [x for sub in out for x in sub]
    return items


def _agree(error: str | None) -> str | None:
    """The first error any worker of this engine reports (the same answer on every worker)."""
    for group in _parallel_groups():
        if group.world_size > 1:
            errors: list[str | None] = [None] * group.world_size
            torch.distributed.all_gather_object(errors, error, group=group.cpu_group)
            error = next((e for e in errors if e is not None), None)
    return error


_UPDATERS: WeakKeyDictionary[torch.nn.Module, WorkerUpdater] = WeakKeyDictionary()
_UPDATERS_LOCK = threading.Lock()


def updater_for(model: torch.nn.Module, vllm_config: Any) -> WorkerUpdater:
    """The updater of ``model`` (one per worker), created on first use."""
    with _UPDATERS_LOCK:
        updater = _UPDATERS.get(model)
        if updater is None:
            updater = _UPDATERS[model] = WorkerUpdater(model, vllm_config)
        return updater
