"""``benchmarks/client.py`` (a trainer's cost per call to its servers: one HTTP client kept open
against a new one per call) runs a small form against its in-memory server and writes its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1].parent


def test_the_client_benchmark_measures_both_ways_idle_and_busy(tmp_path: Path) -> None:
    out = tmp_path / "client.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "client.py"), "--calls", "3", "--busy", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [row["busy_processes"] for row in r["rows"]] == [0, 1] and r["calls"] == 3
    for row in r["rows"]:
        for key in ("shared", "new"):
            assert 0 < row[f"{key}_wall_ms"] <= row[f"{key}_wall_ms_max"] and row[f"{key}_cpu_ms"] >= 0
        assert row["wall_ratio"] == row["new_wall_ms"] / row["shared_wall_ms"]
    assert "| 1 |" in run.stdout  # the table's busy row


def test_the_client_benchmark_refuses_bad_arguments_by_name(tmp_path: Path) -> None:
    for args, named in ((["--calls", "0"], "--calls"), (["--busy", "-1"], "--busy")):
        run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "client.py"), *args, "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
        assert run.returncode == 2 and named in run.stderr, (args, run.stderr[-500:])
    assert not (tmp_path / "x.json").exists()
