"""The live target: deltas written straight into the served weights (:mod:`.inplace`).

Staging decodes, for the elements this rank holds, the deltas from the served version on (or,
when the served weights cannot be built on, the newest anchor and the deltas after it, for a
dense load). Before anything is written, the ranks sum their fingerprint moves: a delta is
written only if the sum is what the bucket committed, and otherwise the newest anchor is staged
instead. A failed write is rolled back from the undo log on every rank; a failed anchor load
leaves weights that are no version (``tainted``), and the next update loads an anchor again.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from deltasync import DeltaReceiver, IntegrityError, NotFoundError
from deltasync.errors import UpdateError
from deltasync.protocol import Heal
from deltasync.reader import ChainReader
from deltasync.views import get_scheme

from .checkpoint import ServedCheckpoint
from .cpus import BackgroundPolicy
from .groups import reload_groups
from .inplace import InPlaceState, LiveStaged, release_freed_memory, release_later
from .seam import Worker
from .target import Applied, Refused, UpdateTarget, agree
from .weight_map import discover

__all__ = ["LiveTarget", "plan_in_place"]

logger = logging.getLogger(__name__)


class LiveTarget(UpdateTarget[LiveStaged]):
    """Applies versions by writing into the live weights of one rank.

    Args:
        live: this rank's served weights, mapped onto the checkpoint.
        checkpoint: what every anchor loaded densely must fit.
        rank: this worker's global rank (named in messages).
    """

    answer_mode = "in-place"

    def __init__(self, live: InPlaceState, checkpoint: ServedCheckpoint, rank: int) -> None:
        self.live = live
        self.checkpoint = checkpoint
        self.rank = rank
        self.gather = live.gather
        self.receiver: DeltaReceiver | None = None
        """The server's receiver, used only to read and check files (known from the first staging on)."""

    @property
    def mode(self) -> str:
        # Parameters that fall back to the layerwise reload make the whole server "reload".
        return "reload" if self.live.host else "in-place"

    def served(self) -> tuple[int | None, str | None]:
        return self.live.version, self.live.fingerprint

    @property
    def tainted(self) -> str | None:
        return self.live.tainted

    @property
    def host_copy_bytes(self) -> int:
        return self.live.host_bytes

    def stage(self, version: int, receiver: DeltaReceiver, *, dense: bool = False) -> LiveStaged:
        """Deltas on the served weights, or (catch-up, or ``dense``) the newest anchor and the
        deltas after it, decoded in full for a dense load."""
        live = self.live
        self.receiver = receiver
        reader = ChainReader(receiver.store, receiver.pointer(), view=receiver.view)
        reader.target(version)
        if not dense and live.tainted is None and reader.pointer.replays_from(live.version, live.fingerprint):
            try:
                return live.stage_deltas(reader, version)
            except (IntegrityError, NotFoundError) as exc:
                anchor = reader.pointer.anchor_for(version)
                if anchor is None or live.version is None or anchor.version <= live.version:
                    raise  # the anchor's route needs the same deltas: the file's own error says why
                # A corrupt or missing delta file that an anchor past the served version skips:
                # the ranks agree to load that anchor instead (see agree).
                return LiveStaged(from_version=live.version, from_fingerprint=live.fingerprint, version=version,
                                  kind="delta", fingerprint="", broken=f"{type(exc).__name__}: {exc}")  # fmt: skip
        full = receiver.fresh().stage(version)  # a transient copy, dropped after the load
        self.checkpoint.check(full)
        return LiveStaged(
            from_version=live.version,
            from_fingerprint=live.fingerprint,
            version=full.version,
            kind="anchor",
            fingerprint=full.fingerprint,
            names=full.names,
            changed=full.changed,
            nbytes=full.nbytes,
            seconds=full.seconds,
            dense=full,
        )

    def agree(self, error: str | None, staged: LiveStaged | None) -> LiveStaged:
        # One round trip: every rank's error, fingerprint shares and broken deltas.
        answers = self.gather((error, None if staged is None else staged.shares, None if staged is None else staged.broken))
        error = next((e for e, _, _ in answers if e is not None), None)
        if error is not None:
            raise Refused(f"refused {error}")
        assert staged is not None
        if staged.kind != "delta":
            return staged
        broken = next((b for _, _, b in answers if b is not None), None)
        if broken is None:
            try:
                staged.fingerprint = self.live.check_chain(staged, [shares for _, shares, _ in answers])
                return staged
            except IntegrityError as exc:  # the same on every rank: all shares are known to all
                broken = str(exc)
        logger.warning("deltasync: %s; loading the newest anchor instead", broken)
        error = None
        anchor: LiveStaged | None = None
        try:
            assert self.receiver is not None
            anchor = self.stage(staged.version, self.receiver, dense=True)
        except Exception as exc2:  # noqa: BLE001
            error = f"({type(exc2).__name__}): {exc2}"
        error = agree(self.gather, error)
        if error is not None:
            raise Refused(f"refused: {broken}; loading the anchor instead failed {error}")
        assert anchor is not None
        assert anchor.dense is not None
        anchor.healed = Heal(version=anchor.version, anchor=anchor.dense.versions[0], error=broken, time=time.time())
        return anchor

    def apply(self, staged: LiveStaged) -> Applied:
        applied = Applied(changed=len(staged.names), sent=len(staged.writes), undo=[])
        what, start = "writing", time.perf_counter()
        try:
            if staged.kind == "delta":
                applied.undo = self.live.write(staged)
            elif staged.kind == "anchor":
                what = "loading"
                self.live.load_anchor(staged.dense.tensors())
        except Exception as exc:  # noqa: BLE001  (every rank must reach the agreement)
            applied.undo = getattr(exc, "undo", applied.undo)
            applied.error = f"{what} version {staged.version} on rank {self.rank} failed ({type(exc).__name__}: {exc})"
        if staged.kind == "anchor":
            staged.dense = None  # drop the transient copy, and give its memory back to the system
            release_freed_memory()
            applied.extra = {"load_s": time.perf_counter() - start, "served_hash": "after the pause"}
        return applied

    def rollback(self, staged: LiveStaged, applied: Applied, error: str) -> str:
        live = self.live
        if staged.kind == "anchor":
            served = live.full_fingerprint()
            live.tainted, live.fingerprint = error, served
            return "the served weights are not those of any version: the next update loads the newest anchor again"
        try:
            live.rollback(applied.undo)  # every rank, those whose writes worked too
        except Exception as exc:  # noqa: BLE001  (a module of the host part could not be rebuilt)
            live.tainted = f"restoring the previous weights failed ({type(exc).__name__}: {exc})"
            return f"{live.tainted}: the next update loads the newest anchor again"
        return f"every rank put its previous values back: still serving {self.served_text()}"

    def commit(self, staged: LiveStaged, applied: Applied) -> None:
        self.live.commit(staged.version, staged.fingerprint)
        if staged.kind == "anchor":
            # The full hash of the served weights runs after the pause, while the engine generates;
            # the next call of any kind waits for it (``settle``) before trusting the state.
            self.live.start_full_hash()
        else:
            # After the pause: freeing tens of MB is not free.
            release_later(staged.writes, applied.undo, background=self.live.background)

    def settle(self) -> None:
        """Finish the full hash of the served weights started after an anchor."""
        if self.live.pending is not None:
            self.live.settle()

    def verify(self) -> dict[str, Any]:
        expected = self.live.fingerprint
        return {**self.live.verify(), "expected": expected, "mode": "in-place"}


