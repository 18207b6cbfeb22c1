"""Where each version began in every response: taken where the write happens.

Every apply (in-flight or paused, from the update route, follow mode or ``/collective_rpc``)
goes through :meth:`TokenVersionLog.apply`, which runs it as :meth:`deltasync.server.seam.Engine.apply`:
between two engine steps, the engine counts the output tokens of each unfinished request and
then runs ``deltasync_apply`` on every worker. No step runs in between: a request with ``k``
tokens then has its token ``k`` sampled with the new weights (vLLM's count is taken in its
engine core: see :mod:`vllm_ext._vllm_engine`).

:class:`TokenVersionLog` ties engine requests to HTTP requests. The middleware gives every
completion and chat request an ``X-Request-Id`` holding a unique marker, which the engine puts
into the engine request's id. A request the engine does not hold at the write either finished
before it or was sent after it: the log stamps each engine request with the number of applies
sent before its own (:meth:`deltasync.server.seam.Engine.watch_requests`), and the engine handles its
input in the order it was sent.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from deltasync.protocol import ApplyCall, TokenVersions

from .seam import Engine, SentRequest

__all__ = ["TokenVersionLog"]

_MARKER = re.compile(r"dsv[0-9a-f]{24}")


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


class TokenVersionLog:
    """The API-server process's record of where each version began, per tracked request."""

    def __init__(self) -> None:
        self.epoch = 0
        """Applies sent to the engine so far."""
        self._tracked: dict[str, _Tracked] = {}
        self._applies: list[_Apply] = []

    # ---------------------------------------------------------------- the engine side

    def hook(self, engine: Engine) -> None:
        """Stamp each engine request of a tracked HTTP request with the applies sent before it."""
        engine.watch_requests(self.sent)

    def sent(self, request: SentRequest) -> None:
        """``request`` is about to be sent to the engine (see :meth:`Engine.watch_requests`)."""
        external = request.external_id
        found = _MARKER.search(external)
        tracked = self._tracked.get(found.group()) if found else None
        if tracked is None or not found:
            return
        rest = external[found.end() :]
        prompt = int(rest[1:]) if rest.startswith("-") and rest[1:].isdigit() else 0
        tracked.choices[request.request_id] = _Choice(prompt, request.choice, self.epoch, external)

    async def apply(self, engine: Engine, call: ApplyCall) -> list[Any]:
        """Run ``call`` on every worker (:meth:`Engine.apply`) and record where its version
        began; the workers' answers."""
        self.epoch += 1
        epoch = self.epoch
        applied = await engine.apply(call)
        tokens: dict[str, int] | None = None
        if applied.tokens is not None:
            tokens = {}
            for counted in applied.tokens:
                request = counted.request
                tokens[request.request_id] = counted.output_tokens
                if request.external_id:  # also by the id this server gave it, and the choice's index
                    tokens[f"{request.external_id}#{request.choice}"] = counted.output_tokens
        self.record(epoch, call.version, tokens, applied.answers)
        return list(applied.answers)

    def record(self, epoch: int, version: int, tokens: dict[str, int] | None, answers: Any) -> None:
        """Keep apply ``epoch`` if every worker applied ``version``."""
        ok = all(not (isinstance(a, dict) and a.get("error")) for a in answers)
        if ok and self._tracked:
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
