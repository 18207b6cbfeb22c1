"""The publisher's capture: a version's changes, copied out of the live weights.

:class:`ChangeCapture` asks the detector which elements changed, maps them to checkpoint
tensors and moves the chain's fingerprint by them: in :meth:`DeltaPublisher.submit
<deltasync.trainer.publisher.DeltaPublisher.submit>` (``capture="submit"``), or in the
publisher's background thread while the optimizer's next step waits (``capture="overlap"``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from ..format.fingerprint import format_fingerprint, parse_fingerprint

if TYPE_CHECKING:
    from ..format import Change
    from .checkpoint_layout import CheckpointLayout
    from .detector import BF16ChangeDetector
    from .sharded import ShardLayout

__all__ = ["CAPTURE_MODES", "Capture", "CaptureMode", "ChangeCapture"]

CaptureMode = Literal["submit", "overlap"]
CAPTURE_MODES: tuple[CaptureMode, ...] = get_args(CaptureMode)


@dataclass
class Capture:
    """One version between its capture and its commit."""

    version: int
    changes: dict[str, Change] | None
    """In checkpoint layout: what the delta holds. None until found, when the capture overlaps
    the next step (``release`` then lets it go)."""
    live: dict[str, Change] | None
    """The same changes on the live parameters: what the detector commits."""
    fingerprint: str
    forced_anchor: bool
    started: float
    blocked_s: float
    release: Callable[[], float] | None = None


class ChangeCapture:
    """Finds each version's changes (collective), at submit or overlapping the next step.

    Args:
        detector: the publisher's change detector.
        checkpoint: the live parameters in checkpoint layout.
        layout: the checkpoint tensors this rank owns.
        mode: ``PublishOptions.capture``.
    """

    def __init__(self, detector: BF16ChangeDetector, checkpoint: CheckpointLayout, layout: ShardLayout,
                 mode: CaptureMode) -> None:  # fmt: skip
        self.detector = detector
        self.checkpoint = checkpoint
        self.layout = layout
        self.mode = mode

    def take(self, version: int, base: str | None, anchor: bool, start: float) -> Capture:
        """Version ``version``'s capture on top of the committed fingerprint ``base`` (None: a
        new chain, whose first version has an anchor and no delta). With ``capture="overlap"``
        its changes are left for :meth:`detect`, and the optimizer's next step waits for them."""
        if base is None:
            self.detector.reset()
            return Capture(version, {}, {}, "", True, start, time.perf_counter() - start)
        if self.mode == "overlap":
            release = self.detector.hold_next_step()
            return Capture(version, None, None, "", anchor, start, time.perf_counter() - start, release)
        return self.detect(Capture(version, None, None, "", anchor, start, 0.0), base, None)

    def detect(self, capture: Capture, base: str, group: Any) -> Capture:
        """``capture`` with its changes found (collective, over ``group``) on top of the committed
        fingerprint ``base``, and, overlapping the next step, that step let go (it may have
        waited: that counts as blocked)."""
        try:
            (changes, live), shares = self.layout.agree(
                f"detecting the changes of version {capture.version}", self._local_changes, group
            )
        finally:
            waited = capture.release() if capture.release is not None else time.perf_counter() - capture.started
        fp = format_fingerprint(parse_fingerprint(base) + sum(shares))
        return replace(
            capture, changes=changes, live=live, fingerprint=fp, blocked_s=capture.blocked_s + waited, release=None  # type: ignore[arg-type]
        )

    def _local_changes(self) -> tuple[tuple[dict[str, Change], dict[str, Change]], int]:
        """This rank's changes (in checkpoint layout, and on the live parameters) and its share of
        the fingerprint's move (0 on ranks that own nothing)."""
        live = self.detector.changes()
        changes = self.checkpoint.to_checkpoint(live)
        if self.checkpoint.identity and self.detector.last_share is not None:
            return (changes, live), self.detector.last_share  # summed where the weights are
        return (changes, live), self.checkpoint.fingerprint_move(live)