def plan_in_place(
    worker: Worker, checkpoint: ServedCheckpoint, background: BackgroundPolicy | None = None,
) -> tuple[InPlaceState | None, dict[str, str]]:
    """Map the checkpoint onto ``worker``'s live weights: the in-place state (None: reload mode,
    when no name maps) and the parameters that fall back to the layerwise reload, with why.
    ``background``: where the state's background threads run (default: :class:`BackgroundPolicy`'s)."""
    expected = checkpoint.shapes
    reason = "the served checkpoint's parameter names and shapes are unknown" if expected is None else None
    reason = reason or worker.in_place_refusal()
    if reason is not None:
        logger.info("deltasync: reload mode: %s", reason)
        return None, {name: reason for name in expected or {"*": ()}}
    assert expected is not None
    start = time.perf_counter()
    quantized = checkpoint.view is not None
    scheme = None if checkpoint.view is None else get_scheme(checkpoint.view)  # its live layout
    widen = scheme is not None and scheme.live.scales == "widened"
    model, packed = worker.model, worker.packed()
    with worker.loading(scheme):
        weight_map = discover(model, expected, dtypes=checkpoint.dtypes, widen=widen, values=checkpoint.reader(),
                              transforms=worker.transformed)  # fmt: skip
    fallback: dict[str, str] = {}
    for theirs in worker.gather(weight_map.fallback):  # every rank decides alike
        fallback.update(theirs)
    names = [n for n in expected if n not in weight_map.ignored]
    # A parameter that falls back takes the rest of its vLLM module along: the layerwise
    # reload rebuilds a module only from all of its parts.
    landing = weight_map.landing
    host = reload_groups(sorted(n for n in fallback if n in names), names, packed, landing) if fallback else []
    reasons = {n: fallback.get(n, "reloaded with the rest of its vLLM module") for n in host}
    if len(host) == len(names):
        name, why = next(iter(sorted(fallback.items())))
        logger.warning("deltasync: reload mode: no parameter can be patched in place (e.g. %s: %s)", name, why)
        return None, reasons

    def reload_host(weights: list[tuple[str, torch.Tensor]]) -> None:
        """Rebuild whole modules from the host copy of the parameters that fall back."""
        partial = worker.reload(iter(weights))
        if partial:
            raise UpdateError(f"modules {', '.join(partial[:5])} were loaded only in part")

    def load_dense(weights: Any) -> None:
        with worker.loading(scheme), torch.no_grad():
            model.load_weights(weights)

    live = InPlaceState(
        model, weight_map, worker.gather, worker.rank_index(), load_dense,
        host={n: expected[n] for n in host}, reload=reload_host,
        groups=lambda changed: reload_groups(changed, host, packed, landing),
        dtypes=checkpoint.dtypes if quantized else None, background=background,
    )  # fmt: skip
    if host:
        name, why = next(iter(sorted(fallback.items())))
        logger.warning("deltasync: %d of %d checkpoint tensors fall back to the layerwise reload (e.g. %s: %s); "
                       "the other %d are patched in place", len(host), len(names), name, why,
                       len(names) - len(host))  # fmt: skip
    logger.info("deltasync: in-place mode: %d checkpoint tensors mapped in %.2f s; served fingerprint %s",
                len(names) - len(host), time.perf_counter() - start, live.fingerprint)  # fmt: skip
    return live, reasons
