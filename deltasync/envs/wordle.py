"""Wordle as an OpenEnv environment server, for async GRPO rollouts.

The trainer plays many games at once against one server, each game a session of its own. The
server is openenv-core's (``create_fastapi_app`` around :class:`WordleEnvironment`) and speaks its
protocol unchanged, so any OpenEnv client works; :class:`WordleEnvClient` (async) and
:class:`WordleClient` (blocking) are typed ones. Run it with
``python -m deltasync.envs.wordle --host 0.0.0.0 --port 8001 [--max-sessions 256]``.

Protocol (openenv-core 0.3)
---------------------------
WebSocket ``/ws``: one connection is one session with a game of its own, up to ``max_sessions``
at once (one more gets a ``CAPACITY_REACHED`` error and is closed). Each frame is a JSON object::

    -> {"type": "reset", "data": {"seed": 7}}             seed and episode_id optional
    <- {"type": "observation", "data": {"observation": {...}, "reward": null, "done": false}}
    -> {"type": "step", "data": {"guess": "[crane]"}}
    <- {"type": "observation", "data": {"observation": {...}, "reward": 0.4, "done": false}}
    -> {"type": "state"}                                  <- {"type": "state", "data": {...}}
    -> {"type": "close"}

A bad frame gets ``{"type": "error", "data": {"message": ..., "code": ...}}`` and the session
stays open: ``INVALID_JSON``, ``VALIDATION_ERROR`` (not an object, binary, a missing or non-string
``guess``, an unknown field), ``UNKNOWN_TYPE``, ``MESSAGE_TOO_LARGE``, ``EXECUTION_ERROR`` (a
step before any reset or after the game ended, a bad seed).

HTTP: ``POST /reset`` ``{"seed": 7}`` and ``POST /step``
``{"action": {"guess": "crane"}, "episode_id": "..."}`` answer
``{"observation": {...}, "reward": ..., "done": ...}``. openenv's HTTP routes keep no session, so
the server keeps the ``max_http_episodes`` most recently used games by ``episode_id`` (every
observation carries it) and ``/step`` names its game. Errors: 422 for malformed JSON or actions,
400 ``BAD_REQUEST``, 404 ``UNKNOWN_EPISODE``, 409 ``NO_GAME`` / ``GAME_OVER``, 413
``MESSAGE_TOO_LARGE`` (bodies and frames are capped at ``max_message_bytes``). Also ``GET
/health``, ``/schema``, ``/metadata`` and ``/state`` (stateless in openenv: a fresh game's).

Game
----
The secret is ``draw_secret(seed)``, so every generation of a GRPO group that resets with the
group's seed plays the same word; without a seed the server draws one. Six guesses, and every
step uses one, invalid guesses included, so a rollout ends within six turns. A guess is the last
``[word]`` in brackets of the action text (TextArena's format, which TRL's Wordle example asks
for), or the text itself when it is one bare word. Feedback is one letter per position, ``G``
right letter and place, ``Y`` in the word elsewhere, ``X`` not in the word; a letter is marked
``G`` or ``Y`` at most as many times as the secret holds it (see :func:`score_guess`).

Rewards
-------
Every step's ``reward`` is ``win*correct + green*greens + yellow*yellows - repeat*repeated -
invalid*invalid`` (weights: :class:`RewardWeights`, all 1.0 by default), and the observation's
``reward_components`` holds the terms:

- ``correct``: 1.0 when the guess is the secret.
- ``greens`` / ``yellows``: the fraction of letters marked ``G`` / ``Y``; 0.0 for a repeated guess,
  so that repeating a good guess earns nothing.
- ``repeated``: 1.0 when the word was guessed before in this game.
- ``invalid``: 1.0 when no guess could be read, or it is not five letters, or not in the list.

These are the terms of TRL's Wordle example (``reward_correct``, ``reward_greens``,
``reward_yellows``, ``reward_repetition``, summed with equal weights), as per-step rewards with
penalties. :func:`episode_rewards` turns a game's observations into per-rollout values for TRL
reward functions; :func:`judge_guess` and :func:`guess_reward` score a reply offline.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import re
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

from .._errors import ConfigError, DeltaSyncError, FormatError

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from openenv.core.client_types import StepResult
    from openenv.core.env_client import EnvClient
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, ConcurrencyConfig, EnvironmentMetadata, Observation, State
    from pydantic import BaseModel, ConfigDict, Field, StrictStr
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"deltasync.envs.wordle needs the 'wordle' extra ({exc}); install it with: pip install 'deltasync[wordle]'"
    ) from exc

__all__ = [
    "MAX_GUESSES",
    "WORD_LENGTH",
    "BoardRow",
    "GuessOutcome",
    "RewardComponents",
    "RewardWeights",
    "WordleAction",
    "WordleClient",
    "WordleEnvClient",
    "WordleEnvironment",
    "WordleObservation",
    "WordleRequestError",
    "WordleServerConfig",
    "WordleServerError",
    "WordleState",
    "allowed_words",
    "answer_words",
    "create_wordle_app",
    "draw_secret",
    "episode_rewards",
    "feedback_counts",
    "guess_reward",
    "judge_guess",
    "main",
    "parse_guess",
    "score_guess",
    "serve",
]

WORD_LENGTH = 5
MAX_GUESSES = 6

_WORD = re.compile(r"[a-z]+")
_BRACKETED = re.compile(r"\[\s*([A-Za-z]+)\s*\]")
_BARE = re.compile(r"[A-Za-z]+")
_STEP_OPTIONS = frozenset({"episode_id", "timeout_s", "request_id"})

PROMPT = f"""You are playing Wordle. A secret {WORD_LENGTH}-letter English word has been chosen; \
find it in at most {{max_guesses}} guesses.
Reply with one guess per turn: a {WORD_LENGTH}-letter word in square brackets, e.g. [crane].
After each guess you get one letter of feedback per position:
  G (green): the letter is in the word, in this position.
  Y (yellow): the letter is in the word, in another position.
  X: the letter is not in the word (or not as many times as you used it).
