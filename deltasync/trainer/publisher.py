"""The trainer side: publish anchors and deltas into a bucket, then commit the pointer.

:class:`DeltaPublisher` is the facade the trainer holds; it runs one version at a time
through its parts, each a module of its own:

- :mod:`.capture`: the version's changes, copied out of the live weights;
- :mod:`.writer`: delta and anchor files, then history and pointer (the commit);
- :mod:`.anchors`: when an anchor is due, and the background thread that writes it;
- :mod:`.retention`: deleting what the pointer no longer needs, and stale temporary files;
- :mod:`.view_publishing`: the quantized views beside the bf16 chain.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError, PublishError
from ..format import ANCHOR_PART_BYTES, CODECS, MAX_ANCHORS, ChainEntry, get_codec
from ..stores import open_store
from .anchors import AnchorScheduler
from .capture import CAPTURE_MODES, Capture, CaptureMode, ChangeCapture
from .checkpoint_layout import CheckpointLayout, checkpoint_layout
from .detector import BF16ChangeDetector
from .memory import release_free_memory
from .retention import Retention
from .sharded import ShardLayout, solo_layout
from .sources import WeightSource, weight_source
from .view_publishing import ViewPublisher
from .writer import ChainState, ChainWriter, LateWarnings

if TYPE_CHECKING:
    import os

    from ..format import Pointer
    from ..stores import Store
    from .view_chain import ViewChain

__all__ = ["PublishOptions", "PublishResult", "PublishFuture", "DeltaPublisher"]

_DEFAULT_CODEC = "zstd"
_DEFAULT_LEVEL = get_codec(_DEFAULT_CODEC).default_level or 0


@dataclass(frozen=True, kw_only=True)
class PublishOptions:
    """How a :class:`DeltaPublisher` writes versions."""

    anchor_every: int = 10
    """Write a full anchor, beside that version's delta, at least every this many versions
    (1 = beside every version). Anchors are written in the background and only serve readers
    that join late or lost their state; followers read deltas only."""
    anchor_bytes_ratio: float = 0.5
    """Also write an anchor when the deltas since the last anchor add up to more than this
    fraction of an anchor's size: a late joiner then never downloads more than about
    (1 + ratio) anchors' worth. 0 disables the rule."""
    codec: str = _DEFAULT_CODEC
    """Delta codec, a name in :data:`deltasync.format.CODECS`: "zstd" (compact, the default)
    or "raw" (readable with safe_open alone)."""
    zstd_level: int = _DEFAULT_LEVEL
    """Compression level, for a codec that takes one (the "zstd" codec: 1..22): higher is
    smaller and slower to encode."""
    anchor_part_bytes: int = ANCHOR_PART_BYTES
    """A single writer writes an anchor larger than this as parts of about this size, several
    at once (one thread per core at most), each holding whole tensors: the SHA-256s, copies to
    the host and writes of a large anchor then use several cores. The split depends on the
    tensors' names and sizes alone (a bucket written from a GPU is the one written from a CPU);
    every reader reads split anchors (docs/protocol.md section 18). Sharded trainers write a part
    per shard rank whatever this is."""
    keep_anchors: int = 1
    """Complete anchors to keep in the bucket. The deltas are kept one anchor further back, so
    that a follower up to an anchor interval behind still catches up with deltas alone; older
    files are deleted after a new anchor commits."""
    snapshot_device: str | None = "auto"
    """Where the detector keeps the last published bf16 state: "auto" (each weight's own
    accelerator while ``snapshot_budget`` holds it, else the host; weights on the CPU keep it
    on the CPU), "cpu", None for each weight's own device, or a device name."""
    snapshot_budget: int | None = None
    """The most bytes of accelerator memory the snapshot may take on each device (None: half
    the memory free there when the publisher starts). A snapshot placed on a device by
    ``snapshot_device`` that does not fit is a ConfigError; "auto" puts it on the host."""
    capture: CaptureMode = "submit"
    """When a version's changes are found: "submit" (in :meth:`DeltaPublisher.submit`, which
    returns once they are copied out) or "overlap" (in the background thread, while the
    trainer computes its next gradients; the optimizer's next step waits until the capture is
    done, so the version is still exactly the weights at ``submit()``). "overlap" needs the
    optimizer, and nothing but the optimizer may change the weights between ``submit()`` and
    the next step (a weight tie set by hand, a ``load_state_dict``)."""
    views: tuple[str, ...] = ()
    """Quantized views to publish beside the bf16 chain, by compressed-tensors preset scheme
    name (``("FP8_DYNAMIC",)``; :data:`deltasync.views.SCHEMES` lists them). Each is an exact
    chain of its own in ``views/<NAME>/``, which quantized rollout servers follow (see
    :mod:`deltasync.trainer.view_chain`); the bf16 chain is unchanged."""
    view_ignore: tuple[str, ...] = ("lm_head",)
    """Layers the views leave in bf16, as llm-compressor's ``ignore`` takes them (module names,
    or ``re:`` patterns)."""
    stale_temp_seconds: float = 3600.0
    """Temporary files of writes (local buckets) older than this are deleted when the publisher
    starts and after each anchor: a writer killed mid-write leaves one behind."""

    lease_seconds: float = 600.0
    """How long after each commit this publisher holds the bucket: another publisher that starts
    on it meanwhile is refused (naming this one), unless this one closed, its process is gone
    (same host), or it is told ``take_over=True``. After the lease another may take the chain
    without asking; this publisher's next commit then fails and it stops. Set it above the time
    between two versions."""

    def __post_init__(self) -> None:
        if self.anchor_every < 1:
            raise ConfigError(f"anchor_every must be >= 1, got {self.anchor_every}")
        if self.anchor_part_bytes < 1:
            raise ConfigError(f"anchor_part_bytes must be >= 1, got {self.anchor_part_bytes}")
        if self.anchor_bytes_ratio < 0:
            raise ConfigError(f"anchor_bytes_ratio must be >= 0 (0 disables it), got {self.anchor_bytes_ratio}")
        if self.codec not in CODECS:
            raise ConfigError(f"codec {self.codec!r} is unknown; choose one of {', '.join(CODECS)}")
        levels = get_codec(self.codec).levels
        if levels is None and self.zstd_level != _DEFAULT_LEVEL:
            raise ConfigError(f"zstd_level={self.zstd_level} is set but codec is {self.codec!r}; drop one of them")
        if levels is not None and self.zstd_level not in levels:
            raise ConfigError(f"zstd_level must be in {levels[0]}..{levels[-1]}, got {self.zstd_level}")
        if not 1 <= self.keep_anchors <= MAX_ANCHORS:
            raise ConfigError(f"keep_anchors must be in 1..{MAX_ANCHORS} (the newest anchor is always kept), got {self.keep_anchors}")
        if self.capture not in CAPTURE_MODES:
            raise ConfigError(f"capture must be one of {', '.join(map(repr, CAPTURE_MODES))}, got {self.capture!r}")
        if isinstance(self.views, str) or isinstance(self.view_ignore, str):
            raise ConfigError("views and view_ignore are tuples of names, e.g. views=('FP8_DYNAMIC',)")
        if len(set(self.views)) != len(self.views):
            raise ConfigError(f"views lists a scheme twice: {self.views}")
        if self.views:
            from ..views import get_scheme  # compressed-tensors is needed only for views

            for name in self.views:
                get_scheme(name)
        if not self.lease_seconds > 0:
            raise ConfigError(f"lease_seconds must be > 0, got {self.lease_seconds}")
        if not self.stale_temp_seconds > 0:
            raise ConfigError(f"stale_temp_seconds must be > 0, got {self.stale_temp_seconds}")


