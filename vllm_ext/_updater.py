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

from deltasync import ConfigError, DeltaReceiver, DeltaSyncError, FormatError, StagedUpdate, VersionError
from deltasync._auth import TOKEN_ENV, check_update_tag

from ._checkpoint import read_checkpoint_shapes, resolve_model_dir
from ._reload import reload_groups, reload_weights

__all__ = ["BUCKET_ENV", "ServerConfig", "UpdateError", "WorkerUpdater", "updater_for"]

logger = logging.getLogger(__name__)

#: The environment variable naming the bucket a server follows.
BUCKET_ENV = "DELTASYNC_BUCKET"

# Checkpoint tensors that are not parameters: vLLM skips them when loading, and a trainer's
# state never holds them.
_NOT_PARAMETERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_TIED_HEAD = "lm_head.weight"


class UpdateError(DeltaSyncError):
    """An update was refused or failed; the message says why and what the server still serves."""


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

    # ------------------------------------------------------------------ public

    def status(self) -> dict[str, Any]:
        """Plain data about what this worker serves (the answer of ``deltasync_status``)."""
        receiver = self._receiver
        return {
            "rank": self.rank,
            "version": None if receiver is None else receiver.version,
            "fingerprint": None if receiver is None else receiver.fingerprint,
            "bucket": self.config.bucket,
            "auth": self.config.token is not None,
            "checkpoint": self.checkpoint,
            "last_update": None if self.last is None else dict(self.last),
            "last_error": None if self.last_error is None else dict(self.last_error),
            "prefetch": None if self._prefetch is None else self._prefetch.describe(),
        }

    def prefetch(self, version: object, auth: object = None) -> dict[str, Any]:
        """Start staging ``version`` in a background thread; the engine keeps generating."""
        try:
            version = _check_version(version)
            check_update_tag(self.config.token, version, auth)
            receiver = self._open_receiver()
            latest = receiver.latest()
            if version > latest:
                raise VersionError(
                    f"version {version} is not committed in {receiver.store.url} (the newest is {latest})"
                )
            if receiver.version is not None and version < receiver.version:
                raise VersionError(f"version {version} is older than the served version {receiver.version}")
        except DeltaSyncError as exc:
            return self._fail(version, f"deltasync: prefetch of version {version} refused: {exc}")
        job = self._prefetch
        if job is not None and job.version == version and job.state != "failed":
            return job.describe()
        if job is not None and job.thread is not None and job.thread.is_alive():
            return self._fail(version, f"deltasync: prefetch of version {version} refused: version {job.version} "
                                       "is still being prefetched; update to it or wait until it is ready")  # fmt: skip
        job = _Prefetch(version)
        if receiver.version == version:
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
        start = time.perf_counter()
        staged: StagedUpdate | None = None
        error: str | None = None
        prefetched = False
        try:
            version = _check_version(version)
            check_update_tag(self.config.token, version, auth)
            receiver = self._open_receiver()
            staged = self._take_prefetched(version, receiver)
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

    def _served(self) -> str:
        receiver = self._receiver
        if receiver is None or receiver.version is None:
            return "the checkpoint it started with"
        return f"version {receiver.version}"

    def _open_receiver(self) -> DeltaReceiver:
        if self._receiver is None:
            if not self.config.bucket:
                raise ConfigError(
                    f"this server follows no bucket: start it with {BUCKET_ENV}=<bucket URL> "
                    "(the URL the trainer's DeltaPublisher writes to)"
                )
            self._receiver = DeltaReceiver(self.config.bucket)
        return self._receiver

    def _take_prefetched(self, version: int, receiver: DeltaReceiver) -> StagedUpdate | None:
        job, self._prefetch = self._prefetch, None
        if job is None:
            return None
        if job.thread is not None:
            job.thread.join()  # it reads the receiver's state: never let it overlap an apply
        staged = job.staged
        if (
            staged is None
            or job.version != version
            or staged.from_version != receiver.version
            or staged.from_fingerprint != receiver.fingerprint
        ):
            return None
        return staged

    def _run_prefetch(self, job: _Prefetch, receiver: DeltaReceiver) -> None:
        try:
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
