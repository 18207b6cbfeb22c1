"""What a worker's update writes into: the small interface of the two update targets.

:class:`~deltasync.server.updater.WorkerUpdater` runs one update flow (check, stage, agree, apply,
agree, commit or roll back) over a target:

- :class:`~deltasync.server.reload_target.ReloadTarget`: a host copy of the weights (a
  :class:`~deltasync.DeltaReceiver`) from which changed modules are rebuilt through vLLM's
  layerwise reload;
- :class:`~deltasync.server.live_target.LiveTarget`: deltas written straight into the live weights.

A target stages while the engine generates (possibly in a background thread), and applies,
rolls back and commits inside the caller's pause. Every method that the flow calls on every
rank in step may exchange data with the other ranks, through the target's ``gather`` (the
worker's, :class:`deltasync.server.seam.Worker`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from deltasync import DeltaReceiver
from deltasync.collective import failures
from deltasync.protocol import Heal

__all__ = ["Applied", "Refused", "Staged", "UpdateTarget", "agree", "alone", "served_text"]


class Staged(Protocol):
    """A version staged by a target (:class:`~deltasync.StagedUpdate` or
    :class:`~deltasync.server.inplace.LiveStaged`): checked, not applied."""

    from_version: int | None
    from_fingerprint: str | None
    version: int
    fingerprint: str
    kind: str
    nbytes: int
    seconds: float
    healed: Heal | None
    """Set when the version was built from an anchor because a delta file was corrupt or missing."""


S = TypeVar("S", bound=Staged)
"""The staged type of a target."""


@dataclass
class Applied:
    """What one rank's :meth:`UpdateTarget.apply` did."""

    error: str | None = None
    """This rank's failure (the flow then rolls every rank back)."""
    changed: int = 0
    """Checkpoint tensors the version changes."""
    sent: int = 0
    """Tensors (or live parameters) written."""
    undo: Any = None
    """What :meth:`UpdateTarget.rollback` needs to put the previous values back."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further timings for the answer (an anchor's load)."""


class Refused(Exception):
    """Some rank could not stage the update, so no rank touches its model; the message
    starts with "refused" and says why."""


class UpdateTarget(ABC, Generic[S]):
    """The served weights of one worker, as the update flow moves them; ``S``: what its
    :meth:`stage` makes and every later step takes."""

    #: The ``mode`` an update's answer reports.
    answer_mode: str

    #: ``obj`` of every rank of this engine, in rank order (the same list on all): the
    #: worker's :meth:`~deltasync.server.seam.Worker.gather`, set by each target.
    gather: Callable[[Any], list[Any]]

    @property
    def mode(self) -> str:
        """"in-place" or "reload" (what ``deltasync_status`` reports)."""
        return self.answer_mode

    @abstractmethod
    def served(self) -> tuple[int | None, str | None]:
        """The version and fingerprint served (before the first update: version None)."""

    @property
    def tainted(self) -> str | None:
        """Why the served weights are no version at all (None: they are ``served()``)."""
        return None

    @property
    @abstractmethod
    def host_copy_bytes(self) -> int:
        """Bytes of the weights this worker keeps on the host beside the live ones."""

    @abstractmethod
    def stage(self, version: int, receiver: DeltaReceiver) -> S:
        """Download, decode and check ``version`` against what is served; change nothing.
        Runs while the engine generates, possibly in a background thread."""

    def agree(self, error: str | None, staged: S | None) -> S:
        """Every rank's staging outcome (a collective): the staged update to apply, or
        :class:`Refused` with the first rank's ``error``."""
        error = agree(self.gather, error)
        if error is not None:
            raise Refused(f"refused {error}")
        assert staged is not None
        return staged

    @abstractmethod
    def apply(self, staged: S) -> Applied:
        """Write ``staged`` into this rank's served weights (never raises: see ``Applied.error``)."""

    @abstractmethod
    def rollback(self, staged: S, applied: Applied, error: str) -> str:
        """Put back what was served before ``apply`` (on every rank, after ``error`` on any);
        says what is served now."""

    @abstractmethod
    def commit(self, staged: S, applied: Applied) -> None:
        """Every rank applied ``staged``: it is what is served now."""

    def settle(self) -> None:  # an optional hook
        """Finish any check of the served weights still running after the last update (a
        collective: every worker calls this first in every deltasync call)."""

    @abstractmethod
    def verify(self) -> dict[str, Any]:
        """Recompute the served fingerprint in full and compare it with the one tracked."""

    def served_text(self) -> str:
        return served_text(self.served()[0])


def served_text(version: int | None) -> str:
    """What a message says is served."""
    return "the checkpoint it started with" if version is None else f"version {version}"


def alone(obj: Any) -> list[Any]:
    """The gather of a worker that has no other rank."""
    return [obj]


def agree(gather: Callable[[Any], list[Any]], error: str | None) -> str | None:
    """The first error any rank reports through ``gather`` (the same answer on every rank)."""
    failed = failures(gather(error))
    return failed[0][1] if failed else None
