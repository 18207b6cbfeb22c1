"""Whole updates through the server core on a second engine (``fake_engine.py``: both seams
on a small torch model), in a child interpreter where ``vllm`` cannot be imported: in place and
by reload, paused, in flight and followed; the served weights bit-equal to the trainer's bf16
weights, with the version and fingerprint the bucket committed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_without_vllm import NO_VLLM

from servers import REPO_ROOT

HERE = Path(__file__).parent


def _run(scenario: str, tmp_path: Path) -> None:
    code = (NO_VLLM + f"\nsys.path[:0] = [{str(HERE)!r}, {str(REPO_ROOT / 'tests')!r}, {str(REPO_ROOT)!r}]\n"
            f"import fake_engine, pathlib\nfake_engine.{scenario}\n"
            "assert not [m for m, mod in sys.modules.items() if mod is not None and m.split('.')[0] in ('vllm', 'vllm_ext')]\n"
            # A daemon thread of ours alive at exit would be killed inside torch's destructors.
            "import threading\nassert not [t.name for t in threading.enumerate() if t.daemon and t.name.startswith('deltasync')]\n"
            "print('ok')\n")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.parametrize("reload_only", [False, True], ids=["in-place", "reload"])
def test_a_paused_update_on_the_fake_engine(tmp_path, reload_only):
    _run(f"scenario_paused(pathlib.Path({str(tmp_path)!r}), reload_only={reload_only})", tmp_path)


def test_an_inflight_update_on_the_fake_engine(tmp_path):
    _run(f"scenario_inflight(pathlib.Path({str(tmp_path)!r}))", tmp_path)


def test_follow_mode_on_the_fake_engine(tmp_path):
    _run(f"scenario_follow(pathlib.Path({str(tmp_path)!r}))", tmp_path)
