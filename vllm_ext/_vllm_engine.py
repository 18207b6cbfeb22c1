"""vLLM's implementation of the engine seam (:class:`deltasync.server.seam.Engine`).

The one module of the server-side flow that touches vLLM's objects: the API server's engine
client (``AsyncLLM``) and its engine-core client, and the engine-core method added to vLLM's
``EngineCore``. The update flow, the follower, the adapter flow, the token-version log and the
metrics reach vLLM only through :class:`VllmEngine`.

Every apply runs as one utility call in vLLM's engine core, :data:`ENGINE_METHOD`, added to
``EngineCore`` by :func:`install_engine_core_method` (the ``vllm.general_plugins`` entry point
runs it in the engine-core process). The engine core handles utility calls between two engine
steps, so in that one call it reads how many output tokens each unfinished request has (its
scheduler's requests: running, waiting and preempted) and then runs the apply
(:class:`~deltasync.protocol.ApplyCall`) on every worker. Tokens a step still has in flight (vLLM's async scheduling) count as sampled before: a
write is ordered after the work already queued on the device.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from typing import Any

from deltasync.protocol import ApplyCall, WorkerCall

from deltasync.server.seam import Applied, RequestTokens, SentRequest

__all__ = ["ENGINE_METHOD", "VllmEngine", "cache_salt", "install_engine_core_method"]

logger = logging.getLogger(__name__)

#: The engine-core utility: output tokens per unfinished request, then the apply on every worker.
ENGINE_METHOD = "deltasync_apply_counted"


class VllmEngine:
    """:class:`~deltasync.server.seam.Engine` over vLLM's engine client (``app.state.engine_client``)."""

    def __init__(self, client: Any) -> None:
        self.client = client
        """vLLM's engine client (``AsyncLLM``)."""

    async def call_workers(self, call: WorkerCall[Any]) -> list[Any]:
        # vLLM's engine core runs a collective_rpc between two steps, on every worker.
        return list(await self.client.collective_rpc(call.method, args=call.args()))

    async def apply(self, call: ApplyCall) -> Applied:
        core = getattr(self.client, "engine_core", None)
        utility: Callable[..., Any] | None = getattr(core, "call_utility_async", None)
        if utility is None:
            return Applied(await self.call_workers(call), None)
        try:
            # The coroutine runs up to its send before anything else can send: no ADD slips between.
            result = await utility(ENGINE_METHOD, *call.args())
        except Exception as exc:
            if f"no attribute '{ENGINE_METHOD}'" not in str(exc):
                raise
            logger.warning("deltasync: the engine core lacks %s (is vllm_ext's plugin installed?): token "
                           "versions will be reported as unknown ('?')", ENGINE_METHOD)  # fmt: skip
            return Applied(await self.call_workers(call), None)
        tokens = [
            RequestTokens(SentRequest(internal, external or "", _child_of(internal, external or "")), count)
            for internal, external, count in result["tokens"]
        ]
        return Applied(list(result["answers"]), tokens)

    def watch_requests(self, sent: Callable[[SentRequest], None]) -> None:
        core = getattr(self.client, "engine_core", None)
        current = getattr(core, "add_request_async", None)
        if current is None:
            return
        original = getattr(current, "__wrapped__", current)  # one watcher: a new one replaces the old

        @functools.wraps(original)
        async def add_request_async(request: Any) -> None:
            external = getattr(request, "external_req_id", None) or ""
            # Synchronously before the ADD is sent: the engine core sees this order.
            sent(SentRequest(request.request_id, external, _child_of(request.request_id, external)))
            await original(request)

        core.add_request_async = add_request_async  # type: ignore[union-attr]

    async def pause(self) -> None:
        # ``pause_generation(mode="keep", clear_cache=True)`` without its 20 ms sleep, which only
        # orders the outputs of aborted requests (``keep`` aborts none).
        core = getattr(self.client, "engine_core", None)
        if core is None or not hasattr(core, "pause_scheduler_async"):
            await self.client.pause_generation(mode="keep", clear_cache=True)
            return
        renderer = getattr(self.client, "renderer", None)
        if renderer is not None and hasattr(renderer, "clear_mm_cache_async"):
            await renderer.clear_mm_cache_async()
        await core.pause_scheduler_async(mode="keep", clear_cache=True)

    async def resume(self) -> None:
        await self.client.resume_generation()

    async def label(self, version: int) -> None:
        await self.client.update_weight_version(str(version))

    def salt(self, request: dict[str, Any], version: int | None) -> dict[str, Any]:
        # vLLM keys prefix-cache blocks by the request's ``cache_salt``.
        return {**request, "cache_salt": cache_salt(version, request.get("cache_salt"))}


def cache_salt(version: int | None, client_salt: object = None) -> str:
    """The prefix-cache salt of a request admitted at ``version``: requests admitted at
    different versions never share prefix-cache blocks; a client's own salt still separates
    its requests from others' (combined through a hash, within vLLM's 128 characters)."""
    salt = f"deltasync-v{'base' if version is None else version}"
    if isinstance(client_salt, str) and client_salt:
        salt += "-" + hashlib.sha256(client_salt.encode()).hexdigest()[:40]
    return salt


def _child_of(internal: str, external: str) -> int:
    """The choice index of an engine request: vLLM names child i of ``n > 1`` "{i}_{parent id}"."""
    if internal.startswith(external):
        return 0
    head, _, _ = internal.partition("_")
    return int(head) if head.isdigit() else 0


def _apply_counted(self: Any, version: Any, auth: Any = None) -> dict[str, Any]:
    """:data:`ENGINE_METHOD`: the output tokens of every unfinished request, then the apply
    (:meth:`ApplyCall.args`) on every worker, in one utility call. Its parameters are named one
    by one: vLLM's engine core matches a utility's arguments against its signature."""
    counts = [
        [request_id, getattr(request, "external_req_id", None),
         int(request.num_output_tokens) + int(getattr(request, "num_output_placeholders", 0) or 0)]
        for request_id, request in self.scheduler.requests.items()
    ]  # fmt: skip
    answers = self.collective_rpc(ApplyCall.method, None, (version, auth), None)
    return {"tokens": counts, "answers": answers}


def install_engine_core_method() -> None:
    """Add :data:`ENGINE_METHOD` to vLLM's ``EngineCore`` (safe to repeat; no-op without vLLM)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # pragma: no cover - vLLM is optional for the package
        return
    if not hasattr(EngineCore, ENGINE_METHOD):
        setattr(EngineCore, ENGINE_METHOD, _apply_counted)
