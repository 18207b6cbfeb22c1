"""examples/async_wordle.py: its reward terms offline, then ``--tiny`` end to end as a user runs it."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from servers import REPO_ROOT, requires_vllm

from deltasync import DeltaReceiver
from deltasync.envs.wordle import WordleAction, WordleEnvironment

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
    from deltasync.envs.wordle import draw_secret

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


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as sock:
        sock.settimeout(2.0)
        return sock.connect_ex((host, int(port))) == 0


@pytest.mark.server
@pytest.mark.trainer
@requires_vllm
def test_tiny_run_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "wordle"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--tiny", "--output", str(out)],
        capture_output=True, text=True, timeout=1500, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "EXACT" in proc.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert summary["exact"] is True
    assert summary["server_fingerprint"] == summary["trainer_fingerprint"]
    syncs = summary["syncs"]
    assert [s["version"] for s in syncs] == [0, 1, 2]  # the cold sync, then one per step
    assert syncs[0]["kind"] == "anchor"
    assert all(s["served"] == [s["version"]] and not s["failed"] for s in syncs)
    assert any(s["kind"] == "delta" and 0 < s["changed_fraction"] < 1 for s in syncs[1:])  # real deltas shipped
    assert summary["server_version"] == 2

    steps = summary["steps"]
    assert [s["step"] for s in steps] == [1, 2]
    for step in steps:
        # Whole games through the environment server: a random model's six guesses are all invalid.
        assert step["rollout/turns_mean"] > 1
        assert step["tools/call_frequency"] == step["rollout/turns_mean"]
        for name in ("reward_win", "reward_greens", "reward_yellows", "penalty_invalid", "penalty_repetition",
                     "reward_format"):
            assert f"rewards/{name}" in step
        assert -1.0 <= step["rewards/penalty_invalid"] <= 0.0

    # What it leaves behind: the bucket replays to the served state, the trained model, the logs.
    receiver = DeltaReceiver(out / "bucket")
    assert receiver.sync() == 2
    assert receiver.fingerprint == summary["trainer_fingerprint"]
    assert (out / "model" / "model.safetensors").exists() and (out / "model" / "config.json").exists()
    assert (out / "logs" / "vllm-server.log").stat().st_size > 0
    assert (out / "logs" / "wordle-server.log").exists()
    # ...and no server: both were stopped.
    assert not _port_open(summary["rollout_url"])
    assert not _port_open(summary["env_url"])
