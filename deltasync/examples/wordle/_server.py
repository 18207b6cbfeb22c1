"""The Wordle server: openenv's FastAPI app around :class:`WordleEnvironment`, sessions and limits."""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from .._errors import WordleRequestError

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import ConcurrencyConfig, EnvironmentMetadata
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"deltasync.examples.wordle needs the 'wordle' extra ({exc}); install it with: pip install 'deltasync[wordle]'"
    ) from exc

from ._models import BoardRow, WordleAction, WordleObservation, WordleState
from ._rules import (
    MAX_GUESSES,
    PROMPT,
    WORD_LENGTH,
    GuessOutcome,
    RewardWeights,
    allowed_words,
    answer_words,
    clip,
    draw_secret,
    judge_guess,
)

_STEP_OPTIONS = frozenset({"episode_id", "timeout_s", "request_id"})


@dataclass(kw_only=True)
class WordleServerConfig:
    """Options of a Wordle server."""

    max_sessions: int = 256
    """WebSocket sessions (one game each) served at once; one more is refused with CAPACITY_REACHED."""
    max_http_episodes: int = 4096
    """Games that HTTP /step can name by episode_id; the least recently used beyond this are forgotten."""
    max_guesses: int = MAX_GUESSES
    """Guesses per game."""
    max_message_bytes: int = 64 * 1024
    """Largest HTTP body or WebSocket frame accepted; larger ones get MESSAGE_TOO_LARGE."""
    idle_timeout_s: float | None = 600.0
    """WebSocket sessions idle this long are ended; None keeps them until the client leaves."""
    seed: int | None = None
    """Seed of the draws for resets that bring no seed; None draws from the OS."""
    rewards: RewardWeights = field(default_factory=RewardWeights)
    """Weights of the reward terms."""

    def __post_init__(self) -> None:
        minimums = {"max_sessions": 1, "max_http_episodes": 1, "max_guesses": 1, "max_message_bytes": 1024}
        for name, low in minimums.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"WordleServerConfig.{name}={value!r}: needs an integer >= {low}")
        if self.idle_timeout_s is not None and not (self.idle_timeout_s > 0 and math.isfinite(self.idle_timeout_s)):
            raise ConfigError(f"WordleServerConfig.idle_timeout_s={self.idle_timeout_s!r}: needs seconds > 0, or None")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"WordleServerConfig.seed={self.seed!r}: needs an integer, or None")
        if not isinstance(self.rewards, RewardWeights):
            raise ConfigError(f"WordleServerConfig.rewards={self.rewards!r}: needs a RewardWeights")


@dataclass(eq=False)
class _Game:
    secret: str
    episode_id: str
    max_guesses: int
    board: list[BoardRow] = field(default_factory=list)
    guessed: set[str] = field(default_factory=set)
    steps: int = 0
    invalid: int = 0
    repeated: int = 0
    won: bool = False

    @property
    def guesses_left(self) -> int:
        return self.max_guesses - self.steps

    @property
    def done(self) -> bool:
        return self.won or self.guesses_left <= 0


class _GameBook:
    """What every session of one server shares: word lists, options, the draw, recent games."""

    def __init__(self, config: WordleServerConfig) -> None:
        self.config = config
        self.answers = answer_words()
        self.allowed = allowed_words()
        self._rng = random.Random(config.seed)
        self._games: OrderedDict[str, _Game] = OrderedDict()
        self._lock = threading.Lock()

    def new_game(self, seed: int | None, episode_id: str | None) -> _Game:
        if episode_id is not None and (not isinstance(episode_id, str) or not 1 <= len(episode_id) <= 255):
            raise WordleRequestError(f"episode_id={clip(repr(episode_id))}: needs a string of 1 to 255 characters")
        with self._lock:
            secret = draw_secret(seed, self.answers) if seed is not None else self._rng.choice(self.answers)
            game = _Game(secret=secret, episode_id=episode_id or uuid.uuid4().hex, max_guesses=self.config.max_guesses)
            self._games[game.episode_id] = game
            self._games.move_to_end(game.episode_id)
            while len(self._games) > self.config.max_http_episodes:
                self._games.popitem(last=False)
        return game

    def find(self, episode_id: object) -> _Game:
        if not isinstance(episode_id, str):
            raise WordleRequestError(f"episode_id={clip(repr(episode_id))}: needs the string that /reset returned")
        with self._lock:
            game = self._games.get(episode_id)
            if game is not None:
                self._games.move_to_end(episode_id)
        if game is None:
            raise WordleRequestError(
                f"unknown episode_id {clip(episode_id)!r}: no game has it, or it was among the least recently "
                f"used beyond the {self.config.max_http_episodes} this server keeps; POST /reset starts a game",
                code="UNKNOWN_EPISODE",
                status=404,
            )
        return game


@functools.cache
def _default_book() -> _GameBook:
    return _GameBook(WordleServerConfig())


