"""``benchmarks/stage.py`` (a CPU server's in-place stage, one decode thread against the host's
cores) runs on a small delta, checks every stage against the bucket, and writes its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_stage_benchmark_times_both_forms_and_is_exact(tmp_path: Path) -> None:
    out = tmp_path / "stage.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "stage.py"), "--tensors", "5", "--elements", "65536",
         "--share", "0.3", "--rounds", "2", "--bucket", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["exact"] and r["changed"] == 5 * int(65536 * 0.3)
    assert len(r["one_thread_s_all"]) == len(r["all_cores_s_all"]) == 3
    assert r["all_cores_over_one_thread"] == r["all_cores_s"] / r["one_thread_s"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["stage.json"]  # the bucket is removed after
