"""The child process of ``test_rollout_stop.py``, in a module of its own so a spawned child imports little."""

from __future__ import annotations

from typing import Any

ITEMS = 64
ITEM_BYTES = 64 * 1024  # 4 MiB in all: far more than a pipe holds, as TRL's buffer of samples can


def child(samples: Any, metrics: Any, ready: Any, stop: Any) -> None:
    """What TRL's child does: put samples nobody reads any more, then end its loops on stop."""
    for i in range(ITEMS):
        samples.put(bytes(ITEM_BYTES))
        metrics.put({"i": i})
    ready.set()
    stop.wait()
    # Returning makes the process wait for the queues' feeder threads to flush into the pipes.