class WordleEnvironment(Environment[WordleAction, WordleObservation, WordleState]):
    """One player's Wordle: :meth:`reset` starts a game, :meth:`step` makes a guess.

    The server makes one per WebSocket session, and one per HTTP request; HTTP steps find their
    game by ``episode_id`` in the book that all of a server's environments share.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True
    # openenv gives each session a worker thread to create and close its environment in, unless
    # this is set; a game is microseconds of pure Python, so all sessions share one thread (and
    # reset/step run on the event loop: see reset_async/step_async).
    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    def __init__(self, book: _GameBook | None = None) -> None:
        super().__init__()
        self._book = book or _default_book()
        self._game: _Game | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, **options: Any) -> WordleObservation:
        """Start a game; the secret is ``draw_secret(seed)``, or a random answer without a seed."""
        if options:
            raise WordleRequestError(
                f"unknown reset option {sorted(options)[0]!r}: a reset takes 'seed' and 'episode_id'"
            )
        self._game = self._book.new_game(seed, episode_id)
        return self._observe(self._game, message=f"A new game: you have {self._game.max_guesses} guesses.")

    async def reset_async(
        self, seed: int | None = None, episode_id: str | None = None, **options: Any
    ) -> WordleObservation:
        return self.reset(seed=seed, episode_id=episode_id, **options)

    def step(
        self, action: WordleAction, timeout_s: float | None = None, episode_id: str | None = None, **options: Any
    ) -> WordleObservation:
        """Make a guess in this session's game, or in game ``episode_id`` (HTTP)."""
        unknown = sorted(set(options) - _STEP_OPTIONS)
        if unknown:
            raise WordleRequestError(f"unknown step option {unknown[0]!r}: a step takes 'action' and 'episode_id'")
        if episode_id is not None:
            game = self._book.find(episode_id)
        elif self._game is not None:
            game = self._game
        else:
            raise WordleRequestError(
                "no game to step: over HTTP, pass the episode_id that /reset returned (HTTP requests share no "
                "session); over the WebSocket, send a reset first",
                code="NO_GAME",
                status=409,
            )
        return self._play(game, action.guess)

    async def step_async(
        self, action: WordleAction, timeout_s: float | None = None, **options: Any
    ) -> WordleObservation:
        return self.step(action, timeout_s=timeout_s, **options)

    @property
    def state(self) -> WordleState:
        game = self._game
        if game is None:
            return WordleState(guesses_left=self._book.config.max_guesses, max_guesses=self._book.config.max_guesses)
        return WordleState(
            episode_id=game.episode_id,
            step_count=game.steps,
            board=list(game.board),
            guesses_left=game.guesses_left,
            max_guesses=game.max_guesses,
            invalid_guesses=game.invalid,
            repeated_guesses=game.repeated,
            won=game.won,
            done=game.done,
            secret=game.secret if game.done else None,
        )

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="wordle",
            description=f"Wordle: find a {WORD_LENGTH}-letter word in {self._book.config.max_guesses} guesses "
            "with G/Y/X feedback. Reward terms: correct, greens, yellows, repeated, invalid (see reward_components).",
            version="1",
        )

    def _play(self, game: _Game, text: str) -> WordleObservation:
        if game.done:
            raise WordleRequestError(
                f"game {game.episode_id} is over ({'won' if game.won else 'lost'}); reset to start another",
                code="GAME_OVER",
                status=409,
            )
        outcome = judge_guess(game.secret, text, game.guessed, self._book.allowed)
        game.steps += 1
        if outcome.error is not None:
            game.invalid += 1
            lines = [f"Invalid guess: {outcome.error}."]
        else:
            assert outcome.guess is not None and outcome.feedback is not None
            repeated = outcome.guess in game.guessed
            game.repeated += repeated
            game.guessed.add(outcome.guess)
            game.board.append(BoardRow(guess=outcome.guess, feedback=outcome.feedback))
            game.won = outcome.guess == game.secret
            lines = [
                f"You submitted [{outcome.guess}]" + (" again: you guessed it before." if repeated else "."),
                "Feedback:",
                " ".join(outcome.guess.upper()),
                " ".join(outcome.feedback),
                "",
            ]
        if game.won:
            lines.append(f"You found the word in {game.steps} guesses!")
        elif game.done:
            lines.append(f"No guesses left: the word was [{game.secret}].")
        else:
            lines.append(f"You have {game.guesses_left} guess{'es' if game.guesses_left > 1 else ''} left.")
        return self._observe(
            game,
            message="\n".join(lines),
            outcome=outcome,
            reward=outcome.components.total(self._book.config.rewards),
        )

    def _observe(
        self, game: _Game, *, message: str, outcome: GuessOutcome | None = None, reward: float | None = None
    ) -> WordleObservation:
        return WordleObservation(
            episode_id=game.episode_id,
            prompt=PROMPT.format(max_guesses=game.max_guesses),
            message=message,
            guess=outcome.guess if outcome else None,
            feedback=outcome.feedback if outcome else None,
            valid=outcome is None or outcome.error is None,
            error=outcome.error if outcome else None,
            board=list(game.board),
            guesses_left=game.guesses_left,
            max_guesses=game.max_guesses,
            won=game.won,
            secret=game.secret if game.done else None,
            reward_components=outcome.components.as_dict() if outcome else {},
            reward=reward,
            done=game.done,
        )