Every guess uses up a turn, invalid and repeated guesses too."""


class WordleRequestError(DeltaSyncError, ValueError):
    """A reset or step the game cannot take; ``status`` is its HTTP status, ``code`` a short tag."""

    def __init__(self, message: str, *, code: str = "BAD_REQUEST", status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class WordleServerError(DeltaSyncError, RuntimeError):
    """The Wordle server answered a client's message with an error; ``code`` is the server's tag."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(f"{message} (code: {code})")
        self.code = code


# ---------------------------------------------------------------------------------------------
# Rules: pure functions, usable by a trainer's reward functions without a server.


def score_guess(secret: str, guess: str) -> str:
    """Wordle feedback for ``guess`` against ``secret``: one of ``G``, ``Y``, ``X`` per letter.

    Greens are marked first; then, left to right, a letter is ``Y`` while the secret still holds
    an unmatched copy of it, else ``X``. So ``score_guess("abbey", "babes") == "YYGGX"`` and
    ``score_guess("crane", "eerie") == "XXYXG"`` (the green ``e`` uses the only ``e``).
    """
    for name, word in (("secret", secret), ("guess", guess)):
        if not isinstance(word, str) or not _WORD.fullmatch(word):
            raise ValueError(f"{name}={word!r} is not a word of lower-case letters a-z")
    if len(secret) != len(guess):
        raise ValueError(f"guess {guess!r} has {len(guess)} letters, secret {secret!r} has {len(secret)}")
    feedback = ["X"] * len(guess)
    unmatched: dict[str, int] = {}
    for i, (s, g) in enumerate(zip(secret, guess)):
        if s == g:
            feedback[i] = "G"
        else:
            unmatched[s] = unmatched.get(s, 0) + 1
    for i, g in enumerate(guess):
        if feedback[i] != "G" and unmatched.get(g, 0) > 0:
            feedback[i] = "Y"
            unmatched[g] -= 1
    return "".join(feedback)


def parse_guess(text: str) -> str | None:
    """The guess in ``text``, lower-cased, or None when there is none.

    The guess is the last ``[word]`` in square brackets (a model's reply may name other words
    before settling); with no brackets, ``text`` itself when it is one bare word (surrounding
    spaces, quotes and final punctuation aside). The result may still be the wrong length or
    not a word: :func:`judge_guess` decides.
    """
    bracketed = _BRACKETED.findall(text)
    if bracketed:
        return bracketed[-1].lower()
    bare = text.strip().strip("\"'`*").rstrip(".!?,;:").strip()
    return bare.lower() if _BARE.fullmatch(bare) else None


def feedback_counts(feedback: str) -> tuple[int, int]:
    """``(greens, yellows)`` in a feedback string such as ``"XYGXX"`` (spaces ignored)."""
    return feedback.count("G"), feedback.count("Y")


