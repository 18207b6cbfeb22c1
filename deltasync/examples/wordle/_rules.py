"""Wordle's rules and rewards: pure functions, usable by a trainer's reward functions without a server."""

from __future__ import annotations

import functools
import math
import random
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields
from importlib import resources

from ...errors import ConfigError, FormatError
from .._errors import WordleRequestError

WORD_LENGTH = 5
MAX_GUESSES = 6

_WORD = re.compile(r"[a-z]+")
_BRACKETED = re.compile(r"\[\s*([A-Za-z]+)\s*\]")
_BARE = re.compile(r"[A-Za-z]+")

PROMPT = f"""You are playing Wordle. A secret {WORD_LENGTH}-letter English word has been chosen; \
find it in at most {{max_guesses}} guesses.
Reply with one guess per turn: a {WORD_LENGTH}-letter word in square brackets, e.g. [crane].
After each guess you get one letter of feedback per position:
  G (green): the letter is in the word, in this position.
  Y (yellow): the letter is in the word, in another position.
  X: the letter is not in the word (or not as many times as you used it).
Every guess uses up a turn, invalid and repeated guesses too."""


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
                f"deltasync/examples/wordle/data/{name}: word {number} {word!r} is not {WORD_LENGTH} lower-case "
                "letters a-z; reinstall deltasync or rebuild the list (see deltasync/examples/wordle/data/README.md)"
            )
    if not words:
        raise FormatError(f"deltasync/examples/wordle/data/{name} is empty; reinstall deltasync")
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
            f"no guess found in {clip(text)!r}: "
            f"reply with a {WORD_LENGTH}-letter word in square brackets, e.g. [crane]"
        )
    elif len(guess) != WORD_LENGTH:
        error = f"[{clip(guess)}] has {len(guess)} letters; a guess has exactly {WORD_LENGTH}"
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


def clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
