"""``benchmarks/encode.py`` runs end to end on small deltas: it times one thread and the host's
cores, writes the same bytes with each, and draws its plot, also from a saved comparison."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_encode_benchmark_times_both_forms_of_the_same_bytes(tmp_path: Path) -> None:
    out, env = tmp_path / "encode.json", {**os.environ, "PYTHONPATH": str(REPO)}
    script = str(REPO / "benchmarks" / "encode.py")
    run = subprocess.run(
        [sys.executable, script, "--changes", "40000", "200000", "--tensors", "7", "--rounds", "2",
         "--file", str(tmp_path / "buckets"), "--out", str(out), "--plot", str(tmp_path / "encode.png")],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [row["changes"] for row in r["sizes"]] == [40000, 200000]
    for row in r["sizes"]:
        assert row["same_bytes"] and row["compressed_bytes"][0] > 0
        assert row["one_thread_s"] > 0 and row["all_cores_s"] > 0
        assert row["all_cores_over_one_thread"] == row["all_cores_s"] / row["one_thread_s"]
        assert row["delta_file_s"] > 0
    assert list((tmp_path / "buckets").iterdir()) == []  # each file's bucket is removed after
    assert (tmp_path / "encode.png").stat().st_size > 0
    saved = {"before_commit": "a", "before": [r], "after_commit": "b", "after": [r, r]}
    (tmp_path / "saved.json").write_text(json.dumps(saved))
    again = subprocess.run(
        [sys.executable, script, "--plot-from", str(tmp_path / "saved.json"), "--plot", str(tmp_path / "saved.png")],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "saved.png").stat().st_size > 0


def test_a_plot_from_a_file_that_is_no_comparison_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "run.json").write_text(json.dumps({"sizes": []}))
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "encode.py"), "--plot-from", str(tmp_path / "run.json"),
         "--plot", str(tmp_path / "x.png")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 2 and "run.json: neither LABEL=JSON nor a saved comparison" in run.stderr
    assert not (tmp_path / "x.png").exists()
