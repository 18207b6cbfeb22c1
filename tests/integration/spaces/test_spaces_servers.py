"""The Spaces' entry points serving for real, run here without Docker (the rest: tests/unit/spaces/)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from servers import REPO_ROOT, requires_vllm, server_env

from deltasync import RolloutClient
from deltasync.examples.launcher import free_port
from deltasync.examples.wordle import WordleClient, draw_secret

SPACES = REPO_ROOT / "spaces"
KINDS = ("vllm", "wordle")
ENTRY_POINTS = {"vllm": "spaces/vllm/start.sh", "wordle": "spaces/wordle/app.py"}


# --------------------------------------------------------------------------- entry points, no Docker


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def started(command: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                cwd=REPO_ROOT)  # fmt: skip
        try:
            yield proc
        finally:
            _stop(proc)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise AssertionError(f"{url} not healthy in {timeout} s:\n{log.read_text()[-3000:]}")


def test_wordle_space_app_serves_games(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "HOST": "127.0.0.1", "PORT": str(port), "MAX_SESSIONS": "8", "LOG_LEVEL": "warning"}
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "wordle.log"
    with started([sys.executable, str(SPACES / "wordle" / "app.py")], env, log) as proc:
        wait_healthy(url, proc, log, 60)
        secret = draw_secret(5)
        with WordleClient(url) as game:
            first = game.reset(seed=5)
            assert first.guesses_left == 6 and not first.done
            wrong = game.step("[crane]" if secret != "crane" else "[slate]")
            assert wrong.valid and not wrong.done
            won = game.step(f"I say [{secret}]")
            assert won.won and won.done and won.secret == secret
            assert won.reward_components["correct"] == 1.0


def _start_sh_env(**values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DELTASYNC_TOKEN", "MODEL", "DELTASYNC_BUCKET")}
    return {**env, "PYTHON": sys.executable, **values}


@pytest.mark.server
@requires_vllm
def test_rollout_start_serves_with_its_routes_behind_the_token(
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    token = "space-secret"
    env = _start_sh_env(**server_env(
        DELTASYNC_TOKEN=token, MODEL=str(tiny_model_dir), DELTASYNC_BUCKET=str(tmp_path / "bucket"),
        HOST="127.0.0.1", PORT=str(port), VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ARGS="--dtype bfloat16 --enforce-eager --max-model-len 1024",
    ))  # fmt: skip
    log = tmp_path / "rollout.log"
    with started(["bash", str(SPACES / "vllm" / "start.sh")], env, log) as proc:
        wait_healthy(url, proc, log, 600)
        assert [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]] == [str(tiny_model_dir)]
        # Not a 2-token prompt: on some CPUs vLLM-CPU's worker dies (SIGILL) when the very first request
        # is that short, with or without deltasync (seen on a bare `api_server` too).
        completion = httpx.post(f"{url}/v1/completions", json={"model": str(tiny_model_dir), "prompt": "The quick brown fox",
                                                               "max_tokens": 4}, timeout=120)  # fmt: skip
        assert completion.status_code == 200  # completions stay open

        for route in ("/pause", "/update_weights", "/collective_rpc"):
            assert httpx.post(f"{url}{route}", timeout=30).status_code == 401, route
            wrong = httpx.post(f"{url}{route}", headers={"Authorization": "Bearer nope"}, timeout=30)
            assert wrong.status_code == 401, route
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.post(f"{url}/pause", params={"mode": "keep"}, headers=auth, timeout=60).status_code == 200
        assert httpx.get(f"{url}/is_paused", headers=auth, timeout=30).json()["is_paused"] is True
        assert httpx.post(f"{url}/resume", headers=auth, timeout=60).status_code == 200
        # The extension is loaded and follows the bucket (empty: it serves the checkpoint it started with).
        status = RolloutClient(url, token=token).status()[url]
        assert status.ok and status.version is None, status.error
        assert not RolloutClient(url, token="wrong").status()[url].ok
    assert "--middleware vllm_ext.TokenMiddleware" in log.read_text()
