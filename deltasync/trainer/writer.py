"""The publisher's writer of the bf16 chain: delta and anchor files (or their parts), then history and pointer.

:class:`ChainWriter` is the bf16 chain's :class:`~deltasync.trainer.committer.ChainCommitter`
(the commit sequence every chain shares, the quantized views' too): it takes the bucket's
chain when a publisher starts (:class:`~deltasync.trainer.ownership.ChainOwnership`), encodes
each version's delta from the detected changes and streams its anchors from the snapshot. Its
commits hold one lock, so that the background anchor thread and the delta thread never
interleave them. :class:`ChainState` is what every rank knows of the committed chain;
:class:`LateWarnings` collects the problems that came after a result.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import IntegrityError
from ..format import AnchorSource, ChainEntry, Change, Pointer, delta_pieces, manifest_digest
from ..format.codecs.zstd import encode_threads
from ..format.fingerprint import DEVICE_CHUNK, DeviceHasher, fingerprint_slice_share, format_fingerprint
from .committer import AnchorFile, ChainCommitter
from .ownership import ChainOwnership

if TYPE_CHECKING:
    from ..stores import Store
    from .checkpoint_layout import CheckpointLayout
    from .detector import BF16ChangeDetector
    from .sharded import ShardLayout

__all__ = ["ChainState", "ChainWriter", "LateWarnings"]

ANCHOR_DEVICE_CHUNK = 1 << 25
"""Elements an anchor copies from an accelerator to the host at a time (64 MiB of bf16)."""

logger = logging.getLogger("deltasync.trainer.publisher")  # the publisher's parts log as the publisher


@dataclass
class ChainState:
    """What every rank knows of the committed chain (rank 0 also holds the whole pointer)."""

    version: int
    fingerprint: str
    total: int
    root: int
    anchor_nbytes: int
    """Size of the newest complete anchor (for ``anchor_bytes_ratio``)."""
    since_anchor: int
    """Delta bytes committed since the last anchor was started."""
    anchor_started: int
    """The version of the newest anchor started (complete, or being written)."""


class LateWarnings:
    """Problems that did not undo a commit, kept (and logged) until the next result takes them."""

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._items: list[str] = []

    def warn(self, message: str) -> None:
        """Log ``message`` and keep it for the next result."""
        logger.warning("deltasync: %s", message)
        self.add(message)

    def add(self, message: str) -> None:
        """Keep ``message`` (logged already) for the next result."""
        with self._lock:
            self._items.append(message)

    def take(self) -> tuple[str, ...]:
        """The warnings kept so far; none are kept after."""
        with self._lock:
            taken, self._items = tuple(self._items), []
        return taken

    def peek(self) -> list[str]:
        """The warnings kept so far; they stay kept."""
        with self._lock:
            return list(self._items)


class ChainWriter(ChainCommitter):
    """Writes the bf16 chain's data files and commits its history and pointer.

    Args:
        store: the bucket.
        detector: the change detector, whose snapshot anchors are streamed from.
        params: live parameter name -> its tensor (the values of parameters that are not trained).
        checkpoint: the live parameters in checkpoint layout.
        live_layout: the live parameters this rank holds.
        layout: the checkpoint tensors this rank owns and writes.
        codec, level: the delta codec and its level.
        keep_anchors: complete anchors the pointer keeps.
        lease_s: how long after each commit this writer holds the chain (:mod:`.ownership`).
        take_over: take the chain even from a writer that holds it.
    """

    owner: ChainOwnership | None
    """This writer's hold on the chain (rank 0)."""

    def __init__(
        self,
        store: Store,
        detector: BF16ChangeDetector,
        params: dict[str, torch.Tensor],
        checkpoint: CheckpointLayout,
        live_layout: ShardLayout,
        layout: ShardLayout,
        *,
        codec: str,
        level: int,
        keep_anchors: int,
        lease_s: float = 600.0,
        take_over: bool = False,
    ) -> None:
        owner = ChainOwnership(store, lease_s=lease_s, take_over=take_over) if layout.rank == 0 else None
        super().__init__(store, layout, owner)
        self.detector = detector
        self.params = params
        self.checkpoint = checkpoint
        self.live_layout = live_layout
        self.codec, self.level, self.keep_anchors = codec, level, keep_anchors
        self.numels = checkpoint.numels
        self.manifest = manifest_of(layout)
        """The bf16 state's manifest digest, committed in the pointer and every file."""
        self.anchor_metadata: dict[str, str] = {}
        """Extra ``x-`` metadata written into every anchor."""

        def start() -> tuple[None, tuple[Pointer | None, int]]:
            # Rank 0 alone reads and takes the chain, so that every rank starts from the same pointer.
            if owner is None:
                return None, (None, 0)
            return None, owner.claim(owner.read())

        found = layout.agree("reading the pointer", start)
        self.next_version = found[1][0][1]
        """The version a new chain starts at: the one after the newest committed."""
        self.start(found[1][0][0] if layout.rank == 0 else None)

    def release(self) -> None:
        """Let go of the chain (a publisher that closes; rank 0): the next writer takes it at once."""
        if self.owner is not None:
            with self.lock:
                self.owner.release(self.pointer)

    # ------------------------------------------------------------------ deltas

    def write_delta(self, version: int, changes: dict[str, Change], fingerprint: str, chain: ChainState,
                    group: Any) -> ChainEntry:  # fmt: skip
        """Write this rank's part of the delta of ``version`` on top of ``chain`` (collective,
        over ``group``); return the version's entry."""

        def encode() -> tuple[list[memoryview], int]:
            data = delta_pieces(
                changes, version=version, anchor=chain.root, codec=self.codec, total=chain.total,
                fingerprint=fingerprint, base_fingerprint=chain.fingerprint, level=self.level, numels=self.numels,
                part=self.part, manifest=self.manifest,
            )  # fmt: skip
            return data, sum(c.index.numel() for c in changes.values())

        return self.write_delta_file(version, fingerprint, encode, group)

    def commit_delta(self, entry: ChainEntry, total: int, group: Any) -> None:
        """Commit the delta ``entry`` as the newest version (collective; rank 0 writes)."""

        def pointer(committed: Pointer | None) -> Pointer:
            assert committed is not None
            return replace(committed, version=entry.version, fingerprint=entry.fingerprint, chain=(*committed.chain, entry))

        self.commit(f"version {entry.version}", pointer, self.record("delta", entry, total), group)

    # ------------------------------------------------------------------ anchors

    def commit_root(self, entry: ChainEntry, total: int, group: Any) -> None:
        """Commit the anchor ``entry`` as the first version of a new chain (collective)."""
        pointer = Pointer.start(entry, total=total, manifest=self.manifest)
        self.commit(f"version {entry.version}", lambda _: pointer, self.record("anchor", entry, total), group)

    def commit_anchor(self, entry: ChainEntry, group: Any) -> None:
        """Commit the newly complete anchor ``entry`` of a committed version into the pointer,
        which then keeps the window :attr:`keep_anchors` says (collective)."""

        def pointer(committed: Pointer | None) -> Pointer:
            assert committed is not None
            return committed.with_anchor(entry, self.keep_anchors)

        self.commit(f"the anchor of version {entry.version}", pointer, None, group)

    def write_anchor(self, version: int, expected: str | None, group: Any) -> tuple[ChainEntry, str]:
        """Stream this rank's part of the anchor of ``version`` from the snapshot (pinned by the
        caller) and the untracked parameters; return the version's entry and fingerprint.

        With ``expected`` (the chain's fingerprint of that version) the streamed values are
        hashed on the way and must add up to it; without, they are hashed first. A single
        writer's large anchor is written as parts at once (:meth:`anchor_files`), each hashed in
        a thread of its own.
        """
        threads = encode_threads()
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deltasync-anchor-hash") as hashing:
            return self._write_anchor(version, expected, group, hashing, threads)

    def _write_anchor(
        self, version: int, expected: str | None, group: Any, hashing: ThreadPoolExecutor, threads: int
    ) -> tuple[ChainEntry, str]:
        layout = self.layout
        split = layout.parts > 1
        params = self.params
        shares: list[int] = [0]
        adding = threading.Lock()
        at_once = [1]  # files streamed at once: device hashers share the scratch bound
        # CPU chunks handed to the hash threads and not hashed yet, all parts together (a chunk
        # may be a copy: a frozen fp32 parameter's bf16, a strided piece).
        ahead = threading.BoundedSemaphore(2 * threads)

        def chunks(name: str) -> Callable[[], Iterator[torch.Tensor]]:
            owned = layout.slices[name]
            source = self.checkpoint.pieces[name].source
            live = self.live_layout.slices[source]

            def gen() -> Iterator[torch.Tensor]:
                if owned.end == owned.begin:
                    return
                # The snapshot, or for a parameter that is not trained its live value (its value
                # at every version), read in the checkpoint tensor's order.
                tracked = self.detector.is_tracked(source)
                flat = self.detector.snapshot_flat(source) if tracked else live.local(params[source])
                offset = owned.begin
                hasher = None if flat.device.type == "cpu" else DeviceHasher(flat.device, DEVICE_CHUNK // at_once[0])
                # From an accelerator, large pieces: each is one copy to the host.
                size = (1 << 20) if hasher is None else ANCHOR_DEVICE_CHUNK
                mine = 0
                pending: deque[Future[int]] = deque()
                for values in self.checkpoint.chunks(name, flat, live.begin, owned, size):
                    if hasher is None:  # hashed in the helper threads while the file takes the chunk
                        ahead.acquire()
                        job = hashing.submit(fingerprint_slice_share, name, values, offset)
                        job.add_done_callback(lambda _: ahead.release())
                        pending.append(job)
                    else:  # hashed where it lies; one read of the sum per tensor
                        hasher.add_slice(name, values, offset)
                    offset += values.numel()
                    yield values
                    while pending and pending[0].done():
                        mine += pending.popleft().result()
                mine += sum(f.result() for f in pending)
                if hasher is not None:
                    mine += hasher.value()
                with adding:
                    shares[0] += mine

            return gen

        sources = [
            AnchorSource(name, owned.shape, owned.begin if split else 0, owned.end if split else owned.numel, chunks(name))
            for name, owned in layout.slices.items()
            if split or layout.writer
        ]
        total = sum(self.numels.values())

        def files(fingerprint: str) -> list[AnchorFile]:
            return self.anchor_files(
                version, sources, fingerprint=fingerprint, total=total, extra_metadata=self.anchor_metadata,
                manifest=self.manifest,
            )  # fmt: skip

        planned = files(expected or "0" * 16)
        at_once[0] = min(len(planned), threads)
        if expected is None:  # hashed first, a file's tensors per thread as they will be written
            with ThreadPoolExecutor(at_once[0], thread_name_prefix="deltasync-anchor-part") as pool:
                for done in [pool.submit(_drain, f.sources) for f in planned]:
                    done.result()
            _, all_shares = layout.agree(f"hashing the anchor of version {version}", lambda: (None, shares[0]), group)
            expected, shares[0] = format_fingerprint(sum(all_shares)), 0
            planned = files(expected)
        entry, got = self.write_anchor_file(version, expected, planned, group, share=lambda: shares[0])
        if format_fingerprint(got) != expected:
            raise IntegrityError(
                f"the anchor of version {version} hashes to {format_fingerprint(got)}, the chain says {expected} (a "
                "parameter that is not trained changed, or the snapshot is not the published state)"
            )
        return entry, expected


def _drain(sources: Sequence[AnchorSource]) -> None:
    """Read every chunk of ``sources`` (hashing them on the way, nothing written)."""
    for source in sources:
        for _ in source.chunks():
            pass


def manifest_of(layout: ShardLayout) -> str:
    """The manifest digest of the bf16 checkpoint tensors of ``layout``."""
    return manifest_digest((name, owned.shape, torch.bfloat16) for name, owned in layout.slices.items())
