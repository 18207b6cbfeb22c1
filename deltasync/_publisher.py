"""The trainer side: publish anchors and deltas into a bucket, then commit the pointer."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from ._detector import BF16ChangeDetector, bf16_state_dict, named_parameters
from ._errors import ConfigError, NotFoundError
from ._fingerprint import fingerprint, fingerprint_update
from ._format import (
    CODECS,
    HISTORY_PATH,
    POINTER_PATH,
    ChainEntry,
    Change,
    Pointer,
    anchor_path,
    delta_path,
    encode_anchor,
    encode_delta,
    sha256_hex,
)
from .stores import open_store

if TYPE_CHECKING:
    import os

    from .stores import Store

__all__ = ["PublishOptions", "PublishResult", "DeltaPublisher"]


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
        self._pointer: Pointer | None = self._read_pointer()
        self._history: dict[int, dict[str, object]] = self._read_history()
        self._need_anchor = True

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
            data = self.store.read_bytes(POINTER_PATH)
        except NotFoundError:
            return None
        return Pointer.from_bytes(data, where=f"{self.store.url}/{POINTER_PATH}")

    def _read_history(self) -> dict[int, dict[str, object]]:
        try:
            data = self.store.read_bytes(HISTORY_PATH)
        except NotFoundError:
            return {}
        history: dict[int, dict[str, object]] = {}
        for line in data.decode(errors="replace").splitlines():
            try:
                record = json.loads(line)
                history[int(record["version"])] = record
            except (ValueError, KeyError, TypeError):
                continue  # the history is informative only; a bad line is not worth a failure
        if self._pointer is not None:
            history = {v: r for v, r in history.items() if v <= self._pointer.version}
        return history

    # ------------------------------------------------------------------ publish

    def publish(self, *, anchor: bool = False) -> PublishResult:
        """Write the next version and commit it. ``anchor=True`` forces a full anchor."""
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
            data = encode_anchor(state, version=version, fingerprint=new_fp)
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
        self._write_history()
        self.store.write_bytes(POINTER_PATH, new_pointer.to_bytes())  # the commit point
        self._pointer = new_pointer
        if changes is None:
            self.detector.reset()
            self._need_anchor = False
            self._retain(version)
        else:
            self.detector.commit(changes)
        seconds = time.perf_counter() - start
        self._history[version]["seconds"] = seconds
        return replace(result, seconds=seconds)

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

    def _retain(self, newest_anchor: int) -> None:
        """Delete files older than the ``keep_anchors`` newest anchor chains."""
        anchors = sorted(
            v for v in (_version_of(p) for p in self.store.list("anchors/")) if v is not None and v <= newest_anchor
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
    stem = path.rsplit("/", 1)[-1].split(".", 1)[0]
    try:
        return int(stem)
    except ValueError:
        return None

