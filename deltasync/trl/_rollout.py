"""Stopping TRL's rollout worker so the training run ends when it is done.

TRL 1.16's ``AsyncRolloutWorker.stop()`` sets the child's stop event and joins it for 15 s,
reading nothing meanwhile. A process that put items on a ``multiprocessing`` queue waits at
exit until its queue's feeder thread has written them all into the pipe; samples the trainer
no longer reads fill that pipe, so the child cannot exit, and TRL terminates it after 15 s
("Child did not exit within 15s; terminating"). :func:`drain_on_stop` makes ``stop()`` read
and drop what the child still sends while it winds down, so it exits as soon as its loops end.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

__all__ = ["drain_on_stop", "stop_draining"]

logger = logging.getLogger("deltasync.trl")

#: The longest ``stop_draining`` waits for the child before leaving it to TRL's own stop
#: (which joins 15 s more, then terminates it): its loops end within one in-flight request.
STOP_TIMEOUT_S = 60.0


def stop_draining(worker: Any, timeout: float = STOP_TIMEOUT_S) -> int:
    """Ask ``worker``'s child process to stop and wait for it to exit, reading and dropping
    the samples and metrics it still sends; returns how many items were dropped.

    Does nothing for a worker that is not TRL's (no child process, stop event and queues)."""
    process = getattr(worker, "_process", None)
    stop_event = getattr(worker, "_stop_event_mp", None)
    queues = [q for q in (getattr(worker, "rollout_buffer", None), getattr(worker, "metrics_queue", None)) if q is not None]
    if process is None or stop_event is None or getattr(process, "_popen", None) is None:
        return 0
    stop_event.set()
    dropped = 0
    deadline = time.monotonic() + timeout
    while process.is_alive() and time.monotonic() < deadline:
        for q in queues:
            dropped += _drain(q)
        process.join(timeout=0.05)
    return dropped


def _drain(q: Any) -> int:
    count = 0
    while True:
        try:
            q.get_nowait()
        except (queue.Empty, OSError, ValueError, EOFError):  # empty, or closed under us
            return count
        count += 1


def drain_on_stop(worker: Any) -> None:
    """Make ``worker.stop()`` drain the child's queues while it exits, then run TRL's own
    ``stop()`` (which now finds the child gone). Safe to call twice."""
    original: Callable[[], None] = worker.stop
    if getattr(original, "_deltasync_drains", False):
        return

    def stop() -> None:
        start = time.perf_counter()
        dropped = stop_draining(worker)
        original()
        logger.debug("rollout worker stopped in %.1f s (%d unread items dropped)", time.perf_counter() - start, dropped)

    stop._deltasync_drains = True  # type: ignore[attr-defined]
    worker.stop = stop
