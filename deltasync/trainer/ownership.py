"""One writer per bucket: a publisher's hold on its chain's pointer.

A publisher that starts reads the pointer and its ``writer`` record. It takes the chain only if
no other writer holds it: none is named, or the one named let go (closed), or is a process of
this host that no longer runs, or its lease ended (``lease_ms`` after its last commit); or when
told to (``take_over=True``). Taking it is a conditional rewrite of the pointer naming this
writer, before a byte of data is written; after that every commit is conditional on the
pointer being the one this writer last wrote (:func:`deltasync.stores.write_if`). A conditional
write that fails stops the writer for good: it then writes and deletes nothing more.

A writer that took the chain from one that may still be running starts two versions after
the committed one: the old writer may still be writing the files of the version after it
(which then never share a name with the new writer's), and its commit of them fails.

A bucket with no pointer has no writer record to hold it yet. A publisher that finds none first
creates the claim file ``writer.json`` (create-if-absent), naming itself with a lease, and only
then writes the first version; it deletes the claim once its first pointer is committed (the
pointer then names it). A second publisher that starts on the same empty bucket meanwhile finds
the claim and is refused as it would be by a pointer, before it writes a byte; a claim whose
writer is gone (let go, its process ended, its lease over, or ``take_over=True``) is taken the
same way a pointer is, and a writer that may still run is left version 0 (the new chain starts
at 1).

:class:`PointerFile` is a chain's pointer under those conditional writes
(:class:`~deltasync.stores.TaggedFile`); the bf16 chain's :class:`ChainOwnership` adds the
writer record, the lease and taking over, and a quantized view's chain commits through a
plain one, whose first commit is conditional on the pointer it finds then.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import secrets
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import DeltaSyncError, NotFoundError, WriterConflictError
from ..format import CLAIM_PATH, MAX_POINTER_BYTES, POINTER_PATH, Pointer, WriterRecord, parse_json
from ..stores import TaggedFile, conditional_guarantee, read_tagged

if TYPE_CHECKING:
    from ..stores import Store

__all__ = ["ChainOwnership", "PointerFile", "now_ms"]

logger = logging.getLogger("deltasync.trainer.publisher")  # the publisher's parts log as the publisher


MAX_CLAIM_BYTES = 4096
"""The most bytes read of a claim file (one writer record)."""


def now_ms() -> int:
    return int(time.time() * 1000)


def _utc(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


_LIVE: weakref.WeakValueDictionary[str, ChainOwnership] = weakref.WeakValueDictionary()
"""The writers of this process, by token, while their publisher can be reached."""


def _gone_from_this_process(token: str) -> bool:
    """Whether this process's writer ``token`` is gone: its publisher was closed or can no
    longer be reached (collected), so it can never commit again."""
    if token not in _LIVE:
        return True
    gc.collect()  # an unreachable publisher in a reference cycle
    return token not in _LIVE


def _process_gone(pid: int) -> bool:
    """Whether no process ``pid`` runs on this host (one we may not signal still runs)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class PointerFile:
    """A chain's pointer as one writer commits it: each commit is written only if the pointer is
    still the one this writer last read or wrote (the first commit without a :meth:`read`: the
    one found then).

    Args:
        store: the chain's folder (the bucket, or a view's folder).
        changed: why the writer stops when the pointer changed under it, from what it was doing
            and the refused write's error (None: a check found the change).
        writer: the writer whose commits these are; the history names it at each version.
    """

    def __init__(self, store: Store, changed: Callable[[str, Exception | None], str], writer: WriterRecord | None) -> None:
        self.store = store
        self.writer = writer
        self.file = TaggedFile(store, POINTER_PATH, limit=MAX_POINTER_BYTES, changed=changed)

    @property
    def where(self) -> str:
        return self.file.where

    @property
    def stopped(self) -> str | None:
        """Why this writer stopped (the pointer changed under it), or None."""
        return self.file.stopped

    def read(self) -> Pointer | None:
        """The chain's pointer (None where there is none); the next commit is conditional on it."""
        data = self.file.read()
        return None if data is None else Pointer.from_bytes(data, where=self.where)

    def found(self) -> Pointer | None:
        """:meth:`read`, but None for a pointer that cannot be read too (a new chain replaces it)."""
        try:
            return self.read()
        except DeltaSyncError as exc:
            logger.warning("deltasync: %s: the pointer found cannot be read, a new chain replaces it: %s", self.where, exc)
            return None

    @property
    def known(self) -> bool:
        """The pointer was read or written: commits are conditional on its tag."""
        return self.file.known

    def check(self) -> None:
        """Raise why this writer stopped, if it did."""
        self.file.check()

    def commit(self, pointer: Pointer, *, what: str) -> Pointer:
        """Write ``pointer`` only if the chain's pointer is still the one this writer last read or
        wrote; return it as written. On a conflict this writer stops (:class:`WriterConflictError`)."""
        if not self.file.known:
            self.file.read()
        self.file.write(pointer.to_bytes(), what=what)
        return pointer

    def still_ours(self, what: str) -> bool:
        """Whether the chain's pointer is still the one this writer last read or wrote (one read;
        before either, it has nothing to compare); if not, this writer stops."""
        if not self.file.known:
            return self.file.stopped is None
        return self.file.still_ours(what)


