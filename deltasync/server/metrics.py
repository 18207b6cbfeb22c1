"""deltasync's metrics: gauges, a histogram and counters of one update flow.

A :class:`Metrics` is held by its owner (the flow of one API-server process) and keeps its
series in a registry of its own; :meth:`Metrics.expose` adds them to prometheus_client's
default registry, the one vLLM's ``/metrics`` serves in a single API-server process, while the
server runs. Nothing here is global: two flows in one process (as in the tests) count apart.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Metrics"]

logger = logging.getLogger(__name__)


class Outcome(Protocol):
    """What the metrics read of an update (``deltasync.server.flow.UpdateOutcome``, which imports this
    module: the type is named here by its fields, not imported)."""

    @property
    def seconds(self) -> float: ...

    @property
    def results(self) -> Sequence[Any]:
        """Each worker's answer, with the ``nbytes`` it downloaded and whether it was ``healed``."""
        ...


class Metrics:
    """The gauges, histogram and counters of one update flow."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        """This flow's series (see :meth:`expose`)."""
        self._exposed_in: Any = None
        registry = self.registry
        self.served = Gauge("deltasync_served_version", "The version every worker serves (-1: none yet)", registry=registry)
        self.latest = Gauge("deltasync_latest_version", "The newest committed version this server has seen", registry=registry)
        self.update_seconds = Histogram(
            "deltasync_update_seconds",
            "Seconds from the start of an update to its end (staging included)",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
            registry=registry,
        )
        self.failures = Counter("deltasync_update_failures", "Updates that failed (nothing changed)", registry=registry)
        self.downloaded = Counter(
            "deltasync_downloaded_bytes", "Bytes the workers downloaded from the bucket", registry=registry
        )
        self.healed = Counter(
            "deltasync_healed", "Updates built from an anchor because a delta file was corrupt or missing", registry=registry
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

    def expose(self, target: Any = None) -> None:
        """Serve these series from ``target`` (default: prometheus_client's default registry,
        which vLLM's ``/metrics`` serves) until :meth:`hide`. Where another flow of this process
        already serves them there, they stay unexposed (a warning says so)."""
        if self._exposed_in is not None:
            return
        if target is None:
            from prometheus_client import REGISTRY

            target = REGISTRY
        try:
            target.register(self.registry)
        except ValueError as exc:  # prometheus_client's DuplicateTimeseries
            logger.warning("deltasync: metrics not exposed: %s", exc)
            return
        self._exposed_in = target

    def hide(self) -> None:
        """Stop serving these series from the registry :meth:`expose` added them to."""
        target, self._exposed_in = self._exposed_in, None
        if target is not None:
            target.unregister(self.registry)
