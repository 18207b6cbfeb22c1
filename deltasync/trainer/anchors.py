"""The publisher's anchor schedule: when a version gets a full anchor, written in the background.

An anchor is due every ``anchor_every`` versions, or once the deltas since the last one add up
to more than ``anchor_bytes_ratio`` of an anchor's size, or when the caller asks for one. It is
streamed from the detector's pinned snapshot by a thread of its own, over a process group of
its own, while later deltas go on committing; the pointer names it once it is complete.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .detector import BF16ChangeDetector
    from .retention import Retention
    from .sharded import ShardLayout
    from .writer import ChainState, ChainWriter, LateWarnings

__all__ = ["AnchorScheduler"]


class AnchorScheduler:
    """Starts an anchor of a committed version when one is due, and commits it in the background.

    Never raises to the trainer: an anchor that fails is reported (:class:`LateWarnings`) and
    the next one is due at once; the deltas carry on.

    Args:
        layout: the checkpoint tensors this rank owns (its ``agree`` is the collective step).
        detector: whose snapshot is pinned while an anchor streams from it.
        writer: writes and commits the anchor.
        retention: runs after each anchor commits (rank 0).
        warnings: where failures go.
        anchor_every, anchor_bytes_ratio: the schedule (:class:`~deltasync.PublishOptions`).
    """

    def __init__(
        self,
        layout: ShardLayout,
        detector: BF16ChangeDetector,
        writer: ChainWriter,
        retention: Retention,
        warnings: LateWarnings,
        *,
        anchor_every: int,
        anchor_bytes_ratio: float,
    ) -> None:
        self.layout = layout
        self.detector = detector
        self.writer = writer
        self.retention = retention
        self.warnings = warnings
        self.anchor_every = anchor_every
        self.anchor_bytes_ratio = anchor_bytes_ratio
        # Collective: every rank creates it in the same order, after the delta thread's group.
        self.group = layout.new_group()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="deltasync-anchor")
        self.inflight: Future[None] | None = None
        """The anchor being written, or the last one (done)."""

    def schedule(self, chain: ChainState, version: int, fp: str, forced: bool, group: Any) -> bool:
        """Start an anchor of ``version`` (committed, fingerprint ``fp``) beside its delta if it
        is due (collective over ``group``; never raises)."""
        layout = self.layout
        busy = self.inflight is not None and not self.inflight.done()
        try:
            _, views = layout.agree(
                f"scheduling the anchor of version {version}",
                lambda: (None, (busy, forced or self.due(chain, version))),
                group,
            )
        except Exception as exc:  # noqa: BLE001 - the delta is committed; an anchor can wait
            self.warnings.warn(f"cannot schedule an anchor of version {version}: {exc}")
            return False
        due = views[0][1]  # rank 0's view decides: ranks may see anchors end at other times
        if not due:
            return False
        if any(b for b, _ in views):
            if not forced:
                return False
            # Forced: the anchor in flight ends first, on every rank alike (its last step is
            # collective), so this one then starts everywhere.
            assert self.inflight is not None or not busy
            if self.inflight is not None:
                Future.exception(self.inflight)
        self.detector.pin()
        chain.anchor_started, chain.since_anchor = version, 0
        self.inflight = self._pool.submit(self._background, chain, version, fp)
        return True

    def due(self, chain: ChainState, version: int) -> bool:
        """Whether the schedule asks for an anchor of ``version``."""
        if version - chain.anchor_started >= self.anchor_every:
            return True
        ratio = self.anchor_bytes_ratio
        return ratio > 0 and chain.since_anchor > ratio * chain.anchor_nbytes

    def wait(self) -> None:
        """Wait for the anchor in flight."""
        if self.inflight is not None:
            self.inflight.result()

    def close(self) -> None:
        """Wait for the anchor in flight, then end the thread and its group."""
        self._pool.shutdown(wait=True)
        self.layout.release_group(self.group)
        self.group = None

    def _background(self, chain: ChainState, version: int, fp: str) -> None:
        """An anchor of a committed version, streamed from the pinned snapshot; then committed
        into the pointer beside the deltas. A failure is reported, never raised to the trainer:
        the deltas carry on, and the next anchor is due at once."""
        try:
            try:
                entry, _ = self.writer.write_anchor(version, fp, self.group)
            finally:
                self.detector.unpin()
            self.writer.commit_anchor(entry, self.group)
        except Exception as exc:  # noqa: BLE001 - reported with the next result, and logged
            chain.anchor_started = -(1 << 62)  # due again at the next version
            self.warnings.warn(f"the anchor of version {version} was not committed (the deltas are): {exc}")
            return
        chain.anchor_nbytes = entry.nbytes
        if self.layout.rank == 0:
            for warning in self.retention.housekeep(version):
                self.warnings.add(warning)
