"""The Wordle environment: rules, rewards and the in-process environment, without a server
(the real server: tests/integration/envs/test_wordle_server.py).
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from deltasync import ConfigError
from deltasync.examples.wordle import (
    RewardComponents,
    RewardWeights,
    WordleAction,
    WordleEnvironment,
    WordleRequestError,
    WordleServerConfig,
    allowed_words,
    answer_words,
    draw_secret,
    episode_rewards,
    guess_reward,
    judge_guess,
    main,
    parse_guess,
    score_guess,
)

TIMEOUT_S = 10.0


# --- rules -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("secret", "guess", "feedback"),
    [
        ("abbey", "babes", "YYGGX"),  # both b's of the guess match: one green, one yellow
        ("abbey", "kebab", "XYGYY"),
        ("abbey", "bobby", "YXGXG"),  # the third b finds no unmatched b left
        ("crane", "eerie", "XXYXG"),  # the green e uses the only e: earlier e's are X
        ("speed", "erase", "YXXYY"),  # two e's in each, both yellow
        ("those", "geese", "XXXGG"),
        ("pills", "lolly", "XXGGX"),  # the greens use both l's: the first l is X
        ("crane", "crane", "GGGGG"),
        ("crane", "moist", "XXXXX"),
    ],
)
def test_score_guess_hand_worked(secret: str, guess: str, feedback: str) -> None:
    assert score_guess(secret, guess) == feedback


def test_score_guess_marks_each_letter_at_most_as_often_as_the_secret_has_it() -> None:
    rng = random.Random(0)
    words = sorted(allowed_words())
    doubled = [w for w in words if len(set(w)) < len(w)]
    for _ in range(3000):
        secret, guess = rng.choice(doubled), rng.choice(words if rng.random() < 0.5 else doubled)
        feedback = score_guess(secret, guess)
        for i in range(5):
            assert (feedback[i] == "G") == (secret[i] == guess[i]), (secret, guess, feedback)
        hits = Counter(g for g, f in zip(guess, feedback) if f != "X")
        for letter in set(guess):
            assert hits[letter] == min(guess.count(letter), secret.count(letter)), (secret, guess, feedback)
        # Yellows go left to right: an X never comes before a Y of the same letter.
        for letter in set(guess):
            marks = [f for g, f in zip(guess, feedback) if g == letter and f != "G"]
            assert marks == sorted(marks, key=lambda f: f == "X"), (secret, guess, feedback)


@pytest.mark.parametrize(
    ("secret", "guess", "message"),
    [
        ("crane", "cran", "guess 'cran' has 4 letters, secret 'crane' has 5"),
        ("crane", "CRANE", "guess='CRANE' is not a word of lower-case letters a-z"),
        ("cr ne", "crane", "secret='cr ne' is not a word of lower-case letters a-z"),
    ],
)
def test_score_guess_rejects_what_is_not_a_word(secret: str, guess: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        score_guess(secret, guess)
    assert str(info.value) == message


@pytest.mark.parametrize(
    ("text", "guess"),
    [
        ("[crane]", "crane"),
        ("crane", "crane"),
        ("  CRANE.\n", "crane"),
        ('"slate"', "slate"),
        ("I could try [audio], but [Slate] is better. Final: [ crane ]", "crane"),
        ("[toolong]", "toolong"),
        ("two words", None),
        ("", None),
        ("[12345]", None),
    ],
)
def test_parse_guess(text: str, guess: str | None) -> None:
    assert parse_guess(text) == guess


def test_word_lists_ship_with_the_package() -> None:
    answers, allowed = answer_words(), allowed_words()
    assert len(answers) > 1000 and len(allowed) > 5000
    assert list(answers) == sorted(set(answers))
    assert set(answers) <= allowed
    assert all(len(w) == 5 and w.isascii() and w.isalpha() and w.islower() for w in allowed)
    assert {"crane", "slate", "adieu", "birds"} <= allowed


def test_draw_secret_is_fixed_by_the_seed() -> None:
    assert draw_secret(7) == draw_secret(7) in answer_words()
    assert len({draw_secret(seed) for seed in range(50)}) > 40
    assert draw_secret(2, ["aaaaa", "bbbbb"]) in {"aaaaa", "bbbbb"}
    with pytest.raises(WordleRequestError, match=r"seed=-1: a seed is an integer >= 0"):
        draw_secret(-1)


# --- rewards ---------------------------------------------------------------------------------


def test_judge_guess_terms() -> None:
    win = judge_guess("crane", "[crane]")
    assert (win.guess, win.feedback, win.error) == ("crane", "GGGGG", None)
    assert win.components == RewardComponents(correct=1.0, greens=1.0)
    assert win.components.total() == 2.0

    partial = judge_guess("crane", "trace")  # t r a c e vs c r a n e
    assert partial.feedback == "XGGYG"
    assert partial.components == RewardComponents(greens=0.6, yellows=0.2)
    assert partial.components.total() == pytest.approx(0.8)

    repeated = judge_guess("crane", "trace", previous={"trace"})
    assert repeated.feedback == "XGGYG"
    assert repeated.components == RewardComponents(repeated=1.0)
    assert repeated.components.total() == -1.0

    for text, error in [
        ("no idea", "no guess found in 'no idea': reply with a 5-letter word in square brackets, e.g. [crane]"),
        ("[cranes]", "[cranes] has 6 letters; a guess has exactly 5"),
        ("[xqzvj]", "[xqzvj] is not in the word list; guess an English 5-letter word"),
    ]:
        outcome = judge_guess("crane", text)
        assert (outcome.feedback, outcome.error) == (None, error)
        assert outcome.components == RewardComponents(invalid=1.0)


def test_reward_weights() -> None:
    weights = RewardWeights(win=10.0, green=0.5, yellow=0.25, repeat=2.0, invalid=3.0)
    assert RewardComponents(greens=0.6, yellows=0.2).total(weights) == pytest.approx(0.35)
    assert RewardComponents(correct=1.0, greens=1.0).total(weights) == pytest.approx(10.5)
    assert guess_reward("crane", "[trace]", previous=["trace"], weights=weights) == -2.0
    assert guess_reward("crane", "[xqzvj]", weights=weights) == -3.0
    with pytest.raises(ConfigError) as info:
        RewardWeights(green=-1.0)
    assert str(info.value) == (
        "RewardWeights.green=-1.0: a weight is a finite number >= 0 (penalties are subtracted already)"
    )


def test_server_config_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"WordleServerConfig.max_sessions=0: needs an integer >= 1"):
        WordleServerConfig(max_sessions=0)
    with pytest.raises(ConfigError, match=r"WordleServerConfig.max_message_bytes=10: needs an integer >= 1024"):
        WordleServerConfig(max_message_bytes=10)
    with pytest.raises(ConfigError, match=r"idle_timeout_s=-1"):
        WordleServerConfig(idle_timeout_s=-1)


def test_environment_plays_without_a_server() -> None:
    env = WordleEnvironment()
    first = env.reset(seed=4)
    assert (first.reward, first.done, first.guesses_left, first.secret) == (None, False, 6, None)
    assert "square brackets" in first.prompt
    secret = draw_secret(4)
    wrong = next(w for w in answer_words() if w != secret)
    observations = [first, env.step(WordleAction(guess=wrong)), env.step(WordleAction(guess=f"So: [{secret}]"))]
    assert observations[-1].won and observations[-1].done and observations[-1].secret == secret
    assert observations[-1].message.splitlines()[1:4] == ["Feedback:", " ".join(secret.upper()), "G G G G G"]
    assert env.state.won and env.state.step_count == 2
    rewards = episode_rewards(observations)
    assert rewards["correct"] == 1.0 and rewards["greens"] == 1.0
    assert rewards["total"] == pytest.approx(2.0 + observations[1].reward)
    with pytest.raises(WordleRequestError, match=r"is over \(won\); reset to start another") as info:
        env.step(WordleAction(guess="crane"))
    assert (info.value.code, info.value.status) == ("GAME_OVER", 409)
    with pytest.raises(WordleRequestError, match=r"unknown reset option 'level'"):
        env.reset(level=3)


# --- the command line ------------------------------------------------------------------------


def test_cli_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-sessions", "0"]) == 2
    assert capsys.readouterr().err == "error: WordleServerConfig.max_sessions=0: needs an integer >= 1\n"
