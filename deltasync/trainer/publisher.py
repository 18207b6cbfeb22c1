"""The trainer side: publish anchors and deltas into a bucket, then commit the pointer."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch

from ..errors import ConfigError, DeltaSyncError, IntegrityError, NotFoundError, PublishError
from ..format import (
    CODECS,
    HISTORY_PATH,
    MAX_ANCHORS,
    MAX_HISTORY_BYTES,
    MAX_POINTER_BYTES,
    POINTER_PATH,
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
    get_codec,
    manifest_digest,
    parse_json,
    part_path,
    sha256_hex,
)
from ..format.fingerprint import fingerprint_slice_share, fingerprint_update, format_fingerprint, parse_fingerprint
from ..stores import TempCleaningStore, open_store, read_limited, write_stream
from .checkpoint_layout import checkpoint_layout
from .detector import BF16ChangeDetector
from .memory import release_free_memory
from .sharded import ShardLayout, solo_layout
from .sources import WeightSource, weight_source
from .view_chain import ViewChain

if TYPE_CHECKING:
    import os

    from ..stores import Store

__all__ = ["PublishOptions", "PublishResult", "PublishFuture", "DeltaPublisher"]

logger = logging.getLogger(__name__)

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
    keep_anchors: int = 1
    """Complete anchors to keep in the bucket. The deltas are kept one anchor further back, so
    that a follower up to an anchor interval behind still catches up with deltas alone; older
    files are deleted after a new anchor commits."""
    snapshot_device: str | None = "cpu"
    """Where the detector keeps the last published bf16 state: "cpu", or None for each
    parameter's own device."""
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

    def __post_init__(self) -> None:
        if self.anchor_every < 1:
            raise ConfigError(f"anchor_every must be >= 1, got {self.anchor_every}")
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
        if self.capture not in _CAPTURES:
            raise ConfigError(f"capture must be one of {', '.join(map(repr, _CAPTURES))}, got {self.capture!r}")
        if isinstance(self.views, str) or isinstance(self.view_ignore, str):
            raise ConfigError("views and view_ignore are tuples of names, e.g. views=('FP8_DYNAMIC',)")
        if len(set(self.views)) != len(self.views):
            raise ConfigError(f"views lists a scheme twice: {self.views}")
        if self.views:
            from ..views import get_scheme  # compressed-tensors is needed only for views

            for name in self.views:
                get_scheme(name)
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


@dataclass
class _Chain:
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


CaptureMode = Literal["submit", "overlap"]
_CAPTURES: tuple[CaptureMode, ...] = get_args(CaptureMode)


