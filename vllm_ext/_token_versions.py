"""Where each version began in every response: taken where the write happens.

Every apply (in-flight or paused, from the update route, follow mode or ``/collective_rpc``)
runs as one utility call in vLLM's engine core, :data:`ENGINE_METHOD`, added to vLLM's
``EngineCore`` by :func:`install_engine_core_method` (the ``vllm.general_plugins`` entry point
runs it in the engine-core process). The engine core handles utility calls between two engine
steps, so in that one call it reads how many output tokens each unfinished request has (its
scheduler's requests: running, waiting and preempted) and then runs ``deltasync_apply`` on
every worker. No step runs in between: a request with ``k`` tokens then has its token ``k``
sampled with the new weights. Tokens a step still has in flight (vLLM's async scheduling)
count as sampled before: a write is ordered after the work already queued on the device.

The API-server side, :class:`TokenVersionLog`, ties engine requests to HTTP requests. The
middleware gives every completion and chat request an ``X-Request-Id`` holding a unique
marker, which vLLM puts into the engine request's id. A request the engine does not hold at
the write either finished before it or was sent after it: the log stamps each engine request
with the number of applies sent before its own ``ADD`` (its send is wrapped), and input to the
engine core is handled in the order it was sent.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deltasync.protocol import TokenVersions

__all__ = ["ENGINE_METHOD", "TokenVersionLog", "install_engine_core_method"]

logger = logging.getLogger(__name__)

#: The engine-core utility: output tokens per unfinished request, then the apply on every worker.
ENGINE_METHOD = "deltasync_apply_counted"
_MARKER = re.compile(r"dsv[0-9a-f]{24}")


def _apply_counted(self: Any, version: Any, auth: Any = None) -> dict[str, Any]:
    counts = [
        [request_id, getattr(request, "external_req_id", None),
         int(request.num_output_tokens) + int(getattr(request, "num_output_placeholders", 0) or 0)]
        for request_id, request in self.scheduler.requests.items()
    ]  # fmt: skip
    answers = self.collective_rpc("deltasync_apply", None, (version, auth), None)
    return {"tokens": counts, "answers": answers}


def install_engine_core_method() -> None:
    """Add :data:`ENGINE_METHOD` to vLLM's ``EngineCore`` (safe to repeat; no-op without vLLM)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # pragma: no cover - vLLM is optional for the package
        return
    if not hasattr(EngineCore, ENGINE_METHOD):
        setattr(EngineCore, ENGINE_METHOD, _apply_counted)


@dataclass
class _Choice:
    prompt: int
    child: int
    sent_epoch: int
    external: str = ""


@dataclass
class _Tracked:
    admitted: int | None
    epoch: int
    choices: dict[str, _Choice] = field(default_factory=dict)


@dataclass
class _Apply:
    epoch: int
    version: int
    tokens: dict[str, int] | None  # None: an apply whose counts were not taken


def _child_of(internal: str, external: str) -> int:
    """The choice index of an engine request: vLLM names child i of ``n > 1`` "{i}_{parent id}"."""
    if internal.startswith(external):
        return 0
    head, _, _ = internal.partition("_")
    return int(head) if head.isdigit() else 0


