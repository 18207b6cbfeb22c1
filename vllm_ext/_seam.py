"""The engine seam: what the server-side flow needs from an inference engine.

The update flow (:mod:`vllm_ext._flow`), the follower (:mod:`vllm_ext._follower`), the adapter
flow, the token-version log and the metrics drive an engine only through :class:`Engine`. vLLM's
implementation is :class:`vllm_ext._vllm_engine.VllmEngine`, the one module of the flow that
touches vLLM's objects; another engine (SGLang, say) implements the same methods (see "Adding an
engine" in docs/server.md). These modules import no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from deltasync.protocol import ApplyCall, WorkerCall

__all__ = ["Applied", "Engine", "RequestTokens", "SentRequest"]


@dataclass(frozen=True)
class SentRequest:
    """A generation request as the engine receives it."""

    request_id: str
    """The engine's own id of this request (one per choice)."""
    external_id: str
    """The id the API server gave it (it holds the token-version log's marker)."""
    choice: int
    """Which choice of its HTTP request it is (0 unless ``n > 1``)."""


@dataclass(frozen=True)
class RequestTokens:
    """How many output tokens an unfinished request had when a version was written."""

    request: SentRequest
    output_tokens: int


@dataclass(frozen=True)
class Applied:
    """What :meth:`Engine.apply` returns."""

    answers: list[Any]
    """Each worker's answer to the :class:`~deltasync.protocol.ApplyCall`, in rank order (plain data)."""
    tokens: list[RequestTokens] | None
    """Every unfinished request's output tokens at the write; None where the engine cannot tell."""


class Engine(Protocol):
    """The engine a server runs: what the flow calls, and what each call must guarantee."""

    async def call_workers(self, call: WorkerCall[Any]) -> list[Any]:
        """Run ``call`` (the worker-extension method ``call.method(*call.args())``, see
        :mod:`deltasync.protocol.calls`) on every worker and return each worker's answer, as plain
        data, in rank order (the caller types them: ``call.answers``). The call must run between
        two engine steps on every worker (no forward pass on any rank meanwhile), and must raise
        if any worker raised."""
        ...

    async def apply(self, call: ApplyCall) -> Applied:
        """``call_workers(call)``, with the output tokens of every
        unfinished request taken in the same pause between two steps (no token is sampled
        between the count and the write). It must send the call before it first awaits
        anything else, so that no request is sent to the engine in between."""
        ...

    def watch_requests(self, sent: Callable[[SentRequest], None]) -> None:
        """Call ``sent`` synchronously for each generation request, just before it is sent to
        the engine, in the order the engine receives them (at most one watcher; a no-op
        where the engine cannot tell)."""
        ...

    async def pause(self) -> None:
        """Stop scheduling: no step runs until :meth:`resume`. Requests are kept, not aborted,
        and every cache that holds results of the old weights (prefix cache, multimodal
        cache) is emptied, so kept requests recompute their KV with the new weights."""
        ...

    async def resume(self) -> None:
        """Schedule again after :meth:`pause`; must be safe to call if the pause failed halfway."""
        ...

    async def label(self, version: int) -> None:
        """Set the served weight version the engine reports (vLLM's ``weight_version``). The
        version each worker serves is read from the workers (``deltasync_status``)."""
        ...

    def salt(self, request: dict[str, Any], version: int | None) -> dict[str, Any]:
        """The body of an inference request admitted at ``version``, changed so that it never
        reuses prefix-cache blocks computed with other weights (a client's own salt still
        separates its requests from others')."""
        ...
