"""The trainer side: publish anchors and deltas into a bucket, then commit the pointer."""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from ._detector import BF16ChangeDetector, bf16_state_dict, named_parameters
from ._errors import ConfigError, DeltaSyncError, NotFoundError
from ._fingerprint import fingerprint, fingerprint_slice_share, fingerprint_update, format_fingerprint, parse_fingerprint
from ._format import (
    CODECS,
    HISTORY_PATH,
    MAX_HISTORY_BYTES,
    MAX_POINTER_BYTES,
    POINTER_PATH,
    ChainEntry,
    Change,
    PartEntry,
    Pointer,
    anchor_path,
    delta_path,
    encode_anchor,
    encode_delta,
    check_int,
    parse_json,
    part_path,
    sha256_hex,
)
from ._parts import AnchorSlice, encode_anchor_part
from .stores import open_store, read_limited

if TYPE_CHECKING:
    import os

    from .stores import Store

__all__ = ["PublishOptions", "PublishResult", "DeltaPublisher"]

logger = logging.getLogger(__name__)

# The only names retention may delete: the data files a publisher writes (and their parts).
_OWNED_RE = re.compile(r"(?:anchors|deltas)/([0-9]{8,16})(?:\.part[0-9]+)?\.safetensors", re.ASCII)


@dataclass(frozen=True, kw_only=True)
class PublishOptions:
    """How a :class:`DeltaPublisher` writes versions."""

    anchor_every: int = 10
    """Write a full anchor at least every this many versions (1 = anchors only)."""
    anchor_bytes_ratio: float = 0.5
    """Also write an anchor when the deltas since the last anchor would add up to more than this
    fraction of an anchor's size: a late joiner then never downloads more than (1 + ratio)
    anchors' worth. 0 disables the rule."""
    codec: str = "zstd"
    """Delta codec: "zstd" (compact, the default) or "raw" (readable with safe_open alone)."""
    zstd_level: int = 3
    """zstd level for the "zstd" codec: higher is smaller and slower to encode."""
    keep_anchors: int = 1
    """Anchor chains to keep in the bucket; older files are deleted after a new anchor commits."""
    snapshot_device: str | None = "cpu"
    """Where the detector keeps the last published bf16 state: "cpu", or None for each
    parameter's own device."""
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
        if not 1 <= self.zstd_level <= 22:
            raise ConfigError(f"zstd_level must be in 1..22, got {self.zstd_level}")
        if self.codec != "zstd" and self.zstd_level != 3:
            raise ConfigError(f"zstd_level={self.zstd_level} is set but codec is {self.codec!r}; drop one of them")
        if self.keep_anchors < 1:
            raise ConfigError(f"keep_anchors must be >= 1 (the newest chain is always kept), got {self.keep_anchors}")
        if not self.stale_temp_seconds > 0:
            raise ConfigError(f"stale_temp_seconds must be > 0, got {self.stale_temp_seconds}")


@dataclass(frozen=True, kw_only=True)
class PublishResult:
    """What one :meth:`DeltaPublisher.publish` committed."""

    version: int
    kind: str
    """"anchor" or "delta"."""
    path: str
    """The data file in the bucket."""
    nbytes: int
    """Bytes written for this version (the data file)."""
    changed: int
    """Elements that changed since the previous version (an anchor counts every element)."""
    total: int
    """Elements in the full state."""
    fingerprint: str
    """Fingerprint of the full bf16 state at this version."""
    seconds: float
    """Wall time of the publish: detect, encode, write, commit."""
    warnings: tuple[str, ...] = ()
    """Problems after the commit that did not undo it (a retention delete that failed); also logged."""

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.total if self.total else 0.0


