"""Wordle as an OpenEnv environment server, for async GRPO rollouts.

Modules: ``_rules`` (words, scoring, rewards; no server needed), ``_models`` (wire types),
``_server`` (the environment and its app), ``_client`` (typed clients).

The trainer plays many games at once against one server, each game a session of its own. The
server is openenv-core's (``create_fastapi_app`` around :class:`WordleEnvironment`) and speaks its
protocol unchanged, so any OpenEnv client works; :class:`WordleEnvClient` (async) and
:class:`WordleClient` (blocking) are typed ones. Run it with
``python -m deltasync.examples.wordle --host 0.0.0.0 --port 8001 [--max-sessions 256]``.

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

from .._errors import WordleRequestError, WordleServerError
from ._client import WordleClient, WordleEnvClient
from ._models import BoardRow, WordleAction, WordleObservation, WordleState, episode_rewards
from ._rules import (
    MAX_GUESSES,
    WORD_LENGTH,
    GuessOutcome,
    RewardComponents,
    RewardWeights,
    allowed_words,
    answer_words,
    draw_secret,
    feedback_counts,
    guess_reward,
    judge_guess,
    parse_guess,
    score_guess,
)
from ._server import WordleEnvironment, WordleServerConfig, create_wordle_app, main, serve

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
