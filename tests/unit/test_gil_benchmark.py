"""``benchmarks/gil.py`` (a publisher's version and a server's stage beside a busy Python thread)
runs on small weights, checks every version and stage against its fingerprint, and writes its
figures; it restores the process's switch interval."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="gil.py needs two CPUs")
def test_the_gil_benchmark_times_each_neighbor_and_is_exact(tmp_path: Path) -> None:
    out = tmp_path / "gil.json"
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gil.py"), "--tensors", "3", "--elements", "65536",
         "--share", "0.05", "--rounds", "1", "--intervals", "0.0002", "--bucket", str(tmp_path), "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["exact"] and r["intervals"] == [0.0002]
    assert r["changed"]["stage"] == 3 * len(range(0, 65536, 20))
    assert r["changed"]["publish"] == r["changed"]["stage"]
    for work in ("publish", "stage"):
        row = r["results"][work]["0.0002"]
        assert row["none"]["over_alone"] == 1.0
        for kind in ("python", "torch"):
            got = row[kind]
            assert len(got["seconds_all"]) == 1 and got["over_alone"] == got["seconds"] / row["none"]["seconds"] > 0
            assert got["neighbor_alone_rate"] > 0 and got["neighbor_lost"] == 1 - got["neighbor_rate"] / got["neighbor_alone_rate"]
    assert [p.name for p in tmp_path.iterdir()] == ["gil.json"]  # the bucket is removed after
