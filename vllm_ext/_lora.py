"""``--middleware vllm_ext.LoraSyncMiddleware``: serve adapter versions from the bucket.

vLLM's LoRA loading lives in the API-server process (``OpenAIServingModels``), so this
runs there, as ASGI middleware with two routes of its own:

- ``POST /deltasync/lora/update {"version": N, "auth": TAG, "name": NAME, "keep": K}``:
  reads adapter version N from the server's own bucket (``DELTASYNC_BUCKET``, fixed at
  start-up; no request names a path or a bucket), checks it (integrity and fingerprints by
  :class:`~deltasync.DeltaReceiver`; the adapter config; its rank against
  ``--max-lora-rank``; the base-model fingerprint against the checkpoint this server runs),
  writes it into a private directory and loads it as ``NAME-vN`` through vLLM's runtime LoRA
  loading, then unloads versions older than the newest ``K`` (their files go one update
  later, as TRL does: vLLM reads adapter files lazily). A failure changes nothing: the
  adapters already loaded stay, and the version stays.
- ``POST /deltasync/lora/status``: the newest loaded version, its fingerprint as vLLM's
  workers hold it (``vllm_ext._lora_worker``; ``bucket_fingerprint`` is this process's copy),
  the modules vLLM serves LoRA on (``lora_modules``), the loaded adapters, the last update and
  the last error.

Both routes need ``Authorization: Bearer $DELTASYNC_TOKEN`` when the server has a token,
and updates also carry the tag of their version, as weight updates do. The server needs
``--enable-lora`` (``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is not needed: these routes are
not vLLM's path-taking ones). :class:`deltasync.AdapterRolloutClient` speaks to them.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from deltasync import AuthError, DeltaReceiver, DeltaSyncError, StagedUpdate, VersionError
from deltasync.protocol import BUCKET_ENV, LoraFingerprintCall, LoraModulesCall
from deltasync.protocol.lora import (
    ADAPTER_CONFIG_KEY,
    BASE_FINGERPRINT_KEY,
    STATUS_ROUTE,
    UPDATE_ROUTE,
    AdapterError,
    adapter_modules,
    adapter_rank,
    check_adapter_config,
    check_adapter_modules,
    fingerprint_sum,
)

from deltasync.server.adapter_messages import AdapterRequest, AdapterStatus, AdapterUpdate, FailedUpdate, LoraModules, ServedFingerprint
from deltasync.server.asgi import answer, error_body, read_body, refused
from deltasync.server.checkpoint import resolve_model_dir
from deltasync.server.config import ServerConfig
from deltasync.server.flow import VersionedFlow
from deltasync.server.middleware import route_path

from ._lora_worker import lora_problem
from ._vllm_engine import VllmEngine

__all__ = ["LoraSyncMiddleware"]

logger = logging.getLogger(__name__)

_NOT_PARAMETERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class LoraSyncMiddleware:
    """ASGI middleware adding ``/deltasync/lora/update`` and ``/deltasync/lora/status`` (see module)."""

    def __init__(self, app: Any, token: str | None = None, bucket: str | None = None) -> None:
        self.app = app
        config = ServerConfig.from_env()
        self.token = token if token is not None else config.token
        self.bucket = bucket if bucket is not None else config.bucket
        self._sync: AdapterFlow | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan" and "app" in scope:
            problem = lora_problem(scope["app"].state.vllm_config)
            if problem is not None:  # refuse to start rather than die at the first completion
                logger.error("vllm_ext.LoraSyncMiddleware: %s", problem)
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.failed", "message": f"vllm_ext.LoraSyncMiddleware: {problem}"})
                return
        path = route_path(scope) if scope["type"] == "http" else ""
        if path not in (UPDATE_ROUTE, STATUS_ROUTE):
            await self.app(scope, receive, send)
            return
        if await refused(scope, send, path, self.token):
            return
        body = await read_body(receive)
        if self._sync is None:
            self._sync = AdapterFlow(scope["app"].state, self.bucket, self.token)
        if path == STATUS_ROUTE:
            await answer(send, 200, (await self._sync.full_status()).to_json())
            return
        try:
            request = json.loads(body or b"{}")
            if not isinstance(request, dict):
                raise ValueError("the body must be a JSON object")
        except ValueError as exc:
            await answer(send, 400, error_body(f"{path}: bad JSON body ({exc})", "BadRequest", 400))
            return
        try:
            result = await self._sync.update(request)
        except DeltaSyncError as exc:
            status = 401 if isinstance(exc, AuthError) else 400 if isinstance(exc, (AdapterError, VersionError)) else 500
            assert self._sync.last_error is not None  # recorded by the flow
            await answer(send, status, error_body(self._sync.last_error.error, type(exc).__name__, status))
            return
        await answer(send, 200, result)


class AdapterFlow(VersionedFlow):
    """One API server's adapter versions: its receiver, private directory and loaded versions,
    updated by the flow every update of this server shares (:class:`deltasync.server.flow.VersionedFlow`:
    one lock, one version order)."""

    def __init__(self, state: Any, bucket: str | None, token: str | None) -> None:
        super().__init__(VllmEngine(state.engine_client), token=token)
        self.models = state.openai_serving_models
        self.vllm_config = state.vllm_config
        self.bucket = bucket
        self.receiver: DeltaReceiver | None = None
        self.directory = Path(tempfile.mkdtemp(prefix="deltasync-lora-"))  # mode 0700: private
        atexit.register(shutil.rmtree, self.directory, True)
        self.loaded: dict[int, str] = {}
        """version -> adapter name, for the versions loaded by this middleware."""
        self.retired: list[Path] = []
        """Directories of unloaded versions, deleted at the next update."""
        self.anchor_meta: tuple[int, dict[str, str]] | None = None
        """The root of the chain being followed, and the adapter metadata of its anchors."""
        self.served_base: str | None = None
        self.last: AdapterUpdate | None = None
        self.last_error: FailedUpdate | None = None
        self.served = ServedFingerprint()
        """The newest loaded version's fingerprint as vLLM's workers hold it (see _served_fingerprint)."""
        self.modules: LoraModules | None = None
        """The adapter modules vLLM serves LoRA on (or why not), asked of the workers once."""

    def status(self) -> AdapterStatus:
        receiver = self.receiver
        return AdapterStatus(
            version=None if receiver is None else receiver.version,
            served=self.served,
            bucket_fingerprint=None if receiver is None else receiver.fingerprint,
            bucket=self.bucket,
            auth=self.token is not None,
            loaded=[self.loaded[v] for v in sorted(self.loaded)],
            lora_ids={n: r.lora_int_id for n, r in self.models.lora_requests.items() if n in self.loaded.values()},
            base_fingerprint=self.served_base,
            last_update=self.last,
            last_error=self.last_error,
        )

    async def full_status(self) -> AdapterStatus:
        """:meth:`status` with the modules vLLM serves LoRA on, and the served fingerprint
        recomputed from the workers' tensors now."""
        modules = await self.lora_modules()
        async with self.lock:
            newest = None if self.receiver is None else self.loaded.get(self.receiver.version)  # type: ignore[arg-type]
            if newest is not None:
                self.served = await self._served_fingerprint(newest, sorted(self.receiver.state_dict()))  # type: ignore[union-attr]
            return replace(self.status(), modules=modules)

    async def lora_modules(self) -> LoraModules:
        """The adapter modules whose LoRA this server's vLLM loads and applies (asked once)."""
        if self.modules is None:
            try:
                call = LoraModulesCall()
                self.modules = LoraModules.from_answers(call.answers(await self.engine.call_workers(call)))
            except Exception as exc:  # noqa: BLE001  (reported: the workers lack the extension)
                self.modules = LoraModules(modules=None, problem=f"the workers cannot tell ({type(exc).__name__}: {exc}); "
                                           "start the server with --worker-extension-cls vllm_ext.DeltaWorkerExtension")  # fmt: skip
        return self.modules

    async def _served_fingerprint(self, adapter: str, names: list[str]) -> ServedFingerprint:
        """``adapter``'s fingerprint from the LoRA tensors every worker holds (they must agree)."""
        request = self.models.lora_requests.get(adapter)
        if request is None:
            return ServedFingerprint(error=f"{adapter} is not loaded")
        try:
            call = LoraFingerprintCall(lora_id=request.lora_int_id, path=str(self.directory / adapter), names=names)
            answers = call.answers(await self.engine.call_workers(call))
        except Exception as exc:  # noqa: BLE001  (reported, with what to do)
            return ServedFingerprint(error=f"the workers cannot hash {adapter} ({type(exc).__name__}: {exc}); "
                                           "start the server with --worker-extension-cls vllm_ext.DeltaWorkerExtension")  # fmt: skip
        return ServedFingerprint.from_answers(adapter, answers)

    async def update(self, body: dict[str, Any]) -> dict[str, Any]:
        """Load the adapter version ``body`` names (see the module); the route's answer. A
        failure changes nothing, is kept in :attr:`last_error` and raised."""
        try:
            return await self._update(AdapterRequest.parse(body, self.token))
        except DeltaSyncError as exc:
            message = f"deltasync: adapter version {body.get('version')} not loaded: {exc}"
            self.last_error = FailedUpdate(version=body.get("version"), error=message)
            logger.error("%s", message)
            raise

    async def _update(self, request: AdapterRequest) -> dict[str, Any]:
        version, adapter = request.version, request.adapter
        lora_config = self.vllm_config.lora_config
        if lora_config is None:
            raise AdapterError("this server runs without LoRA: restart it with --enable-lora --max-lora-rank R --max-loras K")
        if (problem := lora_problem(self.vllm_config)) is not None:
            raise AdapterError(problem)
        if self.bucket is None:
            raise AdapterError(f"this server follows no bucket: start it with {BUCKET_ENV} set (deltasync serve --bucket)")
        async with self.lock:
            start = time.perf_counter()
            newest = None if self.receiver is None else self.receiver.version
            order = self.order(version, newest)
            if order == "older":
                raise VersionError(f"version {version} is older than the newest loaded adapter version {newest}")
            if order == "served" and self.loaded.get(version) == adapter:
                self.last = AdapterUpdate(version=version, kind="none")
                return self.status().answer(self.last, None)
            staged, state, config, base, anchor_meta, staging = await asyncio.to_thread(
                stage_adapter, self.bucket, self.receiver, self.anchor_meta, version
            )
            check_adapter_config(config)
            rank = adapter_rank(config)
            if rank > lora_config.max_lora_rank:
                raise AdapterError(
                    f"adapter version {version} has rank {rank}, above this server's --max-lora-rank "
                    f"{lora_config.max_lora_rank}: restart the server with a larger --max-lora-rank, or train a smaller r"
                )
            modules = (await self.lora_modules()).modules
            if modules is not None:  # else vLLM's own load-time check is what remains
                check_adapter_modules(adapter_modules(state), modules, restricted=lora_config.target_modules)
            if self.served_base is None:
                self.served_base = await asyncio.to_thread(self._served_base_fingerprint)
            if base != self.served_base:
                raise AdapterError(
                    f"adapter version {version} was trained on another base model (base fingerprint {base}; this "
                    f"server's checkpoint has {self.served_base}): point the server at the trainer's base model, "
                    "or the trainer at another bucket"
                )
            stage_s = time.perf_counter() - start
            path = await asyncio.to_thread(self._materialise, adapter, state, config)
            t_load = time.perf_counter()
            await self._load(adapter, path)
            served = await self._served_fingerprint(adapter, sorted(state))
            if served.mismatch or served.fingerprint not in (None, staged.fingerprint):
                await self._unload(adapter)
                raise AdapterError(
                    f"vLLM's workers do not hold version {version} as its fingerprint {staged.fingerprint} says "
                    f"({served.error or served.fingerprint}): unloaded {adapter} again"
                )
            staging.apply(staged)
            self.served = served
            self.receiver = staging
            self.anchor_meta = anchor_meta
            self.loaded[version] = adapter
            unloaded = await self._retire(version - request.keep)
            self.last = AdapterUpdate(version=version, kind=staged.kind, nbytes=staged.nbytes, stage_s=stage_s,
                                      apply_s=time.perf_counter() - t_load, adapter=adapter, time=time.time())  # fmt: skip
            logger.info("deltasync: loaded adapter %s (%s, %d bytes)", adapter, staged.kind, staged.nbytes)
            return self.status().answer(self.last, unloaded)

    # ------------------------------------------------------------------ steps

    def _served_base_fingerprint(self) -> str:
        """Fingerprint of the checkpoint this server runs, tensor by tensor (never all in memory)."""
        from safetensors import safe_open

        from deltasync import fingerprint

        model_config = self.vllm_config.model_config
        root = resolve_model_dir(model_config.model, revision=getattr(model_config, "revision", None))
        if root is None:
            raise AdapterError(f"the checkpoint of {model_config.model!r} is not on this machine as safetensors")
        text_config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
        tied = bool(getattr(text_config, "tie_word_embeddings", False))
        parts = []
        for file in sorted(root.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    if key.endswith(_NOT_PARAMETERS) or (tied and key == "lm_head.weight"):
                        continue
                    parts.append(fingerprint({key: f.get_tensor(key)}))
        return fingerprint_sum(parts)

    def _materialise(self, adapter: str, state: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
        """Write the adapter where vLLM reads it: ``adapter_model.safetensors`` + ``adapter_config.json``."""
        from safetensors.torch import save_file

        final = self.directory / adapter
        partial = self.directory / f".{adapter}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()}, str(partial / "adapter_model.safetensors"))
        (partial / "adapter_config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
        shutil.rmtree(final, ignore_errors=True)
        os.rename(partial, final)
        return final

    async def _load(self, adapter: str, path: Path) -> None:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        # A stale name from an earlier run of the trainer is replaced, not refused.
        inplace = adapter in self.models.lora_requests
        answer = await self.models.load_lora_adapter(
            LoadLoRAAdapterRequest(lora_name=adapter, lora_path=str(path), load_inplace=inplace)
        )
        if isinstance(answer, ErrorResponse):
            await asyncio.to_thread(shutil.rmtree, path, True)
            raise AdapterError(f"vLLM refused adapter {adapter}: {answer.error.message}")

    async def _unload(self, adapter: str) -> None:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        if adapter in self.models.lora_requests:
            await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=adapter))
        await asyncio.to_thread(shutil.rmtree, self.directory / adapter, True)

    async def _retire(self, newest_stale: int) -> list[str]:
        from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

        for path in self.retired:
            await asyncio.to_thread(shutil.rmtree, path, True)
        self.retired = []
        unloaded = []
        for version in sorted(v for v in self.loaded if v <= newest_stale):
            adapter = self.loaded.pop(version)
            if adapter in self.models.lora_requests:
                await self.models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=adapter))
            self.retired.append(self.directory / adapter)
            unloaded.append(adapter)
        return unloaded


