"""VLLMServer's process handling, with a fake server script (the real one: tests/integration/test_server_smoke.py)."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
import requests

from deltasync.errors import ConfigError
from deltasync.examples.launcher import VLLMServer, VLLMServerError, _group_alive

# A stand-in for the API server: serves /health (after HEALTH_DELAY s, unless it is
# negative), prints its environment, and keeps a child in its process group the way
# vLLM keeps its engine core and worker processes.
_FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, subprocess, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    print("FAKE_ENV", os.environ.get("VLLM_CPU_KVCACHE_SPACE"), os.environ.get("VLLM_SERVER_DEV_MODE"),
          os.environ.get("FAKE_EXTRA"), " ".join(sys.argv[1:]), flush=True)
    if os.environ.get("FAKE_EXIT"):
        print("boom: cannot load the model", flush=True)
        sys.exit(int(os.environ["FAKE_EXIT"]))
    child_code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    if not os.environ.get("FAKE_STUBBORN"):
        child_code = "import time; time.sleep(600)"
    child = subprocess.Popen([sys.executable, "-c", child_code])
    print("FAKE_CHILD", child.pid, flush=True)
    delay = float(os.environ.get("HEALTH_DELAY", "0"))
    if delay < 0:
        time.sleep(600)
    time.sleep(delay)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


class _FakeServer(VLLMServer):
    script: str = ""

    @property
    def command(self) -> list[str]:
        return [sys.executable, self.script, *super().command[3:]]


@pytest.fixture
def fake_server(tmp_path):
    script = tmp_path / "fake_server.py"
    script.write_text(_FAKE_SERVER)
    servers: list[_FakeServer] = []

    def make(**kwargs) -> _FakeServer:
        server = _FakeServer(tmp_path / "model", **kwargs)
        server.script = str(script)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop(grace=1)


def _child_pid(server: VLLMServer) -> int:
    for _ in range(100):
        for line in server.log_tail().splitlines():
            if line.startswith("FAKE_CHILD"):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError(server.log_tail())


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_start_waits_for_health_and_stop_ends_the_group(fake_server):
    server = fake_server(env={"HEALTH_DELAY": "1", "FAKE_EXTRA": "yes"}, extra_args=["--flag", "x"], kv_cache_gib=2)
    with server:
        assert server.is_running()
        assert requests.get(server.url + "/health", timeout=5).status_code == 200
        assert server.url == f"http://127.0.0.1:{server.port}"
        child = _child_pid(server)
        assert _pid_alive(child)
        env_line = next(line for line in server.log_tail().splitlines() if line.startswith("FAKE_ENV"))
        assert env_line.startswith("FAKE_ENV 2 1 yes --model")
        assert env_line.endswith("--max-model-len 1024 --flag x")
        pgid = server.pid
    assert not server.is_running()
    assert not _group_alive(pgid) and not _pid_alive(child)
    server.stop()  # idempotent


def test_temporary_log_is_removed_and_given_log_kept(fake_server, tmp_path):
    with fake_server() as server:
        own_log = server.log_file
        assert own_log is not None and own_log.exists()
    assert not own_log.exists()
    with fake_server(log_file=tmp_path / "logs" / "server.log"):
        pass
    assert "FAKE_ENV" in (tmp_path / "logs" / "server.log").read_text()


def test_process_that_exits_raises_with_log_tail(fake_server):
    server = fake_server(env={"FAKE_EXIT": "3"})
    with pytest.raises(VLLMServerError, match=r"(?s)exited with code 3 before it became healthy.*boom: cannot load"):
        server.start(timeout=60)
    assert not server.is_running()


def test_timeout_raises_and_ends_the_group(fake_server):
    server = fake_server(env={"HEALTH_DELAY": "-1"})
    started = time.monotonic()
    with pytest.raises(VLLMServerError, match=r"(?s)not healthy at http://127\.0\.0\.1:\d+/health after 2 s.*FAKE_ENV"):
        server.start(timeout=2)
    assert time.monotonic() - started < 30
    assert not server.is_running()


def test_stop_kills_what_ignores_sigterm(fake_server):
    server = fake_server(env={"FAKE_STUBBORN": "1"}).start(timeout=60)
    child, pgid = _child_pid(server), server.pid
    server.stop(grace=1)
    assert not _group_alive(pgid) and not _pid_alive(child)


def test_second_start_is_refused(fake_server):
    server = fake_server().start(timeout=60)
    with pytest.raises(VLLMServerError, match="already started"):
        server.start()


def test_bad_arguments():
    with pytest.raises(ConfigError, match="extra_args='--a b' is a string"):
        VLLMServer("m", extra_args="--a b")
    with pytest.raises(ConfigError, match="kv_cache_gib=0"):
        VLLMServer("m", kv_cache_gib=0)


def test_command_runs_the_api_server_module():
    server = VLLMServer("/models/x", port=8123, max_model_len=512, extra_args=["--seed", "1"])
    assert server.command == [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/x", "--dtype", "bfloat16",
        "--enforce-eager", "--host", "127.0.0.1", "--port", "8123", "--max-model-len", "512", "--seed", "1",
    ]  # fmt: skip
    assert server.url == "http://127.0.0.1:8123" and not server.is_running()


# -- real vLLM-CPU servers ------------------------------------------------------------


def test_group_alive_sees_a_live_group():
    assert _group_alive(os.getpgrp())


def test_wait_healthy_names_the_server_that_died_or_never_answered() -> None:
    import subprocess

    from deltasync.examples.launcher import ServerError, free_port, wait_healthy

    url = f"http://127.0.0.1:{free_port()}"
    dead = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"])
    dead.wait()
    with pytest.raises(ServerError, match=r"the Wordle server exited with code 3 before answering .*/health"):
        wait_healthy(url, 30.0, proc=dead, what="Wordle server")
    with pytest.raises(ServerError, match=r"the rollout server at http://127\.0\.0\.1:\d+ did not answer /health within 1 s"):
        wait_healthy(url, 1.0, what="rollout server")
    assert issubclass(VLLMServerError, ServerError)
