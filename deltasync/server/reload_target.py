"""The reload target: a host copy of the weights, and the engine's layerwise reload of what changed.

The worker keeps an exact HF-named bf16 copy of the weights (a :class:`~deltasync.DeltaReceiver`
following the server's bucket). A version is staged on that copy without touching it; applying
rebuilds the changed modules (whole fused groups) from the staged values through the engine's loaders
(:meth:`~deltasync.server.seam.Worker.reload`),
which shard for tensor parallelism; only when every rank loaded does the copy commit. After a
failed load, every rank reloads the copy's previous state.
"""

from __future__ import annotations

import logging
from typing import Any

from deltasync import DeltaReceiver, StagedUpdate
from deltasync.errors import UpdateError

from .checkpoint import ServedCheckpoint
from .groups import reload_groups
from .inplace import wait_for_device
from .seam import Worker
from .target import Applied, UpdateTarget

__all__ = ["ReloadTarget"]

logger = logging.getLogger(__name__)


class ReloadTarget(UpdateTarget[StagedUpdate]):
    """Applies versions by reloading modules from a host copy of the weights.

    Args:
        worker: the worker's engine (its model, ranks and layerwise reload).
        checkpoint: what every staged version must fit.
    """

    answer_mode = "reload"

    def __init__(self, worker: Worker, checkpoint: ServedCheckpoint) -> None:
        self.worker = worker
        self.model = worker.model
        self.packed = worker.packed()
        self.checkpoint = checkpoint
        self.gather = worker.gather
        self.receiver: DeltaReceiver | None = None
        """The host copy (the server's receiver, known from the first staging on)."""

    def served(self) -> tuple[int | None, str | None]:
        receiver = self.receiver
        return (None, None) if receiver is None else (receiver.version, receiver.fingerprint)

    @property
    def host_copy_bytes(self) -> int:
        return 0 if self.receiver is None else sum(t.nbytes for t in self.receiver.state_dict().values())

    def stage(self, version: int, receiver: DeltaReceiver) -> StagedUpdate:
        self.receiver = receiver
        staged = receiver.stage(version)
        self.checkpoint.check(staged)
        return staged

    def apply(self, staged: StagedUpdate) -> Applied:
        """Load the staged values into the model; the host copy is not committed here."""
        try:
            changed, sent = self._reload(staged)
            wait_for_device(self.model.parameters())  # queued CUDA kernels count in apply_s
        except Exception as exc:  # noqa: BLE001  (every rank must reach the agreement)
            return Applied(error=f"loading version {staged.version} into the model failed "
                                 f"({type(exc).__name__}: {exc})")  # fmt: skip
        return Applied(changed=changed, sent=sent)

    def _reload(self, staged: StagedUpdate) -> tuple[int, int]:
        assert self.receiver is not None
        changed = staged.names
        if staged.kind == "anchor":
            send = changed
        else:
            send = reload_groups(changed, list(self.receiver.state_dict()), self.packed)
        partial = self.worker.reload((n, staged.tensor(n)) for n in send)
        if partial:
            # A module got part of its elements: the groups did not cover this model's
            # layout. Rebuild every module from the full new state.
            logger.warning(
                "deltasync: %d modules were loaded only in part (%s); reloading every parameter",
                len(partial), ", ".join(partial[:5]),
            )  # fmt: skip
            send = list(self.receiver.state_dict()) if staged.kind == "delta" else changed
            partial = self.worker.reload((n, staged.tensor(n)) for n in send)
            if partial:
                raise UpdateError(f"modules {', '.join(partial[:5])} were still loaded only in part")
        return len(changed), len(send)

    def rollback(self, staged: StagedUpdate, applied: Applied, error: str) -> str:
        """Reload the state from before the failed update (the host copy's, or the checkpoint's)."""
        receiver = self.receiver
        try:
            if receiver is not None and receiver.version is not None:
                weights = iter(receiver.state_dict().items())
            else:
                weights = self.worker.checkpoint_weights()
            self.worker.reload(weights)
        except Exception:
            logger.exception("deltasync: restoring the previous weights failed")
            return "restoring the previous weights failed too: restart this server"
        return f"the weights were restored: still serving {self.served_text()}"

    def commit(self, staged: StagedUpdate, applied: Applied) -> None:
        assert self.receiver is not None
        self.receiver.apply(staged)

    def verify(self) -> dict[str, Any]:
        receiver = self.receiver
        ok = receiver is not None and receiver.verify()
        fingerprint = None if receiver is None else receiver.fingerprint
        return {"ok": ok, "fingerprint": fingerprint, "expected": fingerprint,
                "version": None if receiver is None else receiver.version, "mode": "reload"}  # fmt: skip