@dataclass(frozen=True, kw_only=True)
class PublishResult:
    """What one published version committed."""

    version: int
    kind: str
    """"delta", or "anchor" for a version without a delta (the first a publisher writes)."""
    path: str
    """The data file in the bucket (the first part of a split version)."""
    nbytes: int
    """Bytes written for this version's delta (or anchor, for kind "anchor")."""
    changed: int
    """Elements that changed since the previous version (an anchor counts every element)."""
    total: int
    """Elements in the full state."""
    fingerprint: str
    """Fingerprint of the full bf16 state at this version."""
    seconds: float
    """Wall time from the capture to the commit."""
    blocked_s: float = 0.0
    """Seconds the trainer was held for this version: in :meth:`DeltaPublisher.submit`,
    waiting for the version before it and capturing this one; with ``capture="overlap"``,
    the seconds its next optimizer step waited for the capture instead."""
    anchor_scheduled: bool = False
    """An anchor of this version is being written beside its delta, in the background."""
    warnings: tuple[str, ...] = ()
    """Problems that did not undo the commit (a failed retention delete, a failed background
    anchor, a view that could not be written); also logged."""
    view_nbytes: dict[str, int] = field(default_factory=dict)
    """Quantized view -> bytes written into it for this version (its delta, plus its anchor
    when one was written); a view that failed this version is absent."""

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0