class DeltaPublisher:
    """Publishes a model's bf16 weights into a bucket as anchors and sparse deltas.

    The first publish is an anchor holding every parameter (version 0 in an empty bucket;
    the version after the newest committed one in a bucket that already holds versions, so a
    restarted trainer never rewrites what servers may have applied). Each later publish writes
    the elements that changed since the previous one, or an anchor when
    ``anchor_every`` versions have passed or deltas since the last anchor grow too large
    (see :class:`PublishOptions`). The data file is written first, the pointer last: a reader
    sees a version only once it is complete. A publish that fails leaves the version counter
    and the detector as they were, so the next publish carries its changes.

    Args:
        bucket: a path, URL (``file://``, ``hf://buckets/ns/name``, ``s3://``, ``memory://``)
            or a :class:`~deltasync.stores.Store`.
        model: the model being trained.
        optimizer: its optimizer (a hook records which parameters each step touched).
        options: how versions are written (:class:`PublishOptions`; default: its defaults).
        **overrides: single fields of :class:`PublishOptions` (``anchor_every=5``), applied on
            top of ``options``.
    """

    def __init__(
        self,
        bucket: str | os.PathLike[str] | Store,
        model: torch.nn.Module,
        optimizer: object | None = None,
        *,
        options: PublishOptions | None = None,
        detector: BF16ChangeDetector | None = None,
        **overrides: Any,
    ) -> None:
        self.options = _publish_options(options, overrides)
        self.store = open_store(bucket)
        self.model = model
        self.detector = detector or BF16ChangeDetector(
            model, optimizer, snapshot_device=self.options.snapshot_device
        )
        if self.detector.layout is None:
            self._pointer: Pointer | None = self._read_pointer()
            self._history: dict[int, dict[str, object]] = self._read_history()
        else:
            self._init_collective()
        self._need_anchor = True
        self.anchor_metadata: dict[str, str] = {}
        """Extra ``x-`` metadata written into every anchor (an adapter bucket's PEFT config)."""
        if self.detector.layout is None or self.detector.layout.rank == 0:
            self._clean_temp()

    # ------------------------------------------------------------------ state

    @property
    def version(self) -> int | None:
        """The newest committed version in the bucket, or None."""
        return None if self._pointer is None else self._pointer.version

    @property
    def fingerprint(self) -> str | None:
        return None if self._pointer is None else self._pointer.fingerprint

    def _read_pointer(self) -> Pointer | None:
        try:
            data = read_limited(self.store, POINTER_PATH, MAX_POINTER_BYTES)
        except NotFoundError:
            return None
        return Pointer.from_bytes(data, where=f"{self.store.url}/{POINTER_PATH}")

    def _read_history(self) -> dict[int, dict[str, object]]:
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
        if self._pointer is not None:
            history = {v: r for v, r in history.items() if v <= self._pointer.version}
        return history

    # ------------------------------------------------------------------ publish

    def publish(self, *, anchor: bool = False) -> PublishResult:
        """Write the next version and commit it. ``anchor=True`` forces a full anchor.

        With several processes (FSDP2, HSDP, DDP) this is collective: every rank of the default
        process group calls it, each writer rank writes its own part, rank 0 commits, and every
        rank returns the same result or raises :class:`~deltasync.PublishError`.
        """
        if self.detector.layout is not None:
            return self._publish_collective(anchor)
        start = time.perf_counter()
        version = 0 if self._pointer is None else self._pointer.version + 1
        pointer = self._pointer
        changes: dict[str, Change] | None = None
        data = b""
        if not (anchor or self._need_anchor or pointer is None or self._anchor_due(pointer, version)):
            changes = self.detector.changes()
            new_fp = pointer.fingerprint
            for name, change in changes.items():
                new_fp = fingerprint_update(new_fp, name, change.index, change.old, change.new)
            data = encode_delta(
                changes,
                version=version,
                anchor=pointer.anchor,
                codec=self.options.codec,
                total=pointer.total,
                fingerprint=new_fp,
                base_fingerprint=pointer.fingerprint,
                level=self.options.zstd_level,
                numels={name: p.numel() for name, p in named_parameters(self.model)},
            )
            if self._too_big(pointer, len(data)):
                changes = None
        if changes is None:
            state = bf16_state_dict(self.model)
            new_fp = fingerprint(state)
            data = encode_anchor(state, version=version, fingerprint=new_fp, extra_metadata=self.anchor_metadata)
            total = sum(t.numel() for t in state.values())
            entry = ChainEntry(
                version=version,
                kind="anchor",
                path=anchor_path(version),
                nbytes=len(data),
                sha256=sha256_hex(data),
                fingerprint=new_fp,
                changed=total,
            )
            new_pointer = Pointer(version=version, anchor=version, fingerprint=new_fp, total=total, chain=(entry,))
            del state
        else:
            assert pointer is not None
            entry = ChainEntry(
                version=version,
                kind="delta",
                path=delta_path(version),
                nbytes=len(data),
                sha256=sha256_hex(data),
                fingerprint=new_fp,
                changed=sum(c.index.numel() for c in changes.values()),
            )
            new_pointer = Pointer(
                version=version,
                anchor=pointer.anchor,
                fingerprint=new_fp,
                total=pointer.total,
                chain=(*pointer.chain, entry),
            )
        self.store.write_bytes(entry.path, data)
        result = PublishResult(
            version=version,
            kind=entry.kind,
            path=entry.path,
            nbytes=entry.nbytes,
            changed=entry.changed,
            total=new_pointer.total,
            fingerprint=new_fp,
            seconds=0.0,
        )
        self._history[version] = {**asdict(result), "time": time.time()}
        del self._history[version]["warnings"]
        self._write_history()
        self.store.write_bytes(POINTER_PATH, new_pointer.to_bytes())  # the commit point
        self._pointer = new_pointer
        # Committed: from here on nothing may raise, or a caller would retry a published version.
        warnings: list[str] = []
        if changes is None:
            self.detector.reset()
            self._need_anchor = False
            warnings = self._housekeep(version)
        else:
            self.detector.commit(changes)
        seconds = time.perf_counter() - start
        self._history[version]["seconds"] = seconds
        return replace(result, seconds=seconds, warnings=tuple(warnings))

    # ------------------------------------------------------------------ several processes

    def _init_collective(self) -> None:
        layout = self.detector.layout
        assert layout is not None
        # Rank 0 alone reads, so that every rank starts from the same pointer.
        found = layout.agree("reading the pointer", lambda: (None, self._read_pointer() if layout.rank == 0 else None))
        pointer = found[1][0]
        self._pointer = pointer
        self._history = self._read_history() if layout.rank == 0 else {}

    def _publish_collective(self, anchor: bool) -> PublishResult:
        start = time.perf_counter()
        layout = self.detector.layout
        assert layout is not None
        pointer = self._pointer
        version = 0 if pointer is None else pointer.version + 1
        kind = "anchor" if anchor or self._need_anchor or pointer is None or self._anchor_due(pointer, version) else "delta"
        numels = {name: s.numel for name, s in layout.slices.items()}
        split = layout.parts > 1
        changes: dict[str, Change] = {}
        while True:
            if kind == "delta":
                assert pointer is not None
                changes, shares = layout.agree(f"detecting the changes of version {version}", self._local_changes)
                new_fp = format_fingerprint(parse_fingerprint(pointer.fingerprint) + sum(shares))
                data, sizes = layout.agree(
                    f"encoding delta {version}",
                    lambda: self._encode_part(encode_delta(
                        changes,
                        version=version,
                        anchor=pointer.anchor,
                        codec=self.options.codec,
                        total=pointer.total,
                        fingerprint=new_fp,
                        base_fingerprint=pointer.fingerprint,
                        level=self.options.zstd_level,
                        numels=numels,
                        part=(layout.part, layout.parts) if split else None,
                    )),
                )
                if not self._too_big(pointer, sum(sizes)):
                    break
                kind = "anchor"
            slices, shares = layout.agree(f"reading the weights of anchor {version}", self._local_anchor)
            new_fp = format_fingerprint(sum(shares))
            total = sum(numels.values())
            data, _ = layout.agree(
                f"encoding anchor {version}",
                lambda: self._encode_part(
                    encode_anchor_part(
                        slices, version=version, fingerprint=new_fp, total=total, part=layout.part, parts=layout.parts,
                        extra_metadata=self.anchor_metadata,
                    )
                    if split
                    else encode_anchor(
                        {s.name: s.values.view(s.shape) for s in slices}, version=version, fingerprint=new_fp,
                        extra_metadata=self.anchor_metadata,
                    )
                ),
            )
            break
        path = (part_path(kind, version, layout.part) if split else (anchor_path if kind == "anchor" else delta_path)(version))
        changed = sum(c.index.numel() for c in changes.values()) if kind == "delta" else sum(s.end - s.begin for s in slices)

        def write() -> tuple[None, PartEntry | None]:
            if not layout.writer:
                return None, None
            self.store.write_bytes(path, data)
            return None, PartEntry(path=path, nbytes=len(data), sha256=sha256_hex(data), changed=changed)

        _, written = layout.agree(f"writing {kind} {version}", write)
        files = [item for item in written if item is not None]
        if split:
            files.sort(key=lambda item: int(item.path.rsplit(".part", 1)[1].split(".")[0]))
            entry = ChainEntry(
                version=version,
                kind=kind,
                path="",
                nbytes=sum(f.nbytes for f in files),
                sha256="",
                fingerprint=new_fp,
                changed=sum(f.changed for f in files),
                parts=tuple(files),
            )
        else:
            (only,) = files
            entry = ChainEntry(
                version=version, kind=kind, path=only.path, nbytes=only.nbytes, sha256=only.sha256,
                fingerprint=new_fp, changed=only.changed,
            )
        if kind == "anchor":
            new_pointer = Pointer(version=version, anchor=version, fingerprint=new_fp, total=sum(numels.values()), chain=(entry,))
        else:
            assert pointer is not None
            new_pointer = Pointer(
                version=version, anchor=pointer.anchor, fingerprint=new_fp, total=pointer.total, chain=(*pointer.chain, entry)
            )
        result = PublishResult(
            version=version,
            kind=kind,
            path=entry.path or entry.parts[0].path,
            nbytes=entry.nbytes,
            changed=entry.changed,
            total=new_pointer.total,
            fingerprint=new_fp,
            seconds=0.0,
        )

        def commit() -> tuple[None, None]:
            if layout.rank == 0:
                self._history[version] = {**asdict(result), "time": time.time()}
                del self._history[version]["warnings"]
                try:
                    self._write_history()
                    self.store.write_bytes(POINTER_PATH, new_pointer.to_bytes())  # the commit point
                except BaseException:
                    del self._history[version]
                    raise
            return None, None

        layout.agree(f"committing version {version}", commit)
        self._pointer = new_pointer
        # Committed: from here on nothing may raise, or a caller would retry a published version.
        warnings: list[str] = []
        if kind == "anchor":
            self.detector.reset()
            self._need_anchor = False
            if layout.rank == 0:
                warnings = self._housekeep(version)
        else:
            self.detector.commit(changes)
        seconds = time.perf_counter() - start
        if layout.rank == 0:
            self._history[version]["seconds"] = seconds
        return replace(result, seconds=seconds, warnings=tuple(warnings))

    def _local_changes(self) -> tuple[dict[str, Change], int]:
        """This rank's changes and its share of the fingerprint's move (0 on ranks that own nothing)."""
        changes = self.detector.changes()
        share = 0
        for name, change in changes.items():
            share += parse_fingerprint(fingerprint_update(format_fingerprint(0), name, change.index, change.old, change.new))
        return changes, share

    def _local_anchor(self) -> tuple[list[AnchorSlice], int]:
        """This rank's slice of every parameter in bf16, and its share of the fingerprint."""
        layout = self.detector.layout
        assert layout is not None
        slices, share = [], 0
        for name, param in named_parameters(self.model):
            owned = layout.slices[name]
            values = owned.local(param).to(device="cpu", dtype=torch.bfloat16, copy=True) if layout.writer else None
            if values is None:
                continue
            slices.append(AnchorSlice(name, owned.shape, owned.begin, owned.end, values))
            share += fingerprint_slice_share(name, values, owned.begin)
        return slices, share

    def _encode_part(self, data: bytes) -> tuple[bytes, int]:
        layout = self.detector.layout
        assert layout is not None
        return (data, len(data)) if layout.writer else (b"", 0)

    def _anchor_due(self, pointer: Pointer, version: int) -> bool:
        return version - pointer.anchor >= self.options.anchor_every

    def _too_big(self, pointer: Pointer, nbytes: int) -> bool:
        ratio = self.options.anchor_bytes_ratio
        if ratio <= 0:
            return False
        anchor_bytes = pointer.chain[0].nbytes
        since = sum(item.nbytes for item in pointer.chain[1:]) + nbytes
        return since > ratio * anchor_bytes

    def _write_history(self) -> None:
        lines = [json.dumps(self._history[v], sort_keys=True) for v in sorted(self._history)]
        self.store.write_bytes(HISTORY_PATH, ("\n".join(lines) + "\n").encode())

    def _housekeep(self, version: int) -> list[str]:
        """Retention and temp-file cleaning after anchor ``version`` was committed: never raises;
        returns the warnings for the publish result (also logged)."""
        warnings: list[str] = []
        try:
            self._retain(version)
        except Exception as exc:  # noqa: BLE001  (reported, not raised: the version is committed)
            warnings.append(f"retention after version {version} failed, old files are left: {exc}")
            logger.warning("deltasync: %s", warnings[-1])
        self._clean_temp()
        return warnings

    def _retain(self, newest_anchor: int) -> None:
        """Delete files older than the ``keep_anchors`` newest anchor chains."""
        anchors = sorted(
            {v for v in (_version_of(p) for p in self.store.list("anchors/")) if v is not None and v <= newest_anchor}
        )
        if len(anchors) < self.options.keep_anchors:
            return
        keep_from = anchors[-self.options.keep_anchors]
        stale = [
            path
            for path in (*self.store.list("anchors/"), *self.store.list("deltas/"))
            if (v := _version_of(path)) is not None and v < keep_from
        ]
        if stale:
            self.store.delete(stale)

    def _clean_temp(self) -> None:
        """Delete temporary files that killed writes left (local buckets only; best effort)."""
        clean = getattr(self.store, "clean_temp", None)
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
        """Detach from the optimizer."""
        self.detector.close()

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


def _version_of(path: str) -> int | None:
    """The version of a data file this publisher writes; None for any other name."""
    match = _OWNED_RE.fullmatch(path)
    return None if match is None else int(match.group(1))

