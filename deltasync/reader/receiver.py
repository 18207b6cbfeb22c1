"""The server side: follow a bucket's pointer and keep an exact bf16 copy of the weights."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import ConfigError, FormatError, IntegrityError, NotFoundError, VersionError
from ..format import MAX_POINTER_BYTES, POINTER_PATH, Pointer, tensors_manifest, view_prefix
from ..format.dtypes import read_lanes
from ..format.fingerprint import fingerprint, fingerprint_add, fingerprint_moves
from ..protocol.messages import Heal
from ..stores import open_store
from ..stores._sub import sub_store
from .chain import ChainReader, Overlay, Patch, read_pointer

if TYPE_CHECKING:
    import os

    from ..stores import Store

__all__ = ["DeltaReceiver", "StagedUpdate"]

logger = logging.getLogger(__name__)

_MAX_ATTEMPTS = 8
"""Default bound on how often a sync starts over from a newer pointer."""


def _manifest(expected: Mapping[str, tuple[int, ...] | torch.Size] | None) -> dict[str, tuple[int, ...]] | None:
    if expected is None:
        return None
    manifest = {}
    for name, shape in expected.items():
        dims = tuple(shape)
        if not isinstance(name, str) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise ConfigError(f"expected: {name!r} -> {shape!r} is not a parameter name -> shape")
        manifest[name] = dims
    return manifest


@dataclass
class StagedUpdate:
    """A decoded and fully validated update that has not touched the receiver yet.

    Made by :meth:`DeltaReceiver.stage`, applied by :meth:`DeltaReceiver.apply`. In between,
    :meth:`tensor` gives the new full value of any changed parameter, so a server can hand
    the new weights to its engine before the receiver commits.
    """

    from_version: int | None
    """The receiver's version when this was staged."""
    from_fingerprint: str | None
    version: int
    """The version this update brings the state to."""
    fingerprint: str
    """The fingerprint of the state after it, already checked."""
    kind: str
    """"anchor" (the newest anchor was loaded, then deltas replayed), "delta" (deltas replayed
    on the receiver's own state) or "none" (already at that version)."""
    versions: list[int] = field(default_factory=list)
    """The versions whose files were read."""
    nbytes: int = 0
    """Bytes downloaded."""
    seconds: float = 0.0
    """Time spent downloading, decoding and validating."""
    anchor_metadata: dict[str, str] = field(default_factory=dict)
    """For an update that loaded an anchor: the anchor's ``x-`` metadata keys (as
    :attr:`DeltaPublisher.anchor_metadata <deltasync.DeltaPublisher.anchor_metadata>` wrote
    them), from the same checked read as its tensors; empty otherwise."""
    healed: Heal | None = None
    """Set when the deltas on the receiver's state could not be used (a delta file corrupt or
    missing) and this update was built from an anchor instead (``kind`` is then "anchor")."""
    _base: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _patches: dict[str, Patch] = field(default_factory=dict, repr=False)
    _consumed: bool = field(default=False, repr=False)

    @property
    def names(self) -> list[str]:
        """Parameters whose value changes (every parameter after an anchor)."""
        if self.kind == "anchor":
            return list(self._base)
        return [name for name, patch in self._patches.items() if patch.index.numel()]

    @property
    def changed(self) -> int:
        """Elements that differ from the receiver's state (an anchor counts every element)."""
        if self.kind == "anchor":
            return sum(t.numel() for t in self._base.values())
        return sum(p.index.numel() for p in self._patches.values())

    def shape(self, name: str) -> torch.Size:
        """The shape of ``name`` after this update, without building its value."""
        return self._base[name].shape

    def dtype(self, name: str) -> torch.dtype:
        """The element dtype of ``name`` after this update."""
        return self._base[name].dtype

    def tensor(self, name: str) -> torch.Tensor:
        """The new full value of ``name`` (a fresh tensor; the receiver is not touched)."""
        if self._consumed:
            raise VersionError("this staged update was already applied; stage a new one")
        base = self._base[name]
        patch = self._patches.get(name)
        if patch is None:
            return base if self.kind == "anchor" else base.clone()
        out = base.clone()
        patch.write(out.view(-1))
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, new value)`` for every changed parameter, one at a time."""
        for name in self.names:
            yield name, self.tensor(name)


class DeltaReceiver:
    """Keeps an exact bf16 copy of the published weights (or of a quantized view of them) by
    following a bucket.

    With no state, after a gap it cannot bridge, or when its fingerprint disagrees with the
    bucket's, it loads the newest anchor and replays the deltas after it; otherwise it
    replays only the deltas after its own version. Updates are two-phase: :meth:`stage`
    downloads, decodes and validates everything (sizes, checksums, names, dtypes, index
    ranges, base versions, fingerprints), :meth:`apply` then swaps the result in. A failure
    in :meth:`stage` raises a :class:`~deltasync.DeltaSyncError` and changes nothing.

    Every anchor is checked against a manifest (parameter names and shapes): ``expected``
    when given, else the first anchor the receiver loads. An anchor whose names, shapes or
    element counts differ is refused, so a rewritten bucket cannot reshape a parameter or
    slip in an extra one (the fingerprint hashes flat elements, not shapes).

    Args:
        bucket: a path, URL or :class:`~deltasync.stores.Store` (fixed for the receiver's life).
        expected: the parameters the receiver must serve, name -> shape (e.g. from the
            checkpoint a server started with, or ``{n: p.shape for n, p in model.named_parameters()}``).
        max_attempts: how many times :meth:`stage` starts over from the newest pointer when
            files vanish under it (a new anchor retired them while it read).
        view: follow this quantized view of the bucket (``"FP8_DYNAMIC"``; its chain in
            ``views/<view>/``) instead of the bf16 chain. Its state holds the codes and scales
            of the quantized layers and every other parameter in bf16; codes and scales that
            a view cannot hold (a NaN code, a NaN, infinite or zero scale) are refused, and so
            is a chain that is not this view (another scheme's, the bf16 chain, a tensor whose
            dtype or shape does not fit the scheme). Without ``view`` a view's chain is refused.
    """

    def __init__(
        self,
        bucket: str | os.PathLike[str] | Store,
        *,
        expected: Mapping[str, tuple[int, ...] | torch.Size] | None = None,
        max_attempts: int = _MAX_ATTEMPTS,
        view: str | None = None,
    ) -> None:
        self.view = view
        """The quantized view followed (None: the bf16 chain)."""
        self.store = open_store(bucket) if view is None else sub_store(open_store(bucket), view_prefix(view))
        self._state: dict[str, torch.Tensor] = {}
        self._version: int | None = None
        self._fingerprint: str | None = None
        self._manifest: dict[str, tuple[int, ...]] | None = _manifest(expected)
        if max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {max_attempts}")
        self.max_attempts = max_attempts
        self._offered: Pointer | None = None

    @property
    def manifest(self) -> dict[str, tuple[int, ...]] | None:
        """The names and shapes every anchor must have (None until known)."""
        return None if self._manifest is None else dict(self._manifest)

    @property
    def version(self) -> int | None:
        """The version the state is at, or None before the first sync."""
        return self._version

    @property
    def fingerprint(self) -> str | None:
        """The fingerprint of the state, or None before the first sync."""
        return self._fingerprint

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> bf16 CPU tensor. The tensors are the receiver's own: don't modify."""
        return dict(self._state)

    def verify(self) -> bool:
        """Rehash the whole state: does it still match the fingerprint of its version?"""
        return self._fingerprint is not None and fingerprint(self._state) == self._fingerprint

    def fresh(self) -> DeltaReceiver:
        """A receiver of the same chain (bucket and view) with no state."""
        other = DeltaReceiver(self.store, max_attempts=self.max_attempts)
        other.view = self.view  # self.store is already the view's folder
        return other

    def pointer(self) -> Pointer:
        """The bucket's committed pointer (the one offered, once, where one was: :meth:`offer_pointer`)."""
        offered, self._offered = self._offered, None
        return offered if offered is not None else read_pointer(self.store)

    def offer_pointer(self, data: bytes | None) -> Pointer | None:
        """Take the committed pointer as someone else just read it from this chain (a follower's
        :class:`~deltasync.reader.PointerWatch`), so that this receiver does not read it again:
        :meth:`latest` answers from it, and the next :meth:`pointer` or :meth:`stage` starts from
        it (once). The bytes are parsed and checked as a read of the bucket's are, so a wrong or
        hostile pointer is refused the same way. A stage that finds a file gone reads the
        bucket's pointer afresh, as always. None forgets an offer not used yet."""
        self._offered = None
        if data is None:
            return None
        where = f"{self.store.url}/{POINTER_PATH}"
        if len(data) > MAX_POINTER_BYTES:
            raise FormatError(f"{where}: the pointer offered is {len(data)} bytes, more than {MAX_POINTER_BYTES}")
        self._offered = Pointer.from_bytes(data, where=where)
        return self._offered

    def latest(self) -> int:
        """The newest committed version (that of the pointer offered, where one was)."""
        offered = self._offered
        return offered.version if offered is not None else read_pointer(self.store).version

    # ------------------------------------------------------------------ sync

    def sync(self, version: int | None = None) -> int:
        """Bring the state to ``version`` (default: the newest committed); return the version."""
        self.apply(self.stage(version))
        assert self._version is not None
        return self._version

    def stage(self, version: int | None = None) -> StagedUpdate:
        """Download, decode and validate the update to ``version``; change nothing.

        When the deltas on the receiver's own state fail (a file corrupt or missing) and an
        anchor can replace them, the update is built from the anchor instead: it is exact, and
        :attr:`StagedUpdate.healed` (and a warning naming the file) says what was wrong."""
        offered = self._offered
        if offered is not None and version is not None and version > offered.version:
            self._offered = None  # the offer is older than the version asked for: read the bucket's
        pointer = self.pointer()
        try:
            for attempt in range(1, self.max_attempts + 1):
                try:
                    return self._stage(pointer, version)
                except NotFoundError:
                    # A new anchor may have been committed and older files retired while we
                    # read: start over from the newest pointer, as long as the bucket moves.
                    newer = read_pointer(self.store)
                    if newer == pointer or attempt == self.max_attempts:
                        raise
                    pointer = newer
            raise AssertionError("unreachable")
        except (IntegrityError, NotFoundError) as exc:
            target = pointer.version if version is None else version
            anchor = pointer.anchor_for(target)
            if not pointer.replays_from(self._version, self._fingerprint) or anchor is None:
                raise  # no anchor at or below the target to rebuild from: the file's own error says why
            if isinstance(exc, NotFoundError) and (self._version is None or anchor.version <= self._version):
                raise  # the anchor's route needs the same deltas: the missing file's own error says why
            # Replaying on our own state failed: the file is corrupt or missing, or its check
            # failed because our copy is wrong. Rebuild from the anchor; if that fails too, the
            # bucket is at fault and that error is raised.
            staged = self._stage(pointer, version, from_anchor=True)
            staged.healed = Heal(version=staged.version, anchor=anchor.version, error=f"{type(exc).__name__}: {exc}",
                                 time=time.time())  # fmt: skip
            logger.warning("deltasync: version %d built from anchor %d instead of its deltas: %s",
                           staged.version, anchor.version, staged.healed.error)  # fmt: skip
            return staged

    def apply(self, staged: StagedUpdate) -> list[str]:
        """Swap a staged update in; returns the names of the parameters that changed."""
        if staged._consumed:
            raise VersionError("this staged update was already applied; stage a new one")
        if staged.from_version != self._version or staged.from_fingerprint != self._fingerprint:
            raise VersionError(
                f"the update to version {staged.version} was staged at version {staged.from_version}, "
                f"but the receiver is now at version {self._version}; stage it again"
            )
        names = staged.names
        if staged.kind == "anchor":
            self._state = staged._base
            if self._manifest is None:
                self._manifest = {n: tuple(t.shape) for n, t in staged._base.items()}
        for name, patch in staged._patches.items():
            patch.write(self._state[name].view(-1))
        self._version, self._fingerprint = staged.version, staged.fingerprint
        staged._consumed = True
        return names

    # ------------------------------------------------------------------ staging

    def _stage(self, pointer: Pointer, version: int | None, *, from_anchor: bool = False) -> StagedUpdate:
        start = time.perf_counter()
        reader = ChainReader(self.store, pointer, view=self.view)
        url = self.store.url
        target = reader.target(version)
        if self._version is not None and target < self._version:
            raise VersionError(
                f"version {target} is older than the receiver's version {self._version}; versions only move forward"
            )
        own = not from_anchor and pointer.replays_from(self._version, self._fingerprint)
        anchor = None if own else pointer.anchor_for(target)
        if not own and anchor is None:
            oldest = pointer.anchors[0].version
            raise VersionError(
                f"version {target} is older than every anchor in {url} (the oldest is {oldest}) and "
                f"the receiver cannot reach it by deltas; sync to a version in {oldest}..{pointer.version}"
            )
        if self._manifest is not None:
            elements = sum(math.prod(shape) for shape in self._manifest.values())
            if pointer.total != elements:  # refused before a byte of the chain is read
                if self.view is None and not pointer.view:
                    why = "another model's weights, or a rewritten pointer"
                else:  # name the chain asked for and the one found
                    found = (f"view {pointer.view.get('scheme', '(unnamed)')}" if pointer.view
                             else "no view (the bf16 chain, or a view written before views named themselves)")  # fmt: skip
                    asked = "the bf16 chain" if self.view is None else f"view {self.view}"
                    why = f"{asked} was asked for, the pointer names {found}"
                raise FormatError(
                    f"{url}/{POINTER_PATH}: the bucket's state has {pointer.total} elements, the receiver "
                    f"serves {elements} ({why})"
                )
        if own and pointer.manifest is not None and self._state:
            mine = tensors_manifest(self._state)
            if mine != pointer.manifest:  # refused before a byte of the chain is read
                raise IntegrityError(
                    f"{url}/{POINTER_PATH}: the bucket's state has manifest {pointer.manifest}, the receiver holds "
                    f"{mine} (other parameter names, shapes or dtypes: another model's weights, or a rewritten pointer)"
                )
        staged = StagedUpdate(
            from_version=self._version,
            from_fingerprint=self._fingerprint,
            version=target,
            fingerprint=self._fingerprint or "",
            kind="delta" if own else "anchor",
        )
        if own and target == self._version:
            staged.kind = "none"
            return staged
        if own:
            staged._base = self._state
            first = self._version + 1  # type: ignore[operator]
        else:
            assert anchor is not None
            loaded = reader.anchor(anchor)
            self._check_manifest(loaded.tensors, reader.where(anchor))
            staged._base = loaded.tensors
            staged.fingerprint = loaded.header.fingerprint
            staged.anchor_metadata = loaded.metadata
            staged.versions.append(anchor.version)
            staged.nbytes += loaded.nbytes
            first = anchor.version + 1
        base = staged._base
        dtypes = None if all(t.dtype == torch.bfloat16 for t in base.values()) else {n: t.dtype for n, t in base.items()}
        overlay = Overlay(lambda name, index: (None, read_lanes(base[name].view(-1), index)), dtypes)
        staged._patches = overlay.patches
        numels = {name: t.numel() for name, t in base.items()}
        for step in reader.deltas(first, target, overlay, numels=numels):
            if step.header.base_fingerprint != staged.fingerprint:
                raise IntegrityError(
                    f"{step.where}: applies to a state with fingerprint {step.header.base_fingerprint}, but the "
                    f"state at version {step.entry.version - 1} has {staged.fingerprint}"
                )
            moves = ((name, m.index, m.old.view(torch.bfloat16), m.new.view(torch.bfloat16)) for name, m in step.moves.items())
            fp = staged.fingerprint = fingerprint_add(staged.fingerprint, fingerprint_moves(moves))
            if fp != step.header.fingerprint:
                raise IntegrityError(
                    f"{step.where}: applying it gives fingerprint {fp}, the file says "
                    f"{step.header.fingerprint} (corrupted values or a wrong base state)"
                )
            staged.versions.append(step.entry.version)
            staged.nbytes += step.nbytes
        staged.seconds = time.perf_counter() - start
        return staged

    def _check_manifest(self, tensors: Mapping[str, torch.Tensor], where: str) -> None:
        """Refuse an anchor whose parameter names or shapes differ from the manifest's."""
        manifest = self._manifest
        if manifest is None:
            return
        missing = sorted(set(manifest) - set(tensors))
        extra = sorted(set(tensors) - set(manifest))
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"lacks {len(missing)} expected parameter(s) (e.g. {missing[0]!r})")
            if extra:
                parts.append(f"holds {len(extra)} unexpected parameter(s) (e.g. {extra[0]!r})")
            raise FormatError(
                f"{where}: {'; '.join(parts)}; the receiver serves {len(manifest)} parameters "
                "(the bucket holds another model's weights, or was rewritten)"
            )
        for name in sorted(manifest):
            shape = tuple(tensors[name].shape)
            if shape != manifest[name]:
                raise FormatError(
                    f"{where}: parameter {name!r} has shape {list(shape)}, the receiver serves "
                    f"{list(manifest[name])}"
                )