class PublishFuture(Future):  # type: ignore[type-arg]
    """A :class:`concurrent.futures.Future` of a :class:`PublishResult` that remembers whether
    anyone looked at its outcome: a failure nobody saw is raised by the next publish."""

    observed = False

    def result(self, timeout: float | None = None) -> PublishResult:
        self.observed = True
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.observed = True
        return super().exception(timeout)


class DeltaPublisher:
    """Publishes a model's bf16 weights into a bucket as sparse deltas, with full anchors beside them.

    :meth:`submit` captures the next version (the changed indices and values are copied out,
    so the caller may step the optimizer again) and returns a :class:`PublishFuture`; encoding,
    writing and the commit run in a background thread, one version at a time. Every version
    after the first has a delta. An anchor of a version (the full state) is written in addition
    when the schedule says so (:class:`PublishOptions`), by a second background thread that
    streams it from the detector's snapshot while later deltas go on committing; the pointer
    names it once it is complete. Followers read deltas only; anchors serve late joiners.

    Versions hold the weights as ``save_pretrained`` writes them: for a transformers model whose
    layout in memory differs from its checkpoint (MoE experts fused in memory, per expert on
    disk), names, shapes and element order are the checkpoint's (see
    :mod:`deltasync.trainer.checkpoint_layout`), while changes are detected on the live parameters.

    The first version a publisher writes has an anchor and no delta: version 0 in an empty
    bucket, or the version after the newest committed one in a bucket that already holds
    versions (a restarted trainer never rewrites what servers may have applied). Data files
    are written first and the pointer last: a reader sees a version only once it is complete.
    A version that fails leaves the version counter and the detector as they were, so the next
    one carries its changes.

    Args:
        bucket: a path, URL (``file://``, ``hf://buckets/ns/name``, ``s3://``, ``memory://``)
            or a :class:`~deltasync.stores.Store`.
        model: the model being trained, or a weight source (:mod:`deltasync.trainer.sources`; the LoRA
            publishers of :mod:`deltasync.trainer.lora` pass one).
        optimizer: its optimizer (a hook records which parameters each step touched).
        options: how versions are written (:class:`PublishOptions`; default: its defaults).
        take_over: take the bucket's chain even if another publisher holds it (one you know is
            dead: a job killed on another host). Without it such a bucket is refused with
            :class:`~deltasync.WriterConflictError`, naming that publisher, before a byte is written.
            The chain goes on two versions after its committed one; the old publisher, if it
            still runs, fails its next commit and stops.
        **overrides: single fields of :class:`PublishOptions` (``anchor_every=5``), applied on
            top of ``options``.
    """

    def __init__(
        self,
        bucket: str | os.PathLike[str] | Store,
        model: torch.nn.Module | WeightSource,
        optimizer: object | None = None,
        *,
        options: PublishOptions | None = None,
        detector: BF16ChangeDetector | None = None,
        take_over: bool = False,
        **overrides: Any,
    ) -> None:
        self.options = options = _publish_options(options, overrides)
        self.store = open_store(bucket)
        self.model = model
        source = weight_source(model)
        self.detector = detector or BF16ChangeDetector(
            source, optimizer, snapshot_device=options.snapshot_device, snapshot_budget=options.snapshot_budget
        )
        problem = self.detector.overlap_problem if options.capture == "overlap" else None
        if problem is not None:
            raise ConfigError(f"capture='overlap' is not possible here: {problem}; use capture='submit'")
        named = [(w.name, w.value) for w in source.weights()]
        params = dict(named)
        # Versions are named and shaped as save_pretrained writes the model; detection stays on
        # the live parameters, whose changes are mapped to checkpoint tensors at capture.
        checkpoint = checkpoint_layout(source.checkpoint_model, named)
        live_layout: ShardLayout = self.detector.layout or solo_layout(named)
        self._layout = layout = checkpoint.owned(live_layout)
        self._numels = checkpoint.numels
        self._writer = ChainWriter(
            self.store, self.detector, params, checkpoint, live_layout, layout,
            codec=options.codec, level=options.zstd_level, keep_anchors=options.keep_anchors,
            lease_s=options.lease_seconds, take_over=take_over,
        )  # fmt: skip
        try:
            self._build(options, source, params, checkpoint, live_layout, layout)
        except BaseException:
            self._writer.release()  # refused (a view it cannot write, ...): it lets go of the chain it took
            raise

    def _build(self, options: PublishOptions, source: WeightSource, params: dict[str, torch.Tensor],
               checkpoint: CheckpointLayout, live_layout: ShardLayout, layout: ShardLayout) -> None:  # fmt: skip
        """The parts of a publisher that come after its hold on the chain."""
        self._chain: ChainState | None = None
        self._next = self._writer.next_version
        self._capture = ChangeCapture(self.detector, checkpoint, layout, options.capture)
        self._warnings = LateWarnings(self._writer.lock)
        self._retention = Retention(self.store, self._writer.owned_pointer, options.stale_temp_seconds)
        # Background threads coordinate ranks over groups of their own, never the training one.
        self._delta_group = layout.new_group()
        self._anchors = AnchorScheduler(
            layout, self.detector, self._writer, self._retention, self._warnings,
            anchor_every=options.anchor_every, anchor_bytes_ratio=options.anchor_bytes_ratio,
        )  # fmt: skip
        self._jobs = ThreadPoolExecutor(1, thread_name_prefix="deltasync-publish")
        self._inflight: PublishFuture | None = None
        self._closed = False
        level = options.zstd_level if get_codec(options.codec).levels else None
        self._views: list[ViewChain] = ViewPublisher.build(
            self.store, options.views, options.view_ignore, source.checkpoint_model, layout, codec=options.codec,
            level=level, keep_anchors=options.keep_anchors, group=self._delta_group,
            writer=None if self._writer.owner is None else self._writer.owner.record,
        )  # fmt: skip
        for committer in (self._writer, *(view.chain for view in self._views)):
            committer.anchor_part_bytes = options.anchor_part_bytes
        self._view_publisher = ViewPublisher(self._views, self.detector, params, checkpoint, live_layout, layout, self._warnings)
        if layout.rank == 0:
            self._retention.clean_temp()

    @property
    def anchor_metadata(self) -> dict[str, str]:
        """Extra ``x-`` metadata written into every anchor (an adapter bucket's PEFT config)."""
        return self._writer.anchor_metadata

    @anchor_metadata.setter
    def anchor_metadata(self, metadata: dict[str, str]) -> None:
        self._writer.anchor_metadata = metadata

    @property
    def views(self) -> tuple[str, ...]:
        """The quantized views this publisher writes beside the bf16 chain."""
        return self._view_publisher.names

    def view_fingerprint(self, name: str) -> str | None:
        """The fingerprint of view ``name`` at its newest committed version (None before one)."""
        return self._view_publisher.fingerprint(name)

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int | None:
        """The newest version this publisher committed (or found committed), or None."""
        if self._chain is not None:
            return self._chain.version
        return None if self._next == 0 else self._next - 1

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint of :attr:`version` (None before this publisher's first commit, on
        ranks other than 0)."""
        if self._chain is not None:
            return self._chain.fingerprint
        pointer = self._writer.pointer
        return None if pointer is None else pointer.fingerprint

    @property
    def pointer(self) -> Pointer | None:
        """The pointer last committed (rank 0; None on other ranks and in an empty bucket)."""
        return self._writer.pointer

    # The parts' state under the names it had when this class held it all (tests look inside).
    @property
    def _pointer(self) -> Pointer | None:
        return self._writer.pointer

    @_pointer.setter
    def _pointer(self, pointer: Pointer | None) -> None:
        self._writer.pointer = pointer

    @property
    def _history(self) -> dict[int, dict[str, object]]:
        return self._writer.history

    @property
    def _anchor_inflight(self) -> Future[None] | None:
        return self._anchors.inflight

    # ------------------------------------------------------------------ publish

    def publish(self, *, anchor: bool = False) -> PublishResult:
        """Write the next version and wait for its commit: ``submit(anchor=anchor).result()``."""
        return self.submit(anchor=anchor).result()

    def submit(self, *, anchor: bool = False) -> PublishFuture:
        """Capture the next version and publish it in the background.

        Returns once the changes are captured (the caller may step the optimizer again). If
        the version before is still in flight, waits for it first; if it failed and nobody
        looked at its future, raises its error here (its changes go into this call's next
        retry). ``anchor=True`` writes an anchor of this version beside its delta.

        With several processes (FSDP2, HSDP, DDP) this is collective: every rank of the default
        process group calls it; each writer rank writes its own part in its own background
        thread, and rank 0 commits once every part is written. Every rank's future gives the
        same result or raises :class:`~deltasync.PublishError`.
        """
        if self._closed:
            raise PublishError("this publisher is closed")
        start = time.perf_counter()
        self._wait_inflight()
        chain = self._chain
        version = self._next if chain is None else chain.version + 1
        capture = self._capture.take(version, None if chain is None else chain.fingerprint, anchor, start)
        future = PublishFuture()
        future.set_running_or_notify_cancel()
        self._inflight = future
        self._jobs.submit(self._run, future, capture)
        return future

    def flush(self) -> list[str]:
        """Wait for the version and the anchor in flight (raising a failure nobody looked at).

        Returns the warnings that came after the last result (a failed background anchor, a
        failed retention delete); the next result carries them too."""
        self._wait_inflight()
        self._anchors.wait()
        return self._warnings.peek()

    def _wait_inflight(self) -> None:
        previous = self._inflight
        if previous is None:
            return
        error = Future.exception(previous)  # waits; does not count as looking
        if error is not None and not previous.observed:
            previous.observed = True
            raise error

    def _run(self, future: PublishFuture, capture: Capture) -> None:
        release_free_memory()  # what the versions before freed, before this one allocates
        try:
            if capture.changes is None and self._chain is not None:
                capture = self._capture.detect(capture, self._chain.fingerprint, self._delta_group)
            result = self._publish_root(capture) if self._chain is None else self._publish_delta(capture)
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            future.set_exception(exc)
        else:
            future.set_result(result)

    # ------------------------------------------------------------------ background: one version

    def _publish_delta(self, capture: Capture) -> PublishResult:
        chain, version, changes = self._chain, capture.version, capture.changes
        assert chain is not None and changes is not None and capture.live is not None
        entry = self._writer.write_delta(version, changes, capture.fingerprint, chain, self._delta_group)
        self._writer.commit_delta(entry, chain.total, self._delta_group)
        # Committed: from here on nothing may raise, or a caller would retry a published version.
        self.detector.commit(capture.live)
        chain.version, chain.fingerprint = version, capture.fingerprint
        chain.since_anchor += entry.nbytes
        scheduled = self._anchors.schedule(chain, version, capture.fingerprint, capture.forced_anchor, self._delta_group)
        view_nbytes = self._view_publisher.publish(version, changes, scheduled) if self._views else {}
        result = self._result(capture, entry, chain.total, scheduled)
        return replace(result, view_nbytes=view_nbytes) if view_nbytes else result

    def _publish_root(self, capture: Capture) -> PublishResult:
        """The first version of a chain: an anchor and no delta, committed as a new pointer."""
        self.detector.pin()
        try:
            entry, fp = self._writer.write_anchor(capture.version, None, self._delta_group)
            total = sum(self._numels.values())
            self._writer.commit_root(entry, total, self._delta_group)
            view_nbytes = self._view_publisher.publish(capture.version, None, True) if self._views else {}
        finally:
            self.detector.unpin()
        # Committed.
        self._chain = ChainState(
            version=capture.version, fingerprint=fp, total=total, root=capture.version,
            anchor_nbytes=entry.nbytes, since_anchor=0, anchor_started=capture.version,
        )  # fmt: skip
        warnings = self._retention.housekeep(capture.version) if self._layout.rank == 0 else []
        result = self._result(replace(capture, fingerprint=fp), entry, total, False)
        return replace(result, kind="anchor", warnings=(*result.warnings, *warnings), view_nbytes=view_nbytes)

    def _result(self, capture: Capture, entry: ChainEntry, total: int, scheduled: bool) -> PublishResult:
        seconds = time.perf_counter() - capture.started
        for chain in (self._writer, *(view.chain for view in self._views)):  # the views committed it by now
            chain.note_seconds(capture.version, seconds)
        return PublishResult(
            version=capture.version, kind="delta", path=entry.path or entry.parts[0].path, nbytes=entry.nbytes,
            changed=entry.changed, total=total, fingerprint=capture.fingerprint, seconds=seconds,
            blocked_s=capture.blocked_s, anchor_scheduled=scheduled, warnings=self._warnings.take(),
        )

    def close(self) -> None:
        """Wait for the version and the anchor in flight, then detach from the optimizer.

        Raises the failure of a version nobody looked at."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self._jobs.shutdown(wait=True)
            self._anchors.close()
            self._writer.release()  # the next publisher on this bucket takes it at once
            self.detector.close()
            self._layout.release_group(self._delta_group)
            self._delta_group = None

    def __enter__(self) -> DeltaPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _publish_options(options: PublishOptions | None, overrides: dict[str, Any]) -> PublishOptions:
    if options is not None and not isinstance(options, PublishOptions):
        raise ConfigError(f"options must be a PublishOptions, got {type(options).__name__}")
    unknown = sorted(set(overrides) - {f.name for f in fields(PublishOptions)})
    if unknown:  # a TypeError, as for any unexpected keyword argument
        raise TypeError(
            f"unknown publish option(s) {', '.join(unknown)}; "
            f"PublishOptions has {', '.join(f.name for f in fields(PublishOptions))}"
        )
    return replace(options or PublishOptions(), **overrides)
