"""Wordle's wire types: openenv ``Action`` / ``Observation`` / ``State`` subclasses."""

from __future__ import annotations

from collections.abc import Sequence

try:
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import BaseModel, ConfigDict, Field, StrictStr
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        f"deltasync.examples.wordle needs the 'wordle' extra ({exc}); install it with: pip install 'deltasync[wordle]'"
    ) from exc

from ._rules import MAX_GUESSES


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
