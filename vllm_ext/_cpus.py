"""Where a worker's background work runs: off the cores the engine computes on.

vLLM-CPU binds each worker (its main thread, and every thread it starts) to that worker's
OpenMP cores (``VLLM_CPU_OMP_THREADS_BIND``) and leaves others to the API server and the
engine core. A prefetch thread started in the worker inherits that binding, so staging a
version would take turns with the forward passes on the same core, and generation would slow
by as much as staging costs. Each of deltasync's background threads (prefetch, the served
hash, freeing memory) calls :func:`move_off_engine_cores` first; how is
``DELTASYNC_STAGING_CPUS`` (:class:`vllm_ext._config.ServerConfig.staging_cpus`):

- ``auto`` (the default): the CPUs the engine-core process may use that no worker of this
  engine is bound to (its sibling processes). None on a GPU server or an unbound one (nothing
  to move off), and None where the workers take every core (TP=2 on two cores): there the
  thread stays where it is.
- ``inherit``: never move.
- a CPU list, e.g. ``1`` or ``2-3,6``: those CPUs.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import threading
from pathlib import Path

__all__ = ["STAGING_CPUS_PATTERN", "configure", "engine_free_cpus", "move_off_engine_cores", "parse_cpu_list"]

logger = logging.getLogger(__name__)

#: What ``DELTASYNC_STAGING_CPUS`` may hold.
STAGING_CPUS_PATTERN = re.compile(r"auto|inherit|\d+(-\d+)?(,\d+(-\d+)?)*")


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"1,3-4"`` -> {1, 3, 4}."""
    cpus: set[int] = set()
    for item in text.split(","):
        first, _, last = item.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return frozenset(cpus)


def engine_free_cpus() -> frozenset[int] | None:
    """The engine-core process's CPUs that none of its workers (this process's siblings of the
    same name) is bound to; None when there are none or they cannot be read."""
    parent = os.getppid()
    try:
        name = Path("/proc/self/comm").read_text()
        free = set(os.sched_getaffinity(parent))
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            for pid in children.read_text().split():
                if Path(f"/proc/{pid}/comm").read_text() == name:
                    free -= os.sched_getaffinity(int(pid))
    except OSError as exc:  # a process ended meanwhile, or /proc is not Linux's
        logger.info("deltasync: cannot tell the engine's cores (%s); background work stays on this worker's", exc)
        return None
    return frozenset(free) or None


@functools.lru_cache(maxsize=None)
def _target(setting: str) -> frozenset[int] | None:
    if setting == "inherit":
        return None
    cpus = engine_free_cpus() if setting == "auto" else parse_cpu_list(setting)
    if cpus is not None:
        logger.info("deltasync: background work (staging, hashing) runs on CPUs %s", sorted(cpus))
    return cpus


_setting = ["auto"]


def configure(setting: str) -> None:
    """This worker's ``staging_cpus`` (its :class:`~vllm_ext._config.ServerConfig`'s, set once by the
    updater when it starts)."""
    _setting[0] = setting


def move_off_engine_cores() -> frozenset[int] | None:
    """Bind the calling thread (only) to the configured CPUs; returns them, or None where it
    stays. Call it first thing in a background thread."""
    cpus = _target(_setting[0])
    if cpus is None:
        return None
    try:
        os.sched_setaffinity(threading.get_native_id(), cpus)
    except OSError as exc:  # e.g. CPUs outside the container's set
        logger.warning("deltasync: cannot move %s to CPUs %s (%s)", threading.current_thread().name, sorted(cpus), exc)
        return None
    return cpus
