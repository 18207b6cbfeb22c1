"""The two engine seams: what the server core needs from an inference engine.

- :class:`Engine`, in the API server: run a call on every worker, pause and resume, label the
  version, watch and salt requests.
- :class:`Worker`, in each worker process (one per rank): the ranks, the live parameters, a
  layerwise reload, the served checkpoint and the platform checks, for the
  :class:`~deltasync.server.updater.WorkerUpdater`.

The update flow (:mod:`deltasync.server.flow`), the follower (:mod:`deltasync.server.follower`), the adapter
flow, the token-version log and the metrics drive an engine only through :class:`Engine`. vLLM's
implementation is :class:`vllm_ext._vllm_engine.VllmEngine`, the one module of the flow that
touches vLLM's objects; another engine (SGLang, say) implements the same methods (see "Adding an
engine" in docs/server.md). These modules import no vLLM. vLLM's :class:`Worker` is
:class:`vllm_ext._worker.VllmWorker`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from deltasync.protocol import ApplyCall, WorkerCall

if TYPE_CHECKING:
    import torch

    from deltasync.views import ViewScheme

    from .checkpoint import ServedCheckpoint

__all__ = ["Applied", "Engine", "RequestTokens", "SentRequest", "Worker"]


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


class Worker(Protocol):
    """One worker of an engine (one rank), as its :class:`~deltasync.server.updater.WorkerUpdater`
    drives it. Every method named a collective is called on every rank in step."""

    @property
    def model(self) -> torch.nn.Module:
        """The live model: its parameters are what is served, and its ``load_weights(pairs)``
        maps ``(checkpoint name, tensor)`` pairs onto them (inside :meth:`loading`)."""
        ...

    @property
    def rank(self) -> int:
        """This worker's global rank (named in messages and in ``deltasync_status``)."""
        ...

    def rank_index(self) -> int:
        """This worker's position in :meth:`gather`'s answer."""
        ...

    def is_last_rank(self) -> bool:
        """Whether this worker's answer is the one the engine reads last (the one that
        carries the update's full answer)."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """A collective: ``obj`` of every worker of this engine, in :meth:`rank_index` order
        (the same list on all; ``[obj]`` for a single worker)."""
        ...

    def checkpoint(self) -> ServedCheckpoint:
        """The checkpoint this worker serves (model folder, dtypes, quantized view)."""
        ...

    def packed(self) -> dict[str, list[str]]:
        """Fused module -> the checkpoint parts it is loaded from (``qkv_proj``: ``q_proj``,
        ``k_proj``, ``v_proj``); a reload rebuilds a fused module only from all of them."""
        ...

    def in_place_refusal(self) -> str | None:
        """The platform checks: why this engine's parameters cannot be written in place at all
        (None: they can, where discovery finds them fit)."""
        ...

    def loading(self, scheme: ViewScheme | None) -> AbstractContextManager[Any]:
        """Within the ``with``, ``model.load_weights`` loads checkpoint tensors of ``scheme``
        (the view served; None: bf16) into the live storage (discovery, a dense load)."""
        ...

    def transformed(self, module: torch.nn.Module) -> str | None:
        """Why ``module``'s parameters are transformed after loading, so that a write into
        them is not seen (None: they are used as loaded)."""
        ...

    def reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
        """Rebuild the modules of ``(checkpoint name, tensor)`` pairs through the engine's
        layerwise reload (the pairs cover whole modules); returns the modules loaded only in part."""
        ...

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights the engine started with, read again (to restore them before any version)."""
        ...
