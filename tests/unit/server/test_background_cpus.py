"""Background work of a worker (staging, hashing) runs off the cores the engine's workers are bound
to, at a lower priority than the worker's own threads.

The process tree is real: an "engine" process with two "worker" children bound to CPU 0, as
vLLM-CPU binds its workers; one of them moves a thread off its engine cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from servers import REPO_ROOT

from deltasync import ConfigError
from deltasync.server.config import ServerConfig
from deltasync.server.cpus import parse_cpu_list

_WORKER = textwrap.dedent(
    """
    import json, os, sys, threading, time
    os.sched_setaffinity(0, {0})  # as vLLM-CPU binds a worker's main thread (and what it starts)
    if sys.argv[1] == "sibling":
        time.sleep(60)
    time.sleep(1.0)  # the sibling has bound itself
    import importlib.util  # the module alone: importing deltasync takes seconds
    spec = importlib.util.spec_from_file_location("cpus", os.path.join("deltasync", "server", "cpus.py"))
    _cpus = sys.modules["cpus"] = importlib.util.module_from_spec(spec); spec.loader.exec_module(_cpus)
    policy = _cpus.BackgroundPolicy(sys.argv[2], sys.argv[3] if sys.argv[3] == "idle" else int(sys.argv[3]))
    _cpus.shorten_switch_interval()  # as the updater does when it starts
    seen = {}
    def background():
        where = policy.enter()
        seen["moved"], seen["reported_nice"], seen["reported_idle"] = where.cpus, where.nice, where.idle
        seen["policy"] = os.sched_getscheduler(threading.get_native_id())
        seen["thread"] = os.sched_getaffinity(threading.get_native_id())
        seen["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=background); t.start(); t.join()
    print(json.dumps({"free": sorted(_cpus.engine_free_cpus() or []), "moved": sorted(seen["moved"] or []),
                      "thread": sorted(seen["thread"]), "main": sorted(os.sched_getaffinity(0)),
                      "nice": seen["nice"], "reported_nice": seen["reported_nice"], "policy": seen["policy"],
                      "reported_idle": seen["reported_idle"], "main_policy": os.sched_getscheduler(0),
                      "switch": sys.getswitchinterval(), "switch_wanted": _cpus.SWITCH_INTERVAL_S,
                      "main_nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}))
    """
)
_ENGINE = textwrap.dedent(
    """
    import subprocess, sys
    sibling = subprocess.Popen([sys.executable, "-c", sys.argv[1], "sibling", "auto", "0"])
    try:
        probe = subprocess.run([sys.executable, "-c", sys.argv[1], "probe", *sys.argv[2:]], capture_output=True, text=True)
    finally:
        sibling.kill()
    sys.stdout.write(probe.stdout); sys.stderr.write(probe.stderr)
    """
)


def _probe(setting: str, nice: int | str = 0) -> dict:
    done = subprocess.run([sys.executable, "-c", _ENGINE, _WORKER, setting, str(nice)], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move a thread between")
def test_a_background_thread_leaves_the_cores_the_workers_are_bound_to() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    got = _probe("auto")
    assert got["free"] == [c for c in allowed if c != 0]  # what no sibling worker is bound to
    assert got["moved"] == got["thread"] == got["free"]
    assert got["main"] == [0]  # only the calling thread moves
    assert got["nice"] == got["reported_nice"] == got["main_nice"]  # nice 0: the worker's own priority


def test_a_background_thread_runs_behind_the_worker() -> None:
    got = _probe("inherit", 19)
    base = got["main_nice"]
    assert got["nice"] == got["reported_nice"] == min(19, base + 19)  # the thread only: main_nice is the worker's
    assert got["nice"] > base or base == 19  # (a test run already at nice 19 cannot go lower)
    assert _probe("inherit", 5)["nice"] == min(19, base + 5)
    # The worker hands its interpreter lock on after 0.2 ms, not Python's default 5 ms.
    assert got["switch"] == pytest.approx(got["switch_wanted"]) and got["switch_wanted"] < 0.005
    assert got["policy"] == os.SCHED_OTHER and got["reported_idle"] is False


def test_an_idle_background_thread_runs_only_when_nothing_else_wants_the_cpu() -> None:
    got = _probe("inherit", "idle")
    assert got["policy"] == os.SCHED_IDLE and got["reported_idle"] is True
    assert got["main_policy"] == os.SCHED_OTHER  # the thread only


def test_inherit_and_an_explicit_list() -> None:
    got = _probe("inherit")
    assert got["moved"] == [] and got["thread"] == got["main"] == [0]
    if len(os.sched_getaffinity(0)) >= 2:
        assert _probe("1")["thread"] == [1]


def test_the_setting_is_checked_at_start() -> None:
    assert ServerConfig.from_env({}).staging_cpus == "auto"
    assert ServerConfig.from_env({}).staging_nice == 19
    assert ServerConfig.from_env({"DELTASYNC_STAGING_NICE": "0"}).staging_nice == 0
    assert ServerConfig.from_env({"DELTASYNC_STAGING_NICE": " idle "}).staging_nice == "idle"
    for bad in ("-1", "20", "low", "1.5", "IDLE"):
        with pytest.raises(ConfigError, match="DELTASYNC_STAGING_NICE must be a whole number from 0 to 19 or 'idle'"):
            ServerConfig.from_env({"DELTASYNC_STAGING_NICE": bad})
    assert ServerConfig.from_env({"DELTASYNC_STAGING_CPUS": "2-3,6"}).staging_cpus == "2-3,6"
    assert parse_cpu_list("2-3,6") == {2, 3, 6}
    for bad in ("any", "1;2", "-1", "1-"):
        with pytest.raises(ConfigError, match="DELTASYNC_STAGING_CPUS must be 'auto', 'inherit' or a CPU list"):
            ServerConfig.from_env({"DELTASYNC_STAGING_CPUS": bad})
