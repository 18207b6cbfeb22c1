"""RL environments for deltasync's examples, served over openenv-core's protocol.

:mod:`deltasync.envs.wordle` is a Wordle server (``python -m deltasync.envs.wordle``) with its
clients and reward helpers. It needs the ``wordle`` extra (``pip install 'deltasync[wordle]'``);
the names below load it on first use, so ``import deltasync.envs`` alone needs nothing more.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .wordle import (
        MAX_GUESSES,
        WORD_LENGTH,
        BoardRow,
        GuessOutcome,
        RewardComponents,
        RewardWeights,
        WordleAction,
        WordleClient,
        WordleEnvClient,
        WordleEnvironment,
        WordleObservation,
        WordleRequestError,
        WordleServerConfig,
        WordleServerError,
        WordleState,
        allowed_words,
        answer_words,
        create_wordle_app,
        draw_secret,
        episode_rewards,
        feedback_counts,
        guess_reward,
        judge_guess,
        main,
        parse_guess,
        score_guess,
        serve,
    )

# The same names as deltasync.envs.wordle.__all__; tests/envs/test_wordle.py checks that this
# list, the import above and the module's own list agree.
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


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".wordle", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
