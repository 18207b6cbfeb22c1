"""The publisher's writer: delta and anchor files (or their parts), then history and pointer.

:class:`ChainWriter` owns what is committed: it reads the bucket's pointer and history when a
publisher starts, writes each version's data files (every writer rank its own part), and on
rank 0 commits the history, then the pointer, under one lock, so that the background anchor
thread and the delta thread never interleave their commits. :class:`ChainState` is what every
rank knows of the committed chain; :class:`LateWarnings` collects the problems that came after
a result.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import DeltaSyncError, IntegrityError, NotFoundError, WriterConflictError
from ..format import (
    HISTORY_PATH,
    MAX_HISTORY_BYTES,
    AnchorSource,
    ChainEntry,
    Change,
    PartEntry,
    Pointer,
    anchor_path,
    anchor_stream,
    check_int,
    delta_path,
    encode_delta,
    manifest_digest,
    parse_json,
    part_path,
    sha256_hex,
)
from ..format.fingerprint import DeviceHasher, fingerprint_slice_share, format_fingerprint
from ..stores import read_limited, write_stream
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


class ChainWriter:
    """Writes a chain's data files and commits its history and pointer.

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
        self.store = store
        self.detector = detector
        self.params = params
        self.checkpoint = checkpoint
        self.live_layout = live_layout
        self.layout = layout
        self.codec, self.level, self.keep_anchors = codec, level, keep_anchors
        self.numels = checkpoint.numels
        self.manifest = manifest_of(layout)
        """The bf16 state's manifest digest, committed in the pointer and every file."""
        self.anchor_metadata: dict[str, str] = {}
        """Extra ``x-`` metadata written into every anchor."""
        self.lock = threading.Lock()
        """Held by each commit (rank 0), and while the pointer is read for retention."""
        self.owner = ChainOwnership(store, lease_s=lease_s, take_over=take_over) if layout.rank == 0 else None
        """This writer's hold on the chain (rank 0)."""

        def start() -> tuple[None, tuple[Pointer | None, int]]:
            # Rank 0 alone reads and takes the chain, so that every rank starts from the same pointer.
            if self.owner is None:
                return None, (None, 0)
            return None, self.owner.claim(self.owner.read())

        found = layout.agree("reading the pointer", start)
        pointer: Pointer | None = found[1][0][0]
        self.next_version = found[1][0][1]
        """The version a new chain starts at: the one after the newest committed."""
        self.pointer = pointer if layout.rank == 0 else None
        """The pointer last committed (rank 0; None on other ranks and in an empty bucket)."""
        self.history = self._read_history(pointer) if layout.rank == 0 else {}

    def committed_pointer(self) -> Pointer | None:
        """:attr:`pointer`, read under the commit lock (from another thread than the commits)."""
        with self.lock:
            return self.pointer

    def owned_pointer(self) -> Pointer | None:
        """:attr:`pointer` if the bucket's pointer is still the one this writer committed (one
        read, under the commit lock); None if another writer took the chain (this one stops)."""
        with self.lock:
            if self.owner is None or not self.owner.still_ours("deleting files the pointer no longer names"):
                return None
            return self.pointer

    def release(self) -> None:
        """Let go of the chain (a publisher that closes; rank 0): the next writer takes it at once."""
        if self.owner is not None:
            with self.lock:
                self.owner.release(self.pointer)

    # ------------------------------------------------------------------ reading, at the start

    def _read_history(self, pointer: Pointer | None) -> dict[int, dict[str, object]]:
        where = f"{self.store.url}/{HISTORY_PATH}"
        try:
            data = read_limited(self.store, HISTORY_PATH, MAX_HISTORY_BYTES)
        except NotFoundError:
            return {}
        history: dict[int, dict[str, object]] = {}
        if len(data) > MAX_HISTORY_BYTES:
            logger.warning("%s: larger than %d bytes; starting a new history", where, MAX_HISTORY_BYTES)
            return history
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            # The history is informative only: a bad line is skipped, not worth a failure.
            try:
                record = parse_json(line, where=f"{where} line {number}", what="the record", max_bytes=1 << 16,
                                    max_depth=2, floats=True)  # fmt: skip
                if not isinstance(record, dict):
                    raise DeltaSyncError(f"{where} line {number}: not a JSON object")
                history[check_int(record.get("version"), where=f"{where} line {number}", field="version")] = record
            except DeltaSyncError as exc:
                logger.warning("skipping a corrupt history line: %s", exc)
        if pointer is not None:
            history = {v: r for v, r in history.items() if v <= pointer.version}
        return history

    # ------------------------------------------------------------------ deltas

    def write_delta(self, version: int, changes: dict[str, Change], fingerprint: str, chain: ChainState,
                    group: Any) -> ChainEntry:  # fmt: skip
        """Write this rank's part of the delta of ``version`` on top of ``chain`` (collective,
        over ``group``); return the version's entry."""
        layout = self.layout
        split = layout.parts > 1
        path = part_path("delta", version, layout.part) if split else delta_path(version)

        def write() -> tuple[None, PartEntry | None]:
            self._check_owner(f"writing delta {version}")
            if not layout.writer:
                return None, None
            data = encode_delta(
                changes,
                version=version,
                anchor=chain.root,
                codec=self.codec,
                total=chain.total,
                fingerprint=fingerprint,
                base_fingerprint=chain.fingerprint,
                level=self.level,
                numels=self.numels,
                part=(layout.part, layout.parts) if split else None,
                manifest=self.manifest,
            )
            self.store.write_bytes(path, data)
            changed = sum(c.index.numel() for c in changes.values())
            return None, PartEntry(path=path, nbytes=len(data), sha256=sha256_hex(data), changed=changed)

        _, written = layout.agree(f"writing delta {version}", write, group)
        return ChainEntry.of_files("delta", version, fingerprint, [w for w in written if w is not None], split)

    def commit_delta(self, entry: ChainEntry, total: int, group: Any) -> None:
        """Commit the delta ``entry`` as the newest version (collective; rank 0 writes)."""

        def commit() -> tuple[None, None]:
            if self.layout.rank == 0:
                with self.lock:
                    pointer = self.pointer
                    assert pointer is not None
                    new = replace(pointer, version=entry.version, fingerprint=entry.fingerprint, chain=(*pointer.chain, entry))
                    self._commit(new, entry.version, self.record("delta", entry, total))
            return None, None

        self.layout.agree(f"committing version {entry.version}", commit, group)

    # ------------------------------------------------------------------ anchors

    def commit_root(self, entry: ChainEntry, total: int, group: Any) -> None:
        """Commit the anchor ``entry`` as the first version of a new chain (collective)."""

        def commit() -> tuple[None, None]:
            if self.layout.rank == 0:
                with self.lock:
                    self._commit(Pointer.start(entry, total=total, manifest=self.manifest), entry.version, self.record("anchor", entry, total))
            return None, None

        self.layout.agree(f"committing version {entry.version}", commit, group)

    def commit_anchor(self, entry: ChainEntry, group: Any) -> None:
        """Commit the newly complete anchor ``entry`` of a committed version into the pointer,
        which then keeps the window :attr:`keep_anchors` says (collective)."""

        def commit() -> tuple[None, None]:
            if self.layout.rank == 0:
                with self.lock:
                    pointer = self.pointer
                    assert pointer is not None
                    self._commit(pointer.with_anchor(entry, self.keep_anchors), None, None)
            return None, None

        self.layout.agree(f"committing the anchor of version {entry.version}", commit, group)

    def write_anchor(self, version: int, expected: str | None, group: Any) -> tuple[ChainEntry, str]:
        """Stream this rank's part of the anchor of ``version`` from the snapshot (pinned by the
        caller) and the untracked parameters; return the version's entry and fingerprint.

        With ``expected`` (the chain's fingerprint of that version) the streamed values are
        hashed on the way and must add up to it; without, they are hashed first.
        """
        layout = self.layout
        split = layout.parts > 1
        params = self.params
        shares: list[int] = [0]

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
                hasher = None if flat.device.type == "cpu" else DeviceHasher(flat.device)
                # From an accelerator, large pieces: each is one copy to the host.
                size = (1 << 20) if hasher is None else ANCHOR_DEVICE_CHUNK
                for values in self.checkpoint.chunks(name, flat, live.begin, owned, size):
                    if hasher is None:
                        shares[0] += fingerprint_slice_share(name, values, offset)
                    else:  # hashed where it lies; one read of the sum per tensor
                        hasher.add_slice(name, values, offset)
                    offset += values.numel()
                    yield values
                if hasher is not None:
                    shares[0] += hasher.value()

            return gen

        sources = [
            AnchorSource(name, owned.shape, owned.begin if split else 0, owned.end if split else owned.numel, chunks(name))
            for name, owned in layout.slices.items()
            if split or layout.writer
        ]
        if expected is None:
            for source in sources:
                for _ in source.chunks():
                    pass
            _, all_shares = layout.agree(f"hashing the anchor of version {version}", lambda: (None, shares[0]), group)
            expected, shares[0] = format_fingerprint(sum(all_shares)), 0
        total = sum(self.numels.values())
        path = part_path("anchor", version, layout.part) if split else anchor_path(version)

        def write() -> tuple[None, tuple[PartEntry | None, int]]:
            self._check_owner(f"writing the anchor of version {version}")
            if not layout.writer:
                return None, (None, 0)
            stream = anchor_stream(
                sources, version=version, fingerprint=expected, total=total,
                part=layout.part if split else None, parts=layout.parts if split else None,
                extra_metadata=self.anchor_metadata, manifest=self.manifest,
            )
            nbytes, digest = write_stream(self.store, path, stream)
            changed = sum(s.end - s.begin for s in sources)
            return None, (PartEntry(path=path, nbytes=nbytes, sha256=digest, changed=changed), shares[0])

        _, written = layout.agree(f"writing the anchor of version {version}", write, group)
        got = format_fingerprint(sum(share for _, share in written))
        if got != expected:
            raise IntegrityError(
                f"the anchor of version {version} hashes to {got}, the chain says {expected} (a parameter "
                "that is not trained changed, or the snapshot is not the published state)"
            )
        files = [w for w, _ in written if w is not None]
        return ChainEntry.of_files("anchor", version, expected, files, split), expected

    # ------------------------------------------------------------------ commit (rank 0)

    def _check_owner(self, what: str) -> None:
        """On rank 0, before a version's data is written: raise :class:`WriterConflictError` if
        the bucket's pointer is no longer the one this writer committed (one read), so that a
        writer that lost the chain writes nothing more."""
        if self.owner is None:
            return
        with self.lock:  # not while a commit of the other thread changes the pointer
            if not self.owner.still_ours(what):
                raise WriterConflictError(self.owner.stopped)

    def _commit(self, pointer: Pointer, version: int | None, record: dict[str, object] | None) -> None:
        """History, then the pointer: the commit point (rank 0, under the commit lock). A
        failure leaves the history as it was. The pointer is written only if it is still the one
        this writer committed last (it was checked before the version's data was written)."""
        owner = self.owner
        assert owner is not None
        what = "committing " + (f"version {version}" if version is not None else f"the anchor of version {pointer.anchor}")
        owner.check()
        history = dict(self.history)
        if record is not None:
            assert version is not None
            me = owner.record
            history[version] = {**record, "writer": {"host": me.host, "pid": me.pid, "token": me.token}}
        for item in pointer.anchors:
            if item.version in history and "anchor_nbytes" not in history[item.version]:
                history[item.version] = {**history[item.version], "anchor_nbytes": item.nbytes}
        lines = [json.dumps(history[v], sort_keys=True) for v in sorted(history)]
        self.store.write_bytes(HISTORY_PATH, ("\n".join(lines) + "\n").encode())
        pointer = owner.commit(pointer, what=what)  # the commit point
        self.history, self.pointer = history, pointer

    @staticmethod
    def record(kind: str, entry: ChainEntry, total: int) -> dict[str, object]:
        """The history's record of a version at its commit (its ``seconds`` are set after)."""
        return {
            "version": entry.version, "kind": kind, "path": entry.path or entry.parts[0].path, "nbytes": entry.nbytes,
            "changed": entry.changed, "total": total, "fingerprint": entry.fingerprint, "seconds": 0.0,
            "time": time.time(),
        }

    def note_seconds(self, version: int, seconds: float) -> None:
        """Set the seconds from capture to commit of a committed version in the history (rank 0;
        written with the next commit)."""
        if self.layout.rank == 0 and version in self.history:
            self.history[version]["seconds"] = seconds


def manifest_of(layout: ShardLayout) -> str:
    """The manifest digest of the bf16 checkpoint tensors of ``layout``."""
    return manifest_digest((name, owned.shape, torch.bfloat16) for name, owned in layout.slices.items())