class _MessageGuard:
    """ASGI middleware: caps HTTP bodies and WebSocket frames at ``max_bytes``, and answers a
    frame that is not a JSON object with an error (openenv would end the session on it)."""

    def __init__(self, app: Callable[..., Any], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "http":
            await self._http(scope, receive, send)
        elif scope["type"] == "websocket":
            await self.app(scope, self._guard_frames(receive, send), send)
        else:
            await self.app(scope, receive, send)

    def _too_large(self, size: int | str) -> str:
        return f"message of {size} bytes is over this server's limit of {self.max_bytes} (--max-message-bytes)"

    async def _http(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send, self._too_large(int(declared)))
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._reject(send, self._too_large(f"more than {self.max_bytes}"))
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, send: Callable[..., Any], detail: str) -> None:
        payload = json.dumps({"detail": detail, "code": "MESSAGE_TOO_LARGE"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    def _guard_frames(self, receive: Callable[..., Any], send: Callable[..., Any]) -> Callable[..., Any]:
        async def guarded() -> dict[str, Any]:
            while True:
                message = await receive()
                if message["type"] != "websocket.receive":
                    return message
                problem = self._frame_problem(message)
                if problem is None:
                    return message
                await send({"type": "websocket.send", "text": json.dumps({"type": "error", "data": problem})})

        return guarded

    def _frame_problem(self, message: dict[str, Any]) -> dict[str, str] | None:
        text = message.get("text")
        size = len(message.get("bytes") or b"") if text is None else len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            return {"message": self._too_large(size), "code": "MESSAGE_TOO_LARGE"}
        if text is None:
            return {"message": "binary frame: send JSON text frames", "code": "VALIDATION_ERROR"}
        stripped = text.lstrip()
        if stripped and not stripped.startswith("{"):
            try:
                kind = type(json.loads(stripped)).__name__
            except ValueError:
                return None  # openenv answers INVALID_JSON
            return {
                "message": f'a message is a JSON object such as {{"type": "reset"}}, not a {kind}',
                "code": "VALIDATION_ERROR",
            }
        return None


async def _request_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, WordleRequestError)
    return JSONResponse(status_code=exc.status, content={"detail": str(exc), "code": exc.code})


def create_wordle_app(config: WordleServerConfig | None = None) -> FastAPI:
    """The server as an ASGI app (FastAPI): openenv's routes around :class:`WordleEnvironment`."""
    config = config or WordleServerConfig()
    book = _GameBook(config)
    app = create_fastapi_app(
        functools.partial(WordleEnvironment, book=book),
        WordleAction,
        WordleObservation,
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=config.max_sessions, session_timeout=config.idle_timeout_s
        ),
    )
    app.title = "deltasync Wordle environment"
    app.add_exception_handler(WordleRequestError, _request_error)
    app.add_middleware(_MessageGuard, max_bytes=config.max_message_bytes)
    return app


def serve(
    config: WordleServerConfig | None = None, *, host: str = "127.0.0.1", port: int = 8001, log_level: str = "info"
) -> None:
    """Run the server with uvicorn until interrupted."""
    config = config or WordleServerConfig()
    uvicorn.run(
        create_wordle_app(config),
        host=host,
        port=port,
        log_level=log_level,
        # Frames between max_message_bytes and this get a MESSAGE_TOO_LARGE reply; beyond it
        # the connection is closed (1009) before the frame is buffered whole.
        ws_max_size=max(16 * config.max_message_bytes, 1 << 20),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deltasync.examples.wordle``: serve until interrupted; 2 on bad options."""
    parser = argparse.ArgumentParser(
        prog="python -m deltasync.examples.wordle",
        description="Serve Wordle games over HTTP and WebSocket (openenv-core's protocol).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = WordleServerConfig()
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on")
    parser.add_argument(
        "--max-sessions", type=int, default=defaults.max_sessions, help="WebSocket sessions (games) at once"
    )
    parser.add_argument(
        "--max-http-episodes",
        type=int,
        default=defaults.max_http_episodes,
        help="recent games that HTTP /step can name by episode_id",
    )
    parser.add_argument("--max-guesses", type=int, default=defaults.max_guesses, help="guesses per game")
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=defaults.max_message_bytes,
        help="largest HTTP body or WebSocket frame accepted",
    )
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=defaults.idle_timeout_s,
        help="end WebSocket sessions idle this long; 0 keeps them",
    )
    parser.add_argument("--seed", type=int, default=None, help="seed of the draws for resets that bring none")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    args = parser.parse_args(argv)
    try:
        config = WordleServerConfig(
            max_sessions=args.max_sessions,
            max_http_episodes=args.max_http_episodes,
            max_guesses=args.max_guesses,
            max_message_bytes=args.max_message_bytes,
            idle_timeout_s=args.idle_timeout_s or None,
            seed=args.seed,
        )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    serve(config, host=args.host, port=args.port, log_level=args.log_level)
    return 0
