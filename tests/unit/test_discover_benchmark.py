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


def test_the_served_hash_benchmark_hashes_vllms_own_moe_model_alike_both_ways(tmp_path: Path) -> None:
    """``--hash``: the full fingerprint of the served weights, each piece indexed against runs as
    slices (the script exits with an error where the sums differ), per element, and its plot."""
    pytest.importorskip("vllm")
    out = tmp_path / "hash.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "discover.py"), "--hash", "--shapes", "2x8",
                          "--width", "48", "--rounds", "2", "--out", str(out)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["what"] == "hash"
    (row,) = result["rows"]
    assert (row["layers"], row["experts"], row["width"], row["names"], row["mapped"]) == (2, 8, 48, 69, 69)
    # 2 layers of 8 experts x 3 weights of 48 x 64, attention, norms, routers, embedding and head
    assert row["elements"] > 2 * 8 * 3 * 48 * 64
    assert len(row["indexed_s"]) == len(row["sliced_s"]) == 2 and row["ratio"] == row["sliced_median_s"] / row["indexed_median_s"]
    assert "| 2x8 | 48 | 69 |" in run.stdout
    pytest.importorskip("matplotlib")
    plot = tmp_path / "hash.png"
    drawn = subprocess.run([sys.executable, str(REPO / "benchmarks" / "discover.py"), "--plot-from", str(out), "--plot", str(plot)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert drawn.returncode == 0 and plot.stat().st_size > 0, drawn.stderr[-2000:]


def test_the_discover_benchmark_refuses_bad_arguments_by_name(tmp_path: Path) -> None:
    for args, named in ((["--shapes", "4"], "--shapes"), (["--rounds", "0"], "--rounds"), (["--width", "0"], "--width"),
                        (["--plot-from", str(tmp_path / "a.json")], "--plot-from")):
        run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "discover.py"), *args, "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
        assert run.returncode == 2 and named in run.stderr, (args, run.stderr[-500:])
    assert not (tmp_path / "x.json").exists()


def test_the_discover_benchmark_refuses_to_draw_discover_and_hash_runs_together(tmp_path: Path) -> None:
    """``--plot-from`` takes runs of one kind: rows of ``discover`` and of ``--hash`` are refused by name."""
    pytest.importorskip("matplotlib")
    row = {"layers": 2, "experts": 8, "names": 69}
    discover = tmp_path / "d.json"
    hashed = tmp_path / "h.json"
    discover.write_text(json.dumps({"rows": [{**row, "one_median_s": 1.0, "many_median_s": 0.1}]}))
    hashed.write_text(json.dumps({"what": "hash", "rows": [{**row, "indexed_median_s": 1.0, "sliced_median_s": 0.4}]}))
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "discover.py"), "--plot-from", str(discover), str(hashed),
                          "--plot", str(tmp_path / "p.png")], capture_output=True, text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert run.returncode != 0 and "give runs of discover or runs of --hash, not both" in run.stderr
    assert not (tmp_path / "p.png").exists()