@functools.cache
def answer_words() -> tuple[str, ...]:
    """The shipped secret words, sorted (``data/wordle_answers.txt``)."""
    return _read_word_list("wordle_answers.txt")


@functools.cache
def allowed_words() -> frozenset[str]:
    """Every accepted guess (``data/wordle_allowed.txt``), answers included."""
    return frozenset(_read_word_list("wordle_allowed.txt")) | frozenset(answer_words())


def _read_word_list(name: str) -> tuple[str, ...]:
    text = resources.files(__package__).joinpath("data", name).read_text(encoding="utf-8")
    words = text.split()
    for number, word in enumerate(words, 1):
        if len(word) != WORD_LENGTH or not _WORD.fullmatch(word):
            raise FormatError(
                f"deltasync/envs/data/{name}: word {number} {word!r} is not {WORD_LENGTH} lower-case letters a-z; "
                "reinstall deltasync or rebuild the list (see deltasync/envs/data/README.md)"
            )
    if not words:
        raise FormatError(f"deltasync/envs/data/{name} is empty; reinstall deltasync")
    return tuple(words)


def draw_secret(seed: int, answers: Sequence[str] | None = None) -> str:
    """The secret word a game reset with ``seed`` plays: the same on every machine and run."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise WordleRequestError(f"seed={seed!r}: a seed is an integer >= 0, or null for a random word")
    pool = answer_words() if answers is None else answers
    return pool[random.Random(seed).randrange(len(pool))]


@dataclass(kw_only=True, frozen=True)
class RewardWeights:
    """How much each reward term counts; a step's reward is their weighted sum."""

    win: float = 1.0
    """Paid on the guess that finds the word."""
    green: float = 1.0
    """Times the fraction of letters marked G in a guess not made before."""
    yellow: float = 1.0
    """Times the fraction of letters marked Y in a guess not made before."""
    repeat: float = 1.0
    """Subtracted for a guess made before in the same game."""
    invalid: float = 1.0
    """Subtracted for an unreadable guess, or one not five letters, or not in the word list."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(
                    f"RewardWeights.{f.name}={value!r}: a weight is a finite number >= 0 "
                    "(penalties are subtracted already)"
                )


@dataclass(frozen=True)
class RewardComponents:
    """The terms of one step's reward, each 0.0 to 1.0."""

    correct: float = 0.0
    greens: float = 0.0
    yellows: float = 0.0
    repeated: float = 0.0
    invalid: float = 0.0

    def total(self, weights: RewardWeights | None = None) -> float:
        """The step's reward under ``weights`` (default :class:`RewardWeights`)."""
        w = weights or RewardWeights()
        return (
            w.win * self.correct
            + w.green * self.greens
            + w.yellow * self.yellows
            - w.repeat * self.repeated
            - w.invalid * self.invalid
        )

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class GuessOutcome:
    """What one guess did: the word read (None if none), its feedback (None if invalid), why
    it is invalid (None if valid) and the reward terms."""

    guess: str | None
    feedback: str | None
    error: str | None
    components: RewardComponents


def judge_guess(
    secret: str, text: str, previous: Collection[str] = (), allowed: Collection[str] | None = None
) -> GuessOutcome:
    """Read and score one guess: ``text`` is the action (a bare word or a reply with a
    ``[word]``), ``previous`` the words guessed before in this game, ``allowed`` the word list
    (default :func:`allowed_words`)."""
    words = allowed_words() if allowed is None else allowed
    guess = parse_guess(text)
    if guess is None:
        error = (
            f"no guess found in {_clip(text)!r}: "
            f"reply with a {WORD_LENGTH}-letter word in square brackets, e.g. [crane]"
        )
    elif len(guess) != WORD_LENGTH:
        error = f"[{_clip(guess)}] has {len(guess)} letters; a guess has exactly {WORD_LENGTH}"
    elif guess not in words:
        error = f"[{guess}] is not in the word list; guess an English {WORD_LENGTH}-letter word"
    else:
        feedback = score_guess(secret, guess)
        if guess in previous:
            return GuessOutcome(guess, feedback, None, RewardComponents(repeated=1.0))
        greens, yellows = feedback_counts(feedback)
        components = RewardComponents(
            correct=float(guess == secret), greens=greens / WORD_LENGTH, yellows=yellows / WORD_LENGTH
        )
        return GuessOutcome(guess, feedback, None, components)
    return GuessOutcome(guess, None, error, RewardComponents(invalid=1.0))


