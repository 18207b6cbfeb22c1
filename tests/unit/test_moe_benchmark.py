"""``benchmarks/moe.py`` (a fused Qwen3-MoE trainer's delta, published per expert) runs a small
form: every version is checked by a receiver, whose weights must hash to the publisher's
fingerprint (the script exits with an error otherwise), and each publish is split into its parts;
with ``--stage``, vLLM's own fused model stages the last delta in place, exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1].parent
SCRIPT = REPO / "benchmarks" / "moe.py"


def test_the_moe_benchmark_publishes_a_fused_model_per_expert_exactly(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("vllm")
    out = tmp_path / "moe.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--shapes", "2x8", "--versions", "2", "--stage", "--rounds", "1",
                          "--out", str(out)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["exact"] and row["exact"]
    # Per layer: 3 attention projections, o_proj, 2 q/k norms, 2 layer norms, the router, 3 weights per expert.
    assert row["checkpoint_tensors"] == 2 * (4 + 2 + 2 + 1 + 3 * 8) + 3
    assert row["live_parameters"] < row["checkpoint_tensors"]  # the experts are fused
    assert len(row["publish_s_all"]) == 2 and row["changed"] > 0
    assert set(row["parts_s"]) == {"detect", "to_checkpoint", "fingerprint move", "encode", "store write", "commits"}
    assert all(seconds >= 0 for seconds in row["parts_s"].values()) and row["parts_s"]["encode"] > 0
    assert "| 2x8 | 69 |" in run.stdout
    # the in-place stage on vLLM's model: every name mapped, every stage and the write exact
    assert row["stage_exact"] and row["mapped"] == row["checkpoint_tensors"]
    assert len(row["stage_one_thread_s_all"]) == len(row["stage_all_cores_s_all"]) == 2


def test_the_moe_benchmark_refuses_bad_arguments_by_name(tmp_path: Path) -> None:
    for args, named in ((["--shapes", "4"], "--shapes"), (["--width", "0"], "--width"), (["--share", "0"], "--share"),
                        (["--versions", "0"], "--versions"), (["--rounds", "0"], "--rounds")):  # fmt: skip
        run = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "x.json")], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
        assert run.returncode == 2 and named in run.stderr, (args, run.stderr[-500:])
    assert not (tmp_path / "x.json").exists()
