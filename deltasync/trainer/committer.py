"""One chain's files and commits: the bf16 chain's and every quantized view's, through one code.

:class:`ChainCommitter` is the commit sequence of a chain:

1. every writing rank writes its data file of a version (a delta or an anchor, or its part of
   one, one part per shard rank), and the SHA-256 of what it wrote goes into its part entry;
2. the ranks agree on the outcome (:meth:`~deltasync.trainer.sharded.ShardLayout.agree`): a
   failure on one fails the version on every rank, and nothing is committed;
3. rank 0 commits, under one lock: the history (``history.jsonl``: a record of each version,
   naming the writer that committed it), then the pointer, written only if it is still the one
   this writer last wrote (:class:`~deltasync.trainer.ownership.PointerFile`);
4. after an anchor, retention deletes what the committed pointer no longer names
   (:class:`~deltasync.trainer.retention.Retention`, given :meth:`ChainCommitter.owned_pointer`).

What the files hold is its callers': the bf16 chain's writer (:mod:`.writer`) encodes the
detected changes and streams the snapshot; a view (:mod:`.view_chain`) quantizes and diffs its
codes. Each chain lives in its own folder: the bucket, or a view's ``views/<SCHEME>/``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import DeltaSyncError, NotFoundError, WriterConflictError
from ..format import (
    ANCHOR_PART_BYTES,
    HISTORY_PATH,
    MAX_HISTORY_BYTES,
    AnchorSource,
    ChainEntry,
    PartEntry,
    Pointer,
    anchor_parts,
    anchor_path,
    anchor_stream,
    check_int,
    delta_path,
    parse_json,
    part_path,
)
from ..format.codecs.zstd import encode_threads
from ..stores import read_limited, write_pieces, write_stream

if TYPE_CHECKING:
    from ..stores import Store
    from .ownership import PointerFile
    from .sharded import ShardLayout

__all__ = ["AnchorFile", "ChainCommitter", "History", "write_files"]

logger = logging.getLogger("deltasync.trainer.publisher")  # the publisher's parts log as the publisher

History = dict[int, dict[str, object]]
"""Version -> its history record."""


@dataclass(frozen=True)
class AnchorFile:
    """One file of an anchor as a writer streams it."""

    path: str
    stream: Callable[[], Iterable[bytes | memoryview]]
    changed: int
    """Elements it holds."""
    sources: Sequence[AnchorSource]
    """What it holds (:func:`~deltasync.format.anchor_stream`'s sources)."""


class _Stopped(Exception):
    """A part's write stopped because another part of the same anchor failed."""


def write_files(store: Store, files: Sequence[AnchorFile], what: str) -> list[PartEntry]:
    """Stream ``files`` into ``store`` (several at once, over at most one thread per core) and
    return their entries in order. If one fails, the others stop at their next chunk, the ones
    already written are deleted (no pointer names them; a part of a large anchor is hundreds of
    MiB, and a full disk is a likely reason for the failure) and the first failure is raised; a
    file is whole or absent (:func:`~deltasync.stores.write_stream`)."""
    if len(files) == 1:
        (only,) = files
        nbytes, digest = write_stream(store, only.path, only.stream())
        return [PartEntry(path=only.path, nbytes=nbytes, sha256=digest, changed=only.changed)]
    stop = threading.Event()

    def one(file: AnchorFile) -> PartEntry:
        def chunks() -> Iterator[bytes | memoryview]:
            for chunk in file.stream():
                if stop.is_set():
                    raise _Stopped(f"{what}: stopped, another part failed")
                yield chunk

        try:
            nbytes, digest = write_stream(store, file.path, chunks())
        except BaseException:
            stop.set()
            raise
        return PartEntry(path=file.path, nbytes=nbytes, sha256=digest, changed=file.changed)

    with ThreadPoolExecutor(min(len(files), encode_threads()), thread_name_prefix="deltasync-anchor-part") as pool:
        futures = [pool.submit(one, f) for f in files]
        wait(futures)
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        written = [file.path for file, f in zip(files, futures) if f.exception() is None]
        if written:
            try:
                store.delete(written)
            except Exception as exc:  # noqa: BLE001  (the write's failure is the one to raise)
                logger.warning("deltasync: %s failed; its parts written so far are left (%s): %s", what, ", ".join(written), exc)
        raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
    return [f.result() for f in futures]


class ChainCommitter:
    """Writes a chain's data files, and commits its history and pointer (rank 0).

    Args:
        store: the chain's folder (the bucket, or a view's folder).
        layout: the ranks that write the chain (a world of one: this process alone). Each
            writing rank writes part ``layout.part`` of every version when ``layout.parts > 1``,
            else the one writing rank writes the version's one file.
        owner: the chain's pointer as this writer commits it, on rank 0 (None on other ranks).
        label: what the ranks' agreement names first in a failure (``"view FP8_DYNAMIC: "``).
    """

    def __init__(self, store: Store, layout: ShardLayout, owner: PointerFile | None, *, label: str = "") -> None:
        self.store = store
        self.layout = layout
        self.owner = owner
        self.label = label
        self.split = layout.parts > 1
        """One part file per shard rank (FSDP2, HSDP), committed by rank 0."""
        self.part = (layout.part, layout.parts) if self.split else None
        """This rank's part and the parts of a version (None: one file a version)."""
        self.anchor_part_bytes = ANCHOR_PART_BYTES
        """A single writer splits an anchor larger than this into parts written at once."""
        self.lock = threading.Lock()
        """Held by each commit (rank 0), and while the pointer is read for a check or retention."""
        self.pointer: Pointer | None = None
        """The pointer last committed (rank 0; None on other ranks, and before the first commit)."""
        self.history: History = {}
        """The history as last committed (rank 0)."""

    def start(self, pointer: Pointer | None) -> None:
        """Go on from the chain of ``pointer``, as found (rank 0): its history is read back."""
        self.pointer = pointer
        self.history = self.read_history(pointer) if self.owner is not None else {}

    # ------------------------------------------------------------------ ranks

    def agree(self, what: str, step: Callable[[], tuple[Any, Any]], group: Any) -> tuple[Any, list[Any]]:
        """Run ``step`` (it returns ``(result, shared)``) on every rank, all failing if one does."""
        return self.layout.agree(self.label + what, step, group)

    def path(self, kind: str, version: int) -> str:
        """This rank's file of ``version`` (``kind``: "delta" or "anchor")."""
        if self.split:
            return part_path(kind, version, self.layout.part)
        return anchor_path(version) if kind == "anchor" else delta_path(version)

    def check_owner(self, what: str) -> None:
        """On rank 0, before a version's data is written: raise :class:`WriterConflictError` if
        the chain's pointer is no longer the one this writer committed (one read), so that a
        writer that lost the chain writes nothing more."""
        if self.owner is None:
            return
        with self.lock:  # not while a commit of another thread changes the pointer
            if not self.owner.still_ours(what):
                raise WriterConflictError(self.owner.stopped)

    # ------------------------------------------------------------------ data files (every rank)

    def write_delta_file(self, version: int, fingerprint: str, encode: Callable[[], tuple[Sequence[bytes | memoryview], int]],
                         group: Any, *, check: bool = True) -> ChainEntry:  # fmt: skip
        """Write the delta of ``version`` (collective over ``group``): each writing rank its file
        or part, whose pieces (:func:`~deltasync.format.delta_pieces`) and changed elements
        ``encode()`` gives (:func:`~deltasync.stores.write_pieces`: no copy of them into a local
        bucket, the SHA-256 taken beside the write); return the version's entry. ``check``:
        first check the pointer is still this writer's (:meth:`check_owner`)."""
        path = self.path("delta", version)
        what = f"writing delta {version}"

        def write() -> tuple[None, PartEntry | None]:
            if check:
                self.check_owner(what)
            if not self.layout.writer:
                return None, None
            pieces, changed = encode()
            nbytes, digest = write_pieces(self.store, path, pieces)
            return None, PartEntry(path=path, nbytes=nbytes, sha256=digest, changed=changed)

        _, written = self.agree(what, write, group)
        return ChainEntry.of_files("delta", version, fingerprint, [w for w in written if w is not None], self.split)

    def anchor_files(
        self, version: int, sources: Sequence[AnchorSource], *, fingerprint: str, total: int,
        extra_metadata: Mapping[str, str] | None = None, manifest: str | None = None,
    ) -> list[AnchorFile]:  # fmt: skip
        """This rank's files of the anchor of ``version`` holding ``sources``: its part (a shard
        rank), or the anchor's one file, or, from a single writer whose anchor is larger than
        :attr:`anchor_part_bytes`, the parts :func:`~deltasync.format.anchor_parts` lays out."""

        def file(path: str, listed: Sequence[AnchorSource], part: int | None, parts: int | None) -> AnchorFile:
            stream = lambda: anchor_stream(  # noqa: E731
                listed, version=version, fingerprint=fingerprint, total=total, part=part, parts=parts,
                extra_metadata=extra_metadata, manifest=manifest,
            )  # fmt: skip
            return AnchorFile(path, stream, sum(s.end - s.begin for s in listed), listed)

        if self.split:
            return [file(part_path("anchor", version, self.layout.part), sources, self.layout.part, self.layout.parts)]
        groups = anchor_parts(sources, self.anchor_part_bytes)
        if len(groups) == 1:
            return [file(anchor_path(version), sources, None, None)]
        return [file(part_path("anchor", version, n), listed, n, len(groups)) for n, listed in enumerate(groups)]

    def write_anchor_file(
        self, version: int, fingerprint: str, files: Sequence[AnchorFile], group: Any, *,
        share: Callable[[], int] = lambda: 0, check: bool = True,
    ) -> tuple[ChainEntry, int]:  # fmt: skip
        """Write the anchor of ``version`` (collective over ``group``): each writing rank streams
        its ``files`` (:meth:`anchor_files`; several at once where it has several); return the
        version's entry and the sum over the ranks of ``share()``, taken once a rank's files are
        written (the bf16 chain hashes its values on the way). ``check``: as
        :meth:`write_delta_file`'s."""
        what = f"writing the anchor of version {version}"

        def write() -> tuple[None, tuple[list[PartEntry], int]]:
            if check:
                self.check_owner(what)
            if not self.layout.writer:
                return None, ([], 0)
            return None, (write_files(self.store, files, what), share())

        _, written = self.agree(what, write, group)
        entries = [w for ws, _ in written for w in ws]
        entry = ChainEntry.of_files("anchor", version, fingerprint, entries, self.split or len(entries) > 1)
        return entry, sum(s for _, s in written)

    # ------------------------------------------------------------------ commits (rank 0 writes)

    def commit(self, what: str, pointer: Callable[[Pointer | None], Pointer], record: dict[str, object] | None,
               group: Any) -> None:  # fmt: skip
        """Commit (collective over ``group``; rank 0 writes, once every rank wrote): the pointer
        ``pointer(committed)`` gives from the one last committed, and ``record`` (:meth:`record`;
        None for an anchor beside a committed version) into the history. ``what``: "version N",
        or "the anchor of version N"."""

        def step() -> tuple[None, None]:
            if self.owner is not None:
                with self.lock:
                    self._commit(what, pointer(self.pointer), record)
            return None, None

        self.agree(f"committing {what}", step, group)

    def _commit(self, what: str, pointer: Pointer, record: dict[str, object] | None) -> None:
        """History, then the pointer: the commit point (rank 0, under the commit lock). A
        failure leaves :attr:`history` and :attr:`pointer` as they were. The pointer is written
        only if it is still the one this writer committed last (the first commit of a chain
        not read at the start: the one found then)."""
        owner = self.owner
        assert owner is not None
        owner.check()
        if not owner.known:  # a view's first commit: the pointer found now, and its history
            self.history = self.read_history(owner.found())
        history = dict(self.history)
        if record is not None:
            writer = owner.writer
            named = {} if writer is None else {"writer": {"host": writer.host, "pid": writer.pid, "token": writer.token}}
            version = record["version"]
            assert isinstance(version, int)
            history[version] = {**record, **named}
        for item in pointer.anchors:
            if item.version in history and "anchor_nbytes" not in history[item.version]:
                history[item.version] = {**history[item.version], "anchor_nbytes": item.nbytes}
        lines = [json.dumps(history[v], sort_keys=True) for v in sorted(history)]
        self.store.write_bytes(HISTORY_PATH, ("\n".join(lines) + "\n").encode())
        committed = owner.commit(pointer, what=f"committing {what}")  # the commit point
        self.history, self.pointer = history, committed

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
        if self.owner is not None and version in self.history:
            self.history[version]["seconds"] = seconds

    # ------------------------------------------------------------------ the committed pointer

    def committed_pointer(self) -> Pointer | None:
        """:attr:`pointer`, read under the commit lock (from another thread than the commits)."""
        with self.lock:
            return self.pointer

    def owned_pointer(self) -> Pointer | None:
        """:attr:`pointer` if the chain's pointer is still the one this writer committed (one
        read, under the commit lock); None if another writer took the chain (this one stops)."""
        with self.lock:
            if self.owner is None or not self.owner.still_ours("deleting files the pointer no longer names"):
                return None
            return self.pointer

    # ------------------------------------------------------------------ the history, at the start

    def read_history(self, pointer: Pointer | None) -> History:
        """The chain's history as found, up to the version of ``pointer`` (all of it for None).
        Informative only: a bad line is skipped, and a history too large is started anew."""
        where = f"{self.store.url}/{HISTORY_PATH}"
        try:
            data = read_limited(self.store, HISTORY_PATH, MAX_HISTORY_BYTES)
        except NotFoundError:
            return {}
        history: History = {}
        if len(data) > MAX_HISTORY_BYTES:
            logger.warning("%s: larger than %d bytes; starting a new history", where, MAX_HISTORY_BYTES)
            return history
        for number, line in enumerate(data.decode(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
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