@dataclass
class _Capture:
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
        **overrides: Any,
    ) -> None:
        self.options = _publish_options(options, overrides)
        self.store = open_store(bucket)
        self.model = model
        source = weight_source(model)
        self.detector = detector or BF16ChangeDetector(source, optimizer, snapshot_device=self.options.snapshot_device)
        problem = self.detector.overlap_problem if self.options.capture == "overlap" else None
        if problem is not None:
            raise ConfigError(f"capture='overlap' is not possible here: {problem}; use capture='submit'")
        named = [(w.name, w.value) for w in source.weights()]
        self._params = dict(named)
        # Versions are named and shaped as save_pretrained writes the model; detection stays on
        # the live parameters, whose changes are mapped to checkpoint tensors at capture.
        self._checkpoint = checkpoint_layout(source.checkpoint_model, named)
        self._live_layout: ShardLayout = self.detector.layout or solo_layout(named)
        self._layout = self._checkpoint.owned(self._live_layout)
        self._numels = self._checkpoint.numels
        layout = self._layout
        self._manifest = manifest_digest((name, owned.shape, torch.bfloat16) for name, owned in layout.slices.items())
        """The bf16 state's manifest digest, committed in the pointer and every file."""
        # Rank 0 alone reads, so that every rank starts from the same pointer.
        found = layout.agree("reading the pointer", lambda: (None, self._read_pointer() if layout.rank == 0 else None))
        pointer: Pointer | None = found[1][0]
        self._pointer = pointer if layout.rank == 0 else None
        self._history = self._read_history(pointer) if layout.rank == 0 else {}
        self._chain: _Chain | None = None
        self._next = 0 if pointer is None else pointer.version + 1
        # Background threads coordinate ranks over groups of their own, never the training one.
        self._delta_group = layout.new_group()
        self._anchor_group = layout.new_group()
        self._jobs = ThreadPoolExecutor(1, thread_name_prefix="deltasync-publish")
        self._anchors = ThreadPoolExecutor(1, thread_name_prefix="deltasync-anchor")
        self._inflight: PublishFuture | None = None
        self._anchor_inflight: Future[None] | None = None
        self._commit_lock = threading.Lock()
        self._late_warnings: list[str] = []
        self._closed = False
        self.anchor_metadata: dict[str, str] = {}
        """Extra ``x-`` metadata written into every anchor (an adapter bucket's PEFT config)."""
        self._views = self._make_views(source)
        if layout.rank == 0:
            self._clean_temp()

    def _make_views(self, source: WeightSource) -> list[ViewChain]:
        """One :class:`ViewChain` per name in ``options.views``."""
        if not self.options.views:
            return []
        layout = self._layout
        from ..views import get_scheme, ignore_list, quantized_names

        shapes = {name: owned.shape for name, owned in layout.slices.items()}
        module = source.checkpoint_model if isinstance(source.checkpoint_model, torch.nn.Module) else None
        if module is None:
            raise ConfigError("quantized views need the model (an nn.Module) to tell its Linear layers")
        ignore = tuple(self.options.view_ignore)
        targets = {n for n in quantized_names(module, list(shapes), ignore) if len(shapes[n]) == 2}
        # The config names every Linear left in bf16 (an MoE's routers too), as llm-compressor writes it.
        listed = tuple(ignore_list(module, ignore))
        return [
            ViewChain(
                self.store, get_scheme(name), targets=targets, shapes=shapes, ignore=listed, codec=self.options.codec,
                level=self.options.zstd_level if get_codec(self.options.codec).levels else None,
                keep_anchors=self.options.keep_anchors, layout=layout if layout.world > 1 else None,
                group=self._delta_group,
            )
            for name in self.options.views
        ]

    @property
    def views(self) -> tuple[str, ...]:
        """The quantized views this publisher writes beside the bf16 chain."""
        return tuple(view.name for view in self._views)

    def view_fingerprint(self, name: str) -> str | None:
        """The fingerprint of view ``name`` at its newest committed version (None before one)."""
        for view in self._views:
            if view.name == name:
                return None if view.head is None else view.head.fingerprint
        raise ConfigError(f"this publisher writes no view {name!r} (it writes {', '.join(self.views) or 'none'})")

    def _checkpoint_values(self) -> Callable[[str], torch.Tensor]:
        """Checkpoint tensor name -> the elements of it this rank owns (all of it in a single
        process), flat, at the newest committed version, in bf16 on the CPU, from the snapshot (a
        parameter that is not trained: its live value). Each live parameter is read once per
        call of this (a fused MoE tensor serves many names). Ranks that own no element of
        ``name`` never call it."""
        flats: dict[str, torch.Tensor] = {}

        def value(name: str) -> torch.Tensor:
            source = self._checkpoint.pieces[name].source
            flat = flats.get(source)
            if flat is None:
                live = self._live_layout.slices[source]
                tracked = self.detector.is_tracked(source)
                flat = self.detector.published_flat(source) if tracked else live.local(self._params[source])
                flats.clear()  # one source at a time: names of one source come together
                flats[source] = flat
            return self._checkpoint_value(name, flat)

        return value

    def _checkpoint_value(self, name: str, flat: torch.Tensor) -> torch.Tensor:
        owned = self._layout.slices[name]
        live = self._live_layout.slices[self._checkpoint.pieces[name].source]
        pieces = [c.detach().to("cpu", torch.bfloat16) for c in self._checkpoint.chunks(name, flat, live.begin, owned)]
        return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.bfloat16)

    def _publish_views(self, version: int, changes: dict[str, Change] | None, anchor: bool) -> dict[str, int]:
        """Bring every view to ``version`` (just committed in the bf16 chain): a delta from
        ``changes`` (None: a new chain), and an anchor beside it when ``anchor``. Never raises:
        a view that fails is reported and starts a new chain at the next version."""
        written: dict[str, int] = {}
        for view in self._views:
            if not view.active:  # a rank of a one-file layout that does not write
                continue
            try:
                nbytes = 0
                entry = None if changes is None else view.publish_delta(version, changes, self._checkpoint_values())
                if entry is not None:
                    nbytes += entry.nbytes
                if entry is None or anchor:
                    nbytes += view.publish_anchor(version, self._checkpoint_values(), new_chain=entry is None).nbytes
                written[view.name] = nbytes
            except Exception as exc:  # noqa: BLE001 - reported; the bf16 chain is committed
                self._warn(f"view {view.name}: version {version} was not written (the bf16 chain has it; the view "
                           f"starts a new chain at the next version): {exc}")
        return written

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
        return None if self._pointer is None else self._pointer.fingerprint

    @property
    def pointer(self) -> Pointer | None:
        """The pointer last committed (rank 0; None on other ranks and in an empty bucket)."""
        return self._pointer

    def _read_pointer(self) -> Pointer | None:
        try:
            data = read_limited(self.store, POINTER_PATH, MAX_POINTER_BYTES)
        except NotFoundError:
            return None
        return Pointer.from_bytes(data, where=f"{self.store.url}/{POINTER_PATH}")

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
        capture = self._capture(anchor, start)
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
        anchor = self._anchor_inflight
        if anchor is not None:
            anchor.result()
        with self._commit_lock:
            return list(self._late_warnings)

    def _wait_inflight(self) -> None:
        previous = self._inflight
        if previous is None:
            return
        error = Future.exception(previous)  # waits; does not count as looking
        if error is not None and not previous.observed:
            previous.observed = True
            raise error

    def _capture(self, anchor: bool, start: float) -> _Capture:
        """The next version's changes, copied out of the live weights (collective)."""
        version = self._next if self._chain is None else self._chain.version + 1
        if self._chain is None:
            # A new chain: its first version has an anchor and no delta.
            self.detector.reset()
            return _Capture(version, {}, {}, "", True, start, time.perf_counter() - start)
        if self.options.capture == "overlap":
            release = self.detector.hold_next_step()
            return _Capture(version, None, None, "", anchor, start, time.perf_counter() - start, release)
        return self._detect(_Capture(version, None, None, "", anchor, start, 0.0), None)

    def _detect(self, capture: _Capture, group: Any) -> _Capture:
        """``capture`` with its changes found (collective, over ``group``), and, overlapping
        the next step, that step let go (it may have waited: that counts as blocked)."""
        assert self._chain is not None
        try:
            (changes, live), shares = self._layout.agree(
                f"detecting the changes of version {capture.version}", self._local_changes, group
            )
        finally:
            waited = capture.release() if capture.release is not None else time.perf_counter() - capture.started
        fp = format_fingerprint(parse_fingerprint(self._chain.fingerprint) + sum(shares))
        return replace(
            capture, changes=changes, live=live, fingerprint=fp, blocked_s=capture.blocked_s + waited, release=None  # type: ignore[arg-type]
        )

    def _local_changes(self) -> tuple[tuple[dict[str, Change], dict[str, Change]], int]:
        """This rank's changes (in checkpoint layout, and on the live parameters) and its share of
        the fingerprint's move (0 on ranks that own nothing)."""
        live = self.detector.changes()
        changes = self._checkpoint.to_checkpoint(live)
        share = 0
        for name, change in changes.items():
            share += parse_fingerprint(fingerprint_update(format_fingerprint(0), name, change.index, change.old, change.new))
        return (changes, live), share

    def _run(self, future: PublishFuture, capture: _Capture) -> None:
        release_free_memory()  # what the versions before freed, before this one allocates
        try:
            if capture.changes is None and self._chain is not None:
                capture = self._detect(capture, self._delta_group)
            result = self._publish_root(capture) if self._chain is None else self._publish_delta(capture)
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            future.set_exception(exc)
        else:
            future.set_result(result)

    # ------------------------------------------------------------------ background: deltas

    def _publish_delta(self, capture: _Capture) -> PublishResult:
        layout, chain, version = self._layout, self._chain, capture.version
        assert chain is not None
        split = layout.parts > 1
        path = part_path("delta", version, layout.part) if split else delta_path(version)
        changes = capture.changes
        assert changes is not None and capture.live is not None

        def write() -> tuple[None, PartEntry | None]:
            if not layout.writer:
                return None, None
            data = encode_delta(
                changes,
                version=version,
                anchor=chain.root,
                codec=self.options.codec,
                total=chain.total,
                fingerprint=capture.fingerprint,
                base_fingerprint=chain.fingerprint,
                level=self.options.zstd_level,
                numels=self._numels,
                part=(layout.part, layout.parts) if split else None,
                manifest=self._manifest,
            )
            self.store.write_bytes(path, data)
            changed = sum(c.index.numel() for c in changes.values())
            return None, PartEntry(path=path, nbytes=len(data), sha256=sha256_hex(data), changed=changed)

        _, written = layout.agree(f"writing delta {version}", write, self._delta_group)
        entry = ChainEntry.of_files("delta", version, capture.fingerprint, [w for w in written if w is not None], split)

        def commit() -> tuple[None, None]:
            if layout.rank == 0:
                with self._commit_lock:
                    pointer = self._pointer
                    assert pointer is not None
                    new = replace(pointer, version=version, fingerprint=capture.fingerprint, chain=(*pointer.chain, entry))
                    self._commit(new, version, self._record("delta", entry, chain.total))
            return None, None

        layout.agree(f"committing version {version}", commit, self._delta_group)
        # Committed: from here on nothing may raise, or a caller would retry a published version.
        self.detector.commit(capture.live)
        chain.version, chain.fingerprint = version, capture.fingerprint
        chain.since_anchor += entry.nbytes
        scheduled = self._schedule_anchor(version, capture.fingerprint, capture.forced_anchor)
        view_nbytes = self._publish_views(version, changes, scheduled) if self._views else {}
        result = self._result(capture, entry, chain.total, scheduled)
        return replace(result, view_nbytes=view_nbytes) if view_nbytes else result

    def _schedule_anchor(self, version: int, fp: str, forced: bool) -> bool:
        """Start an anchor of ``version`` beside its delta if it is due (collective; never raises)."""
        layout, chain = self._layout, self._chain
        assert chain is not None
        busy = self._anchor_inflight is not None and not self._anchor_inflight.done()
        try:
            _, views = layout.agree(
                f"scheduling the anchor of version {version}",
                lambda: (None, (busy, forced or self._anchor_due(chain, version))),
                self._delta_group,
            )
        except Exception as exc:  # noqa: BLE001 - the delta is committed; an anchor can wait
            self._warn(f"cannot schedule an anchor of version {version}: {exc}")
            return False
        due = views[0][1]  # rank 0's view decides: ranks may see anchors end at other times
        if not due:
            return False
        if any(b for b, _ in views):
            if not forced:
                return False
            # Forced: the anchor in flight ends first, on every rank alike (its last step is
            # collective), so this one then starts everywhere.
            assert self._anchor_inflight is not None or not busy
            if self._anchor_inflight is not None:
                Future.exception(self._anchor_inflight)
        self.detector.pin()
        chain.anchor_started, chain.since_anchor = version, 0
        self._anchor_inflight = self._anchors.submit(self._background_anchor, version, fp)
        return True

    def _anchor_due(self, chain: _Chain, version: int) -> bool:
        if version - chain.anchor_started >= self.options.anchor_every:
            return True
        ratio = self.options.anchor_bytes_ratio
        return ratio > 0 and chain.since_anchor > ratio * chain.anchor_nbytes

    # ------------------------------------------------------------------ background: anchors

    def _publish_root(self, capture: _Capture) -> PublishResult:
        """The first version of a chain: an anchor and no delta, committed as a new pointer."""
        self.detector.pin()
        try:
            entry, fp = self._write_anchor(capture.version, None, self._delta_group)
            total = sum(self._numels.values())

            def commit() -> tuple[None, None]:
                if self._layout.rank == 0:
                    with self._commit_lock:
                        self._commit(Pointer.start(entry, total=total, manifest=self._manifest), capture.version, self._record("anchor", entry, total))
                return None, None

            self._layout.agree(f"committing version {capture.version}", commit, self._delta_group)
            view_nbytes = self._publish_views(capture.version, None, True) if self._views else {}
        finally:
            self.detector.unpin()
        # Committed.
        self._chain = _Chain(
            version=capture.version, fingerprint=fp, total=total, root=capture.version,
            anchor_nbytes=entry.nbytes, since_anchor=0, anchor_started=capture.version,
        )
        warnings = self._housekeep(capture.version) if self._layout.rank == 0 else []
        result = self._result(replace(capture, fingerprint=fp), entry, total, False)
        return replace(result, kind="anchor", warnings=(*result.warnings, *warnings), view_nbytes=view_nbytes)

    def _background_anchor(self, version: int, fp: str) -> None:
        """An anchor of a committed version, streamed from the pinned snapshot; then committed
        into the pointer beside the deltas. A failure is reported, never raised to the trainer:
        the deltas carry on, and the next anchor is due at once."""
        layout, chain = self._layout, self._chain
        assert chain is not None
        try:
            try:
                entry, _ = self._write_anchor(version, fp, self._anchor_group)
            finally:
                self.detector.unpin()

            def commit() -> tuple[None, None]:
                if layout.rank == 0:
                    with self._commit_lock:
                        self._commit(self._with_anchor(entry), None, None)
                return None, None

            layout.agree(f"committing the anchor of version {version}", commit, self._anchor_group)
        except Exception as exc:  # noqa: BLE001 - reported with the next result, and logged
            chain.anchor_started = -(1 << 62)  # due again at the next version
            self._warn(f"the anchor of version {version} was not committed (the deltas are): {exc}")
            return
        chain.anchor_nbytes = entry.nbytes
        if layout.rank == 0:
            for warning in self._housekeep(version):
                with self._commit_lock:
                    self._late_warnings.append(warning)

    def _write_anchor(self, version: int, expected: str | None, group: Any) -> tuple[ChainEntry, str]:
        """Stream this rank's part of the anchor of ``version`` from the snapshot (pinned by the
        caller) and the untracked parameters; return the version's entry and fingerprint.

        With ``expected`` (the chain's fingerprint of that version) the streamed values are
        hashed on the way and must add up to it; without, they are hashed first.
        """
        layout = self._layout
        split = layout.parts > 1
        params = self._params
        shares: list[int] = [0]

        def chunks(name: str) -> Callable[[], Iterator[torch.Tensor]]:
            owned = layout.slices[name]
            source = self._checkpoint.pieces[name].source
            live = self._live_layout.slices[source]

            def gen() -> Iterator[torch.Tensor]:
                if owned.end == owned.begin:
                    return
                # The snapshot, or for a parameter that is not trained its live value (its value
                # at every version), read in the checkpoint tensor's order.
                tracked = self.detector.is_tracked(source)
                flat = self.detector.snapshot_flat(source) if tracked else live.local(params[source])
                offset = owned.begin
                for values in self._checkpoint.chunks(name, flat, live.begin, owned):
                    shares[0] += fingerprint_slice_share(name, values.cpu(), offset)
                    offset += values.numel()
                    yield values

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
        total = sum(self._numels.values())
        path = part_path("anchor", version, layout.part) if split else anchor_path(version)

        def write() -> tuple[None, tuple[PartEntry | None, int]]:
            if not layout.writer:
                return None, (None, 0)
            stream = anchor_stream(
                sources, version=version, fingerprint=expected, total=total,
                part=layout.part if split else None, parts=layout.parts if split else None,
                extra_metadata=self.anchor_metadata, manifest=self._manifest,
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

    def _with_anchor(self, entry: ChainEntry) -> Pointer:
        """The pointer with a newly complete anchor, and the window of what it keeps (rank 0,
        under the commit lock)."""
        pointer = self._pointer
        assert pointer is not None
        return pointer.with_anchor(entry, self.options.keep_anchors)

    # ------------------------------------------------------------------ commit (rank 0)

    def _commit(self, pointer: Pointer, version: int | None, record: dict[str, object] | None) -> None:
        """History, then the pointer: the commit point (rank 0, under the commit lock). A
        failure leaves the history as it was."""
        history = dict(self._history)
        if record is not None:
            assert version is not None
            history[version] = record
        for item in pointer.anchors:
            if item.version in history and "anchor_nbytes" not in history[item.version]:
                history[item.version] = {**history[item.version], "anchor_nbytes": item.nbytes}
        lines = [json.dumps(history[v], sort_keys=True) for v in sorted(history)]
        self.store.write_bytes(HISTORY_PATH, ("\n".join(lines) + "\n").encode())
        self.store.write_bytes(POINTER_PATH, pointer.to_bytes())  # the commit point
        self._history, self._pointer = history, pointer

    @staticmethod
    def _record(kind: str, entry: ChainEntry, total: int) -> dict[str, object]:
        return {
            "version": entry.version, "kind": kind, "path": entry.path or entry.parts[0].path, "nbytes": entry.nbytes,
            "changed": entry.changed, "total": total, "fingerprint": entry.fingerprint, "seconds": 0.0,
            "time": time.time(),
        }

    def _result(self, capture: _Capture, entry: ChainEntry, total: int, scheduled: bool) -> PublishResult:
        seconds = time.perf_counter() - capture.started
        if self._layout.rank == 0 and capture.version in self._history:
            self._history[capture.version]["seconds"] = seconds
        with self._commit_lock:
            warnings, self._late_warnings = tuple(self._late_warnings), []
        return PublishResult(
            version=capture.version, kind="delta", path=entry.path or entry.parts[0].path, nbytes=entry.nbytes,
            changed=entry.changed, total=total, fingerprint=capture.fingerprint, seconds=seconds,
            blocked_s=capture.blocked_s, anchor_scheduled=scheduled, warnings=warnings,
        )

    def _warn(self, message: str) -> None:
        logger.warning("deltasync: %s", message)
        with self._commit_lock:
            self._late_warnings.append(message)

    def _housekeep(self, version: int) -> list[str]:
        """Retention and temp-file cleaning after the anchor of ``version`` was committed:
        never raises; returns the warnings (also logged)."""
        warnings: list[str] = []
        try:
            self._retain()
        except Exception as exc:  # noqa: BLE001  (reported, not raised: the version is committed)
            warnings.append(f"retention after the anchor of version {version} failed, old files are left: {exc}")
            logger.warning("deltasync: %s", warnings[-1])
        self._clean_temp()
        return warnings

    def _retain(self) -> None:
        """Delete the data files the pointer no longer needs: anchors older than its oldest
        anchor, and deltas at or below its base. Nothing else is ever deleted."""
        with self._commit_lock:
            pointer = self._pointer
        assert pointer is not None
        stale = pointer.stale([*self.store.list("anchors/"), *self.store.list("deltas/")])
        if stale:
            self.store.delete(stale)

    def _clean_temp(self) -> None:
        """Delete temporary files that killed writes left (local buckets only; best effort)."""
        clean = self.store.clean_temp if isinstance(self.store, TempCleaningStore) else None
        if clean is None:
            return
        try:
            removed = clean(self.options.stale_temp_seconds)
        except Exception as exc:  # noqa: BLE001  (housekeeping never fails a publish)
            logger.warning("deltasync: cannot clean stale temporary files in %s: %s", self.store.url, exc)
            return
        if removed:
            logger.info("deltasync: removed %d stale temporary file(s) in %s", len(removed), self.store.url)

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
            self._anchors.shutdown(wait=True)
            self.detector.close()
            for group in (self._delta_group, self._anchor_group):
                self._layout.release_group(group)
            self._delta_group = self._anchor_group = None

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
