"""examples/async_wordle.py: its reward terms and command line, offline (the ``--tiny`` run: tests/integration/examples/)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from types import ModuleType

import pytest
from servers import REPO_ROOT

from deltasync.examples.wordle import WordleAction, WordleEnvironment

EXAMPLE = REPO_ROOT / "examples" / "async_wordle.py"


@pytest.fixture(scope="module")
def example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_wordle_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _game(example: ModuleType, seed: int, guesses: list[str]) -> list[dict]:
    """A completion as the example's rollout loop builds it: replies and annotated feedback."""
    env = WordleEnvironment()
    env.reset(seed=seed)
    completion: list[dict] = []
    for guess in guesses:
        observation = env.step(WordleAction(guess=guess))
        completion.append({"role": "assistant", "content": guess})
        completion.append({
            "role": "user", "content": observation.message,
            example.OBSERVATION_KEY: observation.model_dump(mode="json", exclude={"prompt"}),
        })  # fmt: skip
        if observation.done:
            break
    return completion


def test_reward_terms_follow_the_environment(example: ModuleType) -> None:
    from deltasync.examples.wordle import draw_secret

    secret = draw_secret(11)
    other = "crane" if secret != "crane" else "slate"
    won = _game(example, 11, ["I think [xyzzy]", f"[{other}]", f"[{other}]", f"My guess: [{secret}]"])
    lost = _game(example, 11, ["hello there"] * 6)
    completions = [won, lost]
    assert example.reward_win(completions) == [1.0, 0.0]
    assert example.reward_greens(completions) == [1.0, 0.0]  # the last guess of the won game is all green
    assert example.reward_yellows(completions) == [0.0, 0.0]
    assert example.penalty_invalid(completions) == [-0.25, -1.0]
    assert example.penalty_repetition(completions) == [-0.25, 0.0]
    assert [len([m for m in c if m["role"] == "assistant"]) for c in completions] == [4, 6]


def test_format_reward_gives_dense_credit(example: ModuleType) -> None:
    replies = [[{"role": "assistant", "content": r}] for r in ("[crane]", "maybe [crane] then", "abc!", "", "1234")]
    assert example.reward_format(replies) == [1.0, 0.5, 0.25 * 3 / 4, 0.0, 0.0]
    assert example.reward_format(replies[:1], weight=0.5) == [0.5]


def test_first_message_carries_the_rules(example: ModuleType) -> None:
    observation = WordleEnvironment().reset(seed=1)
    messages = example._first_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": ""}],
                                       observation)
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["content"] == f"{observation.prompt}\n\n{observation.message}"
    assert "[crane]" in messages[1]["content"]


def test_bad_command_lines_fail_fast() -> None:
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--bucket", "/tmp/x"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "--rollout-url, --env-url required" in proc.stderr
