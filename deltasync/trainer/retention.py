"""The publisher's retention: what the committed pointer no longer needs leaves the bucket.

Runs on rank 0 after an anchor commits (and temp cleaning when a publisher starts), for the
bf16 chain and, in its folder, for each quantized view's chain. Never fails a publish: the
version is committed already, and old files only cost space.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import WriterConflictError
from ..stores import TempCleaningStore

if TYPE_CHECKING:
    from ..format import Pointer
    from ..stores import Store

__all__ = ["Retention"]

logger = logging.getLogger("deltasync.trainer.publisher")  # the publisher's parts log as the publisher


class Retention:
    """Deletes the data files the committed pointer no longer names, and stale temporary files.

    Args:
        store: the chain's folder (the bucket, or a view's folder).
        pointer: returns the pointer last committed, or None where the chain's pointer is no
            longer this writer's (checked in the store under the commit lock:
            :meth:`~deltasync.trainer.committer.ChainCommitter.owned_pointer`).
        stale_temp_seconds: ``PublishOptions.stale_temp_seconds``.
    """

    def __init__(self, store: Store, pointer: Callable[[], Pointer | None], stale_temp_seconds: float) -> None:
        self.store = store
        self.pointer = pointer
        self.stale_temp_seconds = stale_temp_seconds

    def housekeep(self, version: int) -> list[str]:
        """Retention and temp-file cleaning after the anchor of ``version`` was committed:
        never raises; returns the warnings (also logged)."""
        warnings: list[str] = []
        try:
            self.retain()
        except Exception as exc:  # noqa: BLE001  (reported, not raised: the version is committed)
            warnings.append(f"retention after the anchor of version {version} failed, old files are left: {exc}")
            logger.warning("deltasync: %s", warnings[-1])
        self.clean_temp()
        return warnings

    def retain(self) -> None:
        """Delete the data files the pointer no longer needs: anchors older than its oldest
        anchor, and deltas at or below its base. Nothing else is ever deleted."""
        pointer = self.pointer()
        if pointer is None:
            # Another writer took the chain: what its pointer names is not for this one to judge.
            raise WriterConflictError(f"the pointer of bucket {self.store.url} is no longer this writer's; nothing deleted")
        stale = pointer.stale([*self.store.list("anchors/"), *self.store.list("deltas/")])
        if stale:
            self.store.delete(stale)

    def clean_temp(self) -> None:
        """Delete temporary files that killed writes left (local buckets only; best effort)."""
        clean = self.store.clean_temp if isinstance(self.store, TempCleaningStore) else None
        if clean is None:
            return
        try:
            removed = clean(self.stale_temp_seconds)
        except Exception as exc:  # noqa: BLE001  (housekeeping never fails a publish)
            logger.warning("deltasync: cannot clean stale temporary files in %s: %s", self.store.url, exc)
            return
        if removed:
            logger.info("deltasync: removed %d stale temporary file(s) in %s", len(removed), self.store.url)
