"""Where a worker's background work runs: off the cores the engine computes on, and behind it.

vLLM-CPU binds each worker (its main thread, and every thread it starts) to that worker's
OpenMP cores (``VLLM_CPU_OMP_THREADS_BIND``) and leaves others to the API server and the
engine core. A prefetch thread started in the worker inherits that binding, so staging a
version would take turns with the forward passes on the same core, and generation would slow
by as much as staging costs. Each of deltasync's background threads (prefetch, the served
hash, freeing memory) calls :meth:`BackgroundPolicy.enter` first, which does two things. The
worker's updater holds the policy (made from its :class:`~deltasync.server.config.ServerConfig`) and
hands it to its in-place state.

It moves the thread, as ``DELTASYNC_STAGING_CPUS`` says
(:class:`deltasync.server.config.ServerConfig.staging_cpus`):

- ``auto`` (the default): the CPUs the engine-core process may use that no worker of this
  engine is bound to (its sibling processes). None on a GPU server or an unbound one (nothing
  to move off), and None where the workers take every core (TP=2 on two cores): there the
  thread stays where it is.
- ``inherit``: never move.
- a CPU list, e.g. ``1`` or ``2-3,6``: those CPUs.

And it lowers the priority of staging and freeing memory by ``DELTASYNC_STAGING_NICE`` (Linux
threads each have their own nice value; 19 by default, 0 keeps the worker's), not that of the
full hash after an anchor, which the next call of any kind waits for. The cores left to the API
server and the engine core are not idle while the engine generates: the engine core busy-waits
for each step's output, and it schedules the next step only when it has the CPU. A staging
thread at the same priority takes half of such a core and every step waits for it; behind them,
it takes what they leave, and a version takes longer to stage where no core is idle, not the
streams longer to generate (``benchmarks/inflight.py`` measures both). ``idle`` goes further:
Linux SCHED_IDLE, below nice 19, which serving preempts at once.

:func:`shorten_switch_interval` (the updater calls it when it starts) sets the worker's
interpreter switch interval to :data:`SWITCH_INTERVAL_S`. A background thread shares the worker's interpreter lock with the
forward pass, which gives it up during each torch operation and needs it back between them. A
thread that holds it keeps it until it waits on something or the switch interval (5 ms by
default) asks it to give it up, so each handoff could stall the forward pass for that long.
Where no other thread wants the lock, the interval changes nothing.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "STAGING_CPUS_PATTERN",
    "SWITCH_INTERVAL_S",
    "Background",
    "BackgroundPolicy",
    "engine_free_cpus",
    "parse_cpu_list",
    "shorten_switch_interval",
]

logger = logging.getLogger(__name__)

#: The worker's interpreter switch interval: the longest a background thread that holds the
#: interpreter lock keeps the forward pass waiting for it, each time.
SWITCH_INTERVAL_S = 0.0002

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


@dataclass(frozen=True)
class Background:
    """Where a background thread runs: ``cpus`` it was moved to (None: it stayed on the
    worker's) and its ``nice`` value."""

    cpus: tuple[int, ...] | None
    nice: int
    idle: bool = False
    """Scheduled as Linux SCHED_IDLE (``DELTASYNC_STAGING_NICE=idle``): only when no thread of
    normal priority wants the CPU."""


def shorten_switch_interval() -> None:
    """Set this worker's interpreter switch interval to :data:`SWITCH_INTERVAL_S` (see the module)."""
    sys.setswitchinterval(SWITCH_INTERVAL_S)


class BackgroundPolicy:
    """Where and at what priority a worker's background threads run: its
    :class:`~deltasync.server.config.ServerConfig`'s ``staging_cpus`` (``setting``) and ``staging_nice``
    (``nice``), held by the worker's updater and its in-place state.

    The CPUs a setting names are looked up once, by the first thread that enters the background.
    """

    def __init__(self, setting: str = "auto", nice: int | str = 0) -> None:
        self.setting = setting
        self.nice = nice
        self._cpus: tuple[frozenset[int] | None] | None = None
        """The CPUs ``setting`` names, once looked up (a 1-tuple: None is an answer too)."""

    def cpus(self) -> frozenset[int] | None:
        """The CPUs background threads move to (None: they stay on the worker's)."""
        if self._cpus is None:
            cpus = None
            if self.setting != "inherit":
                cpus = engine_free_cpus() if self.setting == "auto" else parse_cpu_list(self.setting)
            if cpus is not None:
                logger.info("deltasync: background work (staging, hashing) runs on CPUs %s", sorted(cpus))
            self._cpus = (cpus,)
        return self._cpus[0]

    def enter(self, *, behind: bool = True) -> Background:
        """Move the calling thread (only) to :meth:`cpus` and, where ``behind``, lower its
        priority by ``nice``. Call it first thing in a background thread.

        Work that something waits for (the served hash after an anchor, which the next call of
        any kind settles) passes ``behind=False``: a thread cannot raise its priority again."""
        nice: int | str = self.nice if behind else 0
        thread = threading.current_thread().name
        tid = threading.get_native_id()
        idle = False
        if nice == "idle":
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
                idle = True
            except (OSError, AttributeError) as exc:  # AttributeError: not Linux
                logger.warning("deltasync: cannot schedule %s as SCHED_IDLE (%s)", thread, exc)
        elif nice:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + int(nice))
            except OSError as exc:
                logger.warning("deltasync: cannot lower the priority of %s (%s)", thread, exc)
        try:
            now = os.getpriority(os.PRIO_PROCESS, tid)
        except OSError:
            now = 0
        cpus = self.cpus()
        if cpus is not None:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError as exc:  # e.g. CPUs outside the container's set
                logger.warning("deltasync: cannot move %s to CPUs %s (%s)", thread, sorted(cpus), exc)
                cpus = None
        return Background(None if cpus is None else tuple(sorted(cpus)), now, idle)
