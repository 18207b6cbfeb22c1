"""Typed Wordle clients: :class:`WordleEnvClient` (async, openenv) and :class:`WordleClient` (blocking)."""

from __future__ import annotations

from typing import Any

from .._errors import WordleServerError

try:
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"deltasync.examples.wordle needs the 'wordle' extra ({exc}); install it with: pip install 'deltasync[wordle]'"
    ) from exc

from ._models import WordleAction, WordleObservation, WordleState


class WordleEnvClient(EnvClient[WordleAction, WordleObservation, WordleState]):
    """Async client: one instance is one WebSocket session, one game at a time.

    ``async with WordleEnvClient("http://host:8001") as env:`` then ``await env.reset(seed=3)``
    and ``await env.step("[crane]")`` return openenv ``StepResult``s of :class:`WordleObservation`.
    Errors from the server raise :class:`WordleServerError`. Many instances on one event loop
    play many games at once; :meth:`sync` (or :class:`WordleClient`) blocks instead.
    """

    def _step_payload(self, action: WordleAction | str) -> dict[str, Any]:
        if isinstance(action, str):
            return {"guess": action}
        return {"guess": action.guess}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[WordleObservation]:
        observation = WordleObservation.model_validate(
            {**payload.get("observation", {}), "reward": payload.get("reward"), "done": payload.get("done", False)}
        )
        return StepResult(observation=observation, reward=observation.reward, done=observation.done)

    def _parse_state(self, payload: dict[str, Any]) -> WordleState:
        return WordleState.model_validate(payload)

    async def _send_and_receive(self, message: dict[str, Any]) -> dict[str, Any]:
        # As openenv's, but the error is typed and keeps the server's code.
        await self._send(message)
        response = await self._receive()
        if response.get("type") == "error":
            data = response.get("data") or {}
            raise WordleServerError(str(data.get("message", "unknown error")), code=str(data.get("code", "UNKNOWN")))
        return response


class WordleClient:
    """Blocking client for the trainer side: one WebSocket session, one game at a time.

    ``with WordleClient("http://host:8001") as env: obs = env.reset(seed=3); obs = env.step("[crane]")``.
    Each instance runs its own event-loop thread; to play hundreds of games at once, use
    :class:`WordleEnvClient` on one loop.
    """

    def __init__(self, url: str, *, connect_timeout_s: float = 10.0, message_timeout_s: float = 60.0) -> None:
        self.url = url
        self._env = WordleEnvClient(
            url, connect_timeout_s=connect_timeout_s, message_timeout_s=message_timeout_s
        ).sync()

    def reset(self, seed: int | None = None, episode_id: str | None = None) -> WordleObservation:
        """Start a new game in this session (the secret is ``draw_secret(seed)`` with a seed)."""
        options: dict[str, Any] = {}
        if seed is not None:
            options["seed"] = seed
        if episode_id is not None:
            options["episode_id"] = episode_id
        return self._env.reset(**options).observation

    def step(self, guess: str) -> WordleObservation:
        """Make a guess (a word, ``[word]``, or a reply whose last ``[word]`` counts)."""
        return self._env.step(WordleAction(guess=guess)).observation

    def state(self) -> WordleState:
        return self._env.state()

    def close(self) -> None:
        self._env.close()

    def __enter__(self) -> WordleClient:
        self._env.connect()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
