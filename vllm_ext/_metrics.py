"""deltasync's metrics on vLLM's ``/metrics`` (prometheus_client's default registry, which vLLM
exposes in a single API-server process)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Metrics", "metrics"]


class Outcome(Protocol):
    """What the metrics read of an update (``vllm_ext._server_sync.UpdateOutcome``, which
    imports this module: the type is named here by its fields, not imported)."""

    seconds: float
    results: Sequence[Any]
    """Each worker's answer, with the ``nbytes`` it downloaded and whether it was ``healed``."""


class Metrics:
    """The gauges, histogram and counters of one API-server process."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.served = Gauge("deltasync_served_version", "The version every worker serves (-1: none yet)")
        self.latest = Gauge("deltasync_latest_version", "The newest committed version this server has seen")
        self.update_seconds = Histogram(
            "deltasync_update_seconds",
            "Seconds from the start of an update to its end (staging included)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        )
        self.failures = Counter("deltasync_update_failures", "Updates that failed (nothing changed)")
        self.downloaded = Counter("deltasync_downloaded_bytes", "Bytes the workers downloaded from the bucket")
        self.healed = Counter(
            "deltasync_healed", "Updates built from an anchor because a delta file was corrupt or missing"
        )
        self.served.set(-1)
        self.latest.set(-1)

    def record_update(self, outcome: Outcome, served: int | None) -> None:
        self.served.set(-1 if served is None else served)
        self.latest.set(max(self.latest._value.get(), -1 if served is None else served))  # type: ignore[attr-defined]
        self.update_seconds.observe(outcome.seconds)
        self.downloaded.inc(sum(r.nbytes for r in outcome.results))
        if any(r.healed is not None for r in outcome.results):
            self.healed.inc()


_METRICS: Metrics | None = None
_LOCK = threading.Lock()


def metrics() -> Any:
    """The process's metrics, registered on first use (once: a second registration raises)."""
    global _METRICS
    with _LOCK:
        if _METRICS is None:
            _METRICS = Metrics()
        return _METRICS
