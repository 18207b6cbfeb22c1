"""``benchmarks/gpu.py --quick`` runs end to end on the CPU (small shapes), as CI runs it, so the
GPU benchmark cannot rot between GPU runs: its floors, loops, publisher parts and in-place writer
are all measured, and everything it checks is exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_quick_form_measures_every_phase_and_is_exact(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--quick", "--no-view", "--iters", "2",
         "--densities", "0.01", "--out", str(out), "--plot", str(tmp_path / "gpu.png")],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["quick"]
    floors = r["floors"]
    assert all(floors[k] > 0 for k in ("scan_s", "adamw_step_s", "d2h_s", "h2d_s", "save_file_s", "copy_bandwidth_gbs"))
    assert floors["save_file_fsync_s"] >= floors["save_file_s"]
    loop = r["loops"]["publishing 1.0%"]
    assert loop["fingerprint_ok"] and len(loop["iteration_s"]) == 2 and all(c > 0 for c in loop["changed"])
    assert "capture: detect" in loop["phases_per_version_s"] and "delta: encode" in loop["phases_per_version_s"]
    assert r["submit"]["snapshot_devices"] == ["cpu"]  # weights on the CPU keep their snapshot there
    assert r["inplace"]["exact"] and r["inplace"]["exact_at_start"] and len(r["inplace"]["steps"]) == 3
    assert r["encode_threads"]["one_thread_s"] > 0 and r["encode_threads"]["all_cores_s"] > 0
    assert r["decode_threads"]["exact"] and r["decode_threads"]["all_cores_s"] > 0
    assert r["hash_threads"]["exact"] and r["hash_threads"]["all_cores_s"] > 0
    split = r["anchor_split"]  # a quarter of the weights a part: the split path runs, and reads back exact
    assert split["one_file_files"] == 1 and split["parts_files"] >= 3
    assert split["one_file_read_back"] and split["parts_read_back"]
    for key in ("loop publishing 1.0% / plain", "submit hold / scan", "capture-to-commit / scan", "anchor / save_file",
                "anchor / (save_file + fsync)", "anchor: parts / one file",
                "capture: detect / scan", "encode: all cores / one thread", "decode: all cores / one thread",
                "host fingerprint: all cores / one thread"):
        assert r["ratios"][key] > 0, key
    assert (tmp_path / "gpu.png").stat().st_size > 10_000
