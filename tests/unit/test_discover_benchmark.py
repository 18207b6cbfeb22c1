"""``benchmarks/discover.py`` (the in-place writer's set-up on vLLM's own Qwen3-MoE loader: one
name a loader call against many) runs a small form: both ways give the same map (the script
exits with an error otherwise), and the calls are counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1].parent


def test_the_discover_benchmark_maps_vllms_own_moe_model_alike_both_ways(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "discover.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "discover.py"), "--shapes", "2x8", "3x16",
                          "--rounds", "1", "--out", str(out)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["layers"], r["experts"]) for r in rows] == [(2, 8), (3, 16)]
    for r in rows:
        # Per layer: 3 attention projections, o_proj, 2 norms, the router, 3 weights per expert.
        assert r["names"] == r["layers"] * (3 + 1 + 2 + 2 + 1 + 3 * r["experts"]) + 3
        assert r["one_calls"] == r["names"] and r["many_calls"] == 1
        assert r["mapped"] == r["names"] and r["fallback"] == 0 and r["ignored"] == 0
        assert r["ratio"] == r["many_median_s"] / r["one_median_s"]
    assert "| 3x16 |" in run.stdout


def test_the_discover_benchmark_refuses_bad_arguments_by_name(tmp_path: Path) -> None:
    for args, named in ((["--shapes", "4"], "--shapes"), (["--rounds", "0"], "--rounds"),
                        (["--plot-from", str(tmp_path / "a.json")], "--plot-from")):
        run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "discover.py"), *args, "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
        assert run.returncode == 2 and named in run.stderr, (args, run.stderr[-500:])
    assert not (tmp_path / "x.json").exists()
