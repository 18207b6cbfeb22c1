"""examples/async_wordle.py: ``--tiny`` end to end as a user runs it (reward terms: tests/unit/examples/)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from servers import REPO_ROOT, requires_vllm

from deltasync import DeltaReceiver

EXAMPLE = REPO_ROOT / "examples" / "async_wordle.py"


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
    # TRL logs a rollout's structure in the window its game finished in, and a step's window may
    # hold none (they ran ahead, during the step before): at least one window has them.
    assert any("rollout/turns_mean" in step for step in steps), steps
    for step in steps:
        # Whole games through the environment server: a random model's six guesses are all invalid.
        assert step["tools/call_frequency"] > 1
        if "rollout/turns_mean" in step:
            assert step["rollout/turns_mean"] == step["tools/call_frequency"]
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