class ChainOwnership(PointerFile):
    """This publisher's writer record, and the tag of the pointer it last read or wrote.

    Args:
        store: the bucket.
        lease_s: how long after each commit this writer holds the chain (``PublishOptions.lease_seconds``).
        take_over: take the chain even from a writer that holds it (one known to be dead).
    """

    def __init__(self, store: Store, *, lease_s: float, take_over: bool) -> None:
        self.take_over = take_over
        self.record = WriterRecord(
            host=(socket.gethostname() or "unknown")[:255], pid=os.getpid(), started_ms=now_ms(),
            token=secrets.token_hex(16), committed_ms=now_ms(), lease_ms=int(lease_s * 1000),
        )  # fmt: skip
        """This writer (``committed_ms`` is set at each commit)."""
        super().__init__(store, self._changed_under, self.record)
        _LIVE[self.record.token] = self
        self._claim: TaggedFile | None = None
        """This writer's claim of a bucket that had no pointer, until its first commit."""
        self.guarantee = conditional_guarantee(store)
        if self.guarantee is None:
            logger.warning(
                "deltasync: bucket %s cannot write conditionally; one writer per bucket is checked by reading "
                "the pointer before each commit, and a writer that commits between that read and the write "
                "goes unseen (the last writer wins)", store.url,
            )  # fmt: skip

    # ------------------------------------------------------------------ start

    def claim(self, pointer: Pointer | None) -> tuple[Pointer | None, int]:
        """Take the chain of ``pointer`` (just :meth:`read`) for this writer, or raise
        :class:`WriterConflictError` having written nothing; return the pointer as rewritten
        (naming this writer) and the version this writer starts at."""
        if pointer is None:
            return self._claim_empty()
        held = pointer.writer
        skip = 0
        if held is not None and held.token != self.record.token:
            last = f"its last commit: version {pointer.version} at {_utc(held.committed_ms)}"
            why = self._may_still_run(held, last)
            if why is not None:
                skip = 1  # it may still be writing the files of the version after its last
                logger.warning("deltasync: taking bucket %s over from %s (%s; %s); starting at version %d",
                               self.store.url, held.describe(), why, last, pointer.version + 2)  # fmt: skip
        claimed = self.commit(pointer, what="taking the chain")
        return claimed, pointer.version + 1 + skip

    def _may_still_run(self, held: WriterRecord, last: str) -> str | None:
        """Why the writer ``held`` (``last``: what it last did, for the error) may still run once
        this one takes the chain from it (None: it cannot); :class:`WriterConflictError` if it
        holds the chain and this writer is not told to take it over."""
        free = self._free(held)
        if free is None and not self.take_over:
            raise WriterConflictError(
                f"bucket {self.store.url} is held by another writer ({held.describe()}; {last}; held until "
                f"{_utc(held.expires_ms)} unless it commits again). This publisher wrote nothing. One bucket takes "
                "one writer: if that writer is dead, pass take_over=True (or wait for its lease to end); if it "
                "runs, publish into another bucket"
            )
        if free is None:
            return "take_over=True"
        return free if free == "its lease ended" else None

    # ------------------------------------------------------------------ a new chain's claim

    def _claim_empty(self) -> tuple[Pointer | None, int]:
        """Claim a bucket that has no pointer (see the module's docstring): create the claim
        file naming this writer, or take a claim whose writer is gone; then read the pointer
        once more, in case a writer committed since (its claim is gone once its pointer is
        written): that chain is then taken, or refused, as any other."""
        claim = TaggedFile(self.store, CLAIM_PATH, limit=MAX_CLAIM_BYTES, changed=self._claim_changed)
        data = claim.read()
        start = 0
        held = None if data is None else self._claimant(data)
        if held is not None and held.token != self.record.token:
            claimed = f"it claimed the empty bucket at {_utc(held.committed_ms)} and has committed nothing yet"
            why = self._may_still_run(held, claimed)
            if why is not None:
                start = 1  # it may still be writing the files of version 0
                logger.warning("deltasync: taking the claim of empty bucket %s from %s (%s; %s); starting at version 1",
                               self.store.url, held.describe(), why, claimed)  # fmt: skip
        claim.write(json.dumps({"writer": self.record.to_json()}, sort_keys=True).encode(), what="claiming the empty bucket")
        self._claim = claim
        pointer = self.read()
        if pointer is not None:  # a writer committed between the first read and the claim
            self._drop_claim()
            return self.claim(pointer)
        return None, start

    def _claimant(self, data: bytes) -> WriterRecord | None:
        """The writer a claim file names (None: one that cannot be read, which is taken)."""
        where = f"{self.store.url}/{CLAIM_PATH}"
        try:
            item = parse_json(data, where=where, what="the claim", max_bytes=MAX_CLAIM_BYTES, max_depth=2)
            if not isinstance(item, dict):
                raise DeltaSyncError(f"{where}: not a JSON object")
            return WriterRecord.from_json(item.get("writer"), where)
        except DeltaSyncError as exc:
            logger.warning("deltasync: %s cannot be read, this writer replaces it: %s", where, exc)
            return None

    def _claim_changed(self, what: str, exc: Exception | None) -> str:
        """Why this writer stops when the claim file changed under it: who claimed it."""
        try:
            held = self._claimant(read_tagged(self.store, CLAIM_PATH, MAX_CLAIM_BYTES)[0])
            who = "a writer whose claim cannot be read" if held is None else held.describe()
        except NotFoundError:
            who = "a writer that has committed since (its claim is gone)"
        except Exception as read_error:  # noqa: BLE001  (the reason is what matters here)
            who = f"a writer whose claim cannot be read now ({read_error})"
        return (
            f"bucket {self.store.url} has no pointer, and another writer claimed it while this one was {what}: "
            f"{who}. This publisher wrote nothing. One bucket takes one writer"
            + (f" [{exc}]" if exc is not None else "")
        )

    def _drop_claim(self) -> None:
        """Delete this writer's claim file, if it is still this writer's (best effort: a claim
        left behind names a writer that committed, and the next one takes it)."""
        claim, self._claim = self._claim, None
        if claim is None:
            return
        try:
            if claim.still_ours("deleting its claim"):
                self.store.delete([CLAIM_PATH])
        except Exception as exc:  # noqa: BLE001  (the chain is committed; the claim is informative now)
            logger.warning("deltasync: could not delete the claim %s/%s: %s", self.store.url, CLAIM_PATH, exc)

    def _free(self, held: WriterRecord) -> str | None:
        """Why the chain ``held`` names is free to take, or None if that writer holds it."""
        if held.lease_ms == 0:
            return "it let go"
        if held.host == self.record.host:
            if held.pid == self.record.pid and _gone_from_this_process(held.token):
                return "its publisher in this process is gone"
            if held.pid != self.record.pid and _process_gone(held.pid):
                return "its process is gone"
        if now_ms() >= held.expires_ms:
            return "its lease ended"
        return None

    # ------------------------------------------------------------------ commits

    def commit(self, pointer: Pointer, *, what: str, lease_ms: int | None = None) -> Pointer:
        """Write ``pointer``, naming this writer, only if the bucket's pointer is still the one this
        writer last read or wrote; return it as written. On a conflict this writer stops, and
        :class:`WriterConflictError` says who holds the chain now."""
        self.check()
        record = replace(self.record, committed_ms=now_ms(), lease_ms=self.record.lease_ms if lease_ms is None else lease_ms)
        committed = super().commit(replace(pointer, writer=record), what=what)
        if self._claim is not None:
            self._drop_claim()  # the pointer names this writer now
        return committed

    def still_ours(self, what: str) -> bool:
        """Whether the bucket's pointer is still the one this writer last wrote (one read);
        if not, this writer stops."""
        if self.stopped is not None:
            return False
        if not super().still_ours(what):
            logger.error("deltasync: %s", self.stopped)
            return False
        return True

    def _changed_under(self, what: str, exc: Exception | None) -> str:
        """The reason this writer stops: the pointer changed under it, and who wrote it now."""
        try:
            now = Pointer.from_bytes(read_tagged(self.store, POINTER_PATH, MAX_POINTER_BYTES)[0], where=self.where)
            held = now.writer
            who = (f"it now names version {now.version}, committed at {_utc(held.committed_ms)} by {held.describe()}"
                   if held is not None else f"it now names version {now.version}, by a writer that names none")  # fmt: skip
        except NotFoundError:
            who = "it was deleted"
        except Exception as read_error:  # noqa: BLE001  (the reason is what matters here)
            who = f"it cannot be read now ({read_error})"
        return (
            f"the pointer {self.where} changed under this writer ({self.record.describe()}) while {what}: {who}. "
            "Another writer took the chain; this publisher stops and writes nothing more "
            f"(its own files of versions the pointer does not name are left for that writer's retention)"
            + (f" [{exc}]" if exc is not None else "")
        )

    def release(self, pointer: Pointer | None) -> None:
        """Let go of the chain (a writer that closes): rewrite the pointer with a lease of 0, so
        that the next writer takes it at once. Never raises: a failure is logged."""
        _LIVE.pop(self.record.token, None)
        if pointer is None:
            self._drop_claim()  # closed before its first commit
            return
        if self.stopped is not None:
            return
        try:
            self.commit(pointer, what="letting go of the chain", lease_ms=0)
        except Exception as exc:  # noqa: BLE001  (closing never fails on it)
            logger.warning("deltasync: could not let go of bucket %s: %s", self.store.url, exc)