def guess_reward(
    secret: str, text: str, previous: Collection[str] = (), weights: RewardWeights | None = None
) -> float:
    """The reward the server would pay for ``text`` as the next guess after ``previous``."""
    return judge_guess(secret, text, previous).components.total(weights)


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------------------------
# Wire types: openenv Action / Observation / State subclasses.


class BoardRow(BaseModel):
    """One scored guess: the word and its feedback, e.g. ``crane`` / ``XYGXX``."""

    model_config = ConfigDict(extra="forbid")

    guess: str
    feedback: str


class WordleAction(Action):
    """A guess: a bare word (``crane``), a bracketed one (``[crane]``) or a model's whole reply,
    whose last ``[word]`` is the guess."""

    guess: StrictStr = Field(description="The guess, bare or in square brackets; the last [word] counts.")


class WordleObservation(Observation):
    """What the player sees after a reset or a guess; ``reward`` and ``done`` as in openenv."""

    episode_id: str = Field(default="", description="This game's id; HTTP /step names it.")
    prompt: str = Field(default="", description="The rules, for the model's first message.")
    message: str = Field(default="", description="This step in words, TextArena-style ('Feedback:' lines).")
    guess: str | None = Field(default=None, description="The word read from the action, if any.")
    feedback: str | None = Field(default=None, description="G/Y/X per letter; null for an invalid guess.")
    valid: bool = Field(default=True, description="False when the guess was unreadable or not a listed word.")
    error: str | None = Field(default=None, description="Why the guess was invalid.")
    board: list[BoardRow] = Field(default_factory=list, description="Every scored guess so far, in order.")
    guesses_left: int = Field(default=MAX_GUESSES, description="Guesses this game still allows.")
    max_guesses: int = Field(default=MAX_GUESSES, description="Guesses a game allows.")
    won: bool = Field(default=False, description="True once the secret is found.")
    secret: str | None = Field(default=None, description="The secret, revealed when the game is over.")
    reward_components: dict[str, float] = Field(
        default_factory=dict, description="correct, greens, yellows, repeated, invalid: the terms of reward."
    )


class WordleState(State):
    """A game's state (``/ws`` ``state``); the secret only once the game is over."""

    board: list[BoardRow] = Field(default_factory=list)
    guesses_left: int = MAX_GUESSES
    max_guesses: int = MAX_GUESSES
    invalid_guesses: int = 0
    repeated_guesses: int = 0
    won: bool = False
    done: bool = False
    secret: str | None = None


def episode_rewards(observations: Sequence[WordleObservation]) -> dict[str, float]:
    """Per-rollout values from one game's observations (the reset's may be included), for TRL
    reward functions: ``correct`` (1.0 if won), ``greens`` and ``yellows`` of the last guess
    (TRL's example scores the last turn), ``repetition`` and ``invalid`` (the fraction of
    guesses that were repeated / invalid) and ``total``, the sum of the step rewards."""
    steps = [obs for obs in observations if obs.reward_components]
    if not steps:
        return {"correct": 0.0, "greens": 0.0, "yellows": 0.0, "repetition": 0.0, "invalid": 0.0, "total": 0.0}
    last = steps[-1].reward_components
    return {
        "correct": float(any(obs.won for obs in steps)),
        "greens": last.get("greens", 0.0),
        "yellows": last.get("yellows", 0.0),
        "repetition": sum(obs.reward_components.get("repeated", 0.0) for obs in steps) / len(steps),
        "invalid": sum(obs.reward_components.get("invalid", 0.0) for obs in steps) / len(steps),
        "total": sum(float(obs.reward or 0.0) for obs in steps),
    }


# ---------------------------------------------------------------------------------------------
# Server.


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
            raise WordleRequestError(f"episode_id={_clip(repr(episode_id))}: needs a string of 1 to 255 characters")
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
            raise WordleRequestError(f"episode_id={_clip(repr(episode_id))}: needs the string that /reset returned")
        with self._lock:
            game = self._games.get(episode_id)
            if game is not None:
                self._games.move_to_end(episode_id)
        if game is None:
            raise WordleRequestError(
                f"unknown episode_id {_clip(episode_id)!r}: no game has it, or it was among the least recently "
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
    """``python -m deltasync.envs.wordle``: serve until interrupted; 2 on bad options."""
    parser = argparse.ArgumentParser(
        prog="python -m deltasync.envs.wordle",
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


# ---------------------------------------------------------------------------------------------
# Clients.


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


if __name__ == "__main__":
    raise SystemExit(main())