class TokenVersionLog:
    """The API-server process's record of where each version began, per tracked request."""

    def __init__(self) -> None:
        self.epoch = 0
        """Applies sent to the engine so far."""
        self._tracked: dict[str, _Tracked] = {}
        self._applies: list[_Apply] = []
        self._hooked: Any = None

    # ---------------------------------------------------------------- the engine side

    def hook(self, engine: Any) -> None:
        """Stamp each engine request of a tracked HTTP request with the applies sent before it
        (wraps the engine client's ``add_request_async`` once)."""
        core = getattr(engine, "engine_core", None)
        original = getattr(core, "add_request_async", None)
        if original is None or self._hooked is core:
            return
        log = self

        async def add_request_async(request: Any) -> None:
            log._sent(request)  # synchronously before the ADD is sent: the engine sees this order
            await original(request)

        core.add_request_async = add_request_async  # type: ignore[union-attr]
        self._hooked = core

    def _sent(self, request: Any) -> None:
        external = getattr(request, "external_req_id", None) or ""
        found = _MARKER.search(external)
        tracked = self._tracked.get(found.group()) if found else None
        if tracked is None or not found:
            return
        internal: str = request.request_id
        rest = external[found.end() :]
        prompt = int(rest[1:]) if rest.startswith("-") and rest[1:].isdigit() else 0
        child = _child_of(internal, external)
        tracked.choices[internal] = _Choice(prompt, child, self.epoch, external)

    async def apply(self, engine: Any, version: int, auth: Any, *, counted: bool = True) -> list[Any]:
        """Run ``deltasync_apply`` on every worker through the engine core's counted call (or a
        plain ``collective_rpc`` on an engine without it) and record where ``version`` began;
        the workers' answers."""
        core = getattr(engine, "engine_core", None)
        call: Callable[..., Any] | None = getattr(core, "call_utility_async", None) if counted else None
        self.epoch += 1
        epoch = self.epoch
        if call is None:
            answers = await engine.collective_rpc("deltasync_apply", args=(version, auth))
            self.record(epoch, version, None, answers)
            return list(answers)
        try:
            # The coroutine runs up to its send before anything else can send: no ADD slips between.
            result = await call(ENGINE_METHOD, version, auth)
        except Exception as exc:
            if f"no attribute '{ENGINE_METHOD}'" not in str(exc):
                raise
            logger.warning("deltasync: the engine core lacks %s (is vllm_ext's plugin installed?): token "
                           "versions will be reported as unknown ('?')", ENGINE_METHOD)  # fmt: skip
            return await self.apply(engine, version, auth, counted=False)
        tokens: dict[str, int] = {}
        for internal, external, count in result["tokens"]:
            tokens[internal] = count
            if external:  # also by the id this server gave it, and the choice's index
                tokens[f"{external}#{_child_of(internal, external)}"] = count
        self.record(epoch, version, tokens, result["answers"])
        return list(result["answers"])

    def record(self, epoch: int, version: object, tokens: dict[str, int] | None, answers: Any) -> None:
        """Keep apply ``epoch`` if every worker applied ``version``."""
        ok = isinstance(version, int) and all(not (isinstance(a, dict) and a.get("error")) for a in answers)
        if ok and self._tracked:
            assert isinstance(version, int)
            self._applies.append(_Apply(epoch, version, tokens))

    def note_unknown(self, version: int) -> None:
        """An apply made behind the flow (vLLM's weight-update routes): its starts are unknown."""
        self.epoch += 1
        if self._tracked:
            self._applies.append(_Apply(self.epoch, version, None))

    # ---------------------------------------------------------------- the HTTP side

    def track(self, admitted: int | None) -> str:
        """Start tracking a request admitted at ``admitted``; the marker to put in its id."""
        marker = "dsv" + secrets.token_hex(12)
        self._tracked[marker] = _Tracked(admitted, self.epoch)
        return marker

    def untrack(self, marker: str) -> None:
        self._tracked.pop(marker, None)
        oldest = min((t.epoch for t in self._tracked.values()), default=None)
        self._applies = [a for a in self._applies if oldest is not None and a.epoch >= oldest]

    def versions(self, marker: str) -> list[TokenVersions] | None:
        """Each choice's ``[(version, first_token), ...]``, in choice order (None if untracked)."""
        tracked = self._tracked.get(marker)
        if tracked is None:
            return None
        admitted = tracked.admitted
        applies = [a for a in self._applies if a.epoch >= tracked.epoch and (admitted is None or a.version > admitted)]
        result = []
        for internal, choice in sorted(tracked.choices.items(), key=lambda item: (item[1].prompt, item[1].child)):
            entries: TokenVersions = [(admitted, 0)]
            for item in applies:
                if item.tokens is None:
                    start: int | None = 0 if choice.sent_epoch >= item.epoch else None
                elif internal in item.tokens or f"{choice.external}#{choice.child}" in item.tokens:
                    start = item.tokens.get(internal, item.tokens.get(f"{choice.external}#{choice.child}"))
                elif choice.sent_epoch >= item.epoch:
                    start = 0  # sent after the write: every token is the new version's
                else:
                    continue  # finished before the write
                if entries[-1][0] == item.version:
                    continue
                entries.append((item.version, start))
            result.append(entries)
        return result