def stage_adapter(
    bucket: str, receiver: DeltaReceiver | None, anchor_meta: tuple[int, dict[str, str]] | None, version: int
) -> tuple[StagedUpdate, dict[str, torch.Tensor], dict[str, Any], str, tuple[int, dict[str, str]], DeltaReceiver]:
    """Download and check adapter version ``version`` of ``bucket``, changing nothing.

    ``receiver`` holds the adapter versions followed so far, and ``anchor_meta`` the root of
    their chain and the adapter metadata of its anchors (both None at first). Returns the staged
    update, the full adapter state after it, its adapter config, the base-model fingerprint it
    was trained on, the ``anchor_meta`` and the receiver to apply the update to: ``receiver``,
    or a fresh one for a new chain.
    """
    root = None if receiver is None else receiver.pointer().root
    if receiver is None or anchor_meta is None or root != anchor_meta[0]:
        # A new chain (a trainer started anew: maybe another adapter, of another rank) is
        # staged on a fresh receiver, whose manifest is its anchor's; it replaces the current
        # one only once the adapter passed every check and loaded.
        receiver = DeltaReceiver(bucket)
        root = receiver.pointer().root
    staged = receiver.stage(version)
    if staged.kind == "anchor":
        state = dict(staged.tensors())
        # Every anchor carries the adapter's metadata, read and checked with its tensors.
        anchor = staged.versions[0]
        anchor_meta = (root, staged.anchor_metadata)
    else:
        state = receiver.state_dict()
        state.update(staged.tensors())
        assert anchor_meta is not None
        anchor = anchor_meta[0]
    meta = anchor_meta[1]
    if ADAPTER_CONFIG_KEY not in meta or BASE_FINGERPRINT_KEY not in meta:
        raise AdapterError(
            f"{receiver.store.url}: anchor {anchor} holds no adapter ({ADAPTER_CONFIG_KEY} is missing): this bucket "
            "holds full-model versions; serve it without --enable-lora, or point the server at an adapter bucket"
        )
    try:
        config = json.loads(meta[ADAPTER_CONFIG_KEY])
    except ValueError as exc:
        raise AdapterError(f"anchor {anchor}: {ADAPTER_CONFIG_KEY} is not JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"anchor {anchor}: {ADAPTER_CONFIG_KEY} is not a JSON object")
    return staged, state, config, meta[BASE_FINGERPRINT_KEY], anchor_meta, receiver
