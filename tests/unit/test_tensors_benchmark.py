"""``benchmarks/tensors.py`` (costs against the number of tensors, the same elements cut finer)
runs on a few small counts, checks every version and stage against the trainer's weights, and
writes its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_tensors_benchmark_times_each_count_and_is_exact(tmp_path: Path) -> None:
    out = tmp_path / "tensors.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "tensors.py"), "--counts", "4", "64", "--elements", "65536",
         "--share", "0.05", "--versions", "2", "--rounds", "1", "--bucket", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["exact"] and [row["tensors"] for row in r["rows"]] == [4, 64]
    for row in r["rows"]:
        per = 65536 // row["tensors"]
        assert row["elements_per_tensor"] == per and row["changed"] == row["tensors"] * int(per * 0.05)
        assert len(row["publish_s_all"]) == 2 and len(row["stage_all_cores_s_all"]) == 2  # a warm-up, one timed
        assert row["publish_us_per_tensor"] == row["publish_s"] / row["tensors"] * 1e6 > 0
        assert row["receiver_stage_ns_per_changed"] == row["receiver_stage_s"] / row["changed"] * 1e9 > 0
    assert [p.name for p in tmp_path.iterdir()] == ["tensors.json"]  # the buckets are removed after


def test_the_tensors_benchmark_refuses_bad_arguments_by_name(tmp_path: Path) -> None:
    for args, named in ((["--fused", "-1"], "--fused"), (["--counts", "0"], "--counts"), (["--share", "2"], "--share")):
        run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tensors.py"), *args, "--out", str(tmp_path / "x.json")],
                             capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)  # fmt: skip
        assert run.returncode == 2 and named in run.stderr, (args, run.stderr[-500:])
    assert not (tmp_path / "x.json").exists()
