"""The server side: follow a bucket's pointer and keep an exact bf16 copy of the weights."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ._errors import ConfigError, FormatError, IntegrityError, NotFoundError, VersionError
from ._fingerprint import fingerprint, fingerprint_update
from .format import (
    MAX_POINTER_BYTES,
    POINTER_PATH,
    ChainEntry,
    Change,
    Pointer,
)
from ._messages import check_version
from ._parts import decode_version, fetch_anchor, fetch_version
from .stores import open_store, read_limited

if TYPE_CHECKING:
    import os

    from .stores import Store

__all__ = ["DeltaReceiver", "StagedUpdate"]

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
class _Patch:
    """Pending new values for one parameter: sorted unique indices and their values."""

    index: torch.Tensor
    values: torch.Tensor

    def merge(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Add a later change; where both touch an element, the later value wins."""
        all_index = torch.cat([self.index, index])
        all_values = torch.cat([_bits(self.values), _bits(values)])  # bit patterns: NaN payloads survive
        order = torch.sort(all_index, stable=True).indices
        all_index, all_values = all_index[order], all_values[order]
        keep = torch.ones_like(all_index, dtype=torch.bool)
        keep[:-1] = all_index[1:] != all_index[:-1]  # the last of each run came last
        self.index, self.values = all_index[keep], all_values[keep].view(torch.bfloat16)

    def lookup(self, base: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Values at ``index`` with this patch laid over ``base`` (flat)."""
        out = _bits(base)[index].clone()
        if self.index.numel():
            pos = torch.searchsorted(self.index, index).clamp(max=self.index.numel() - 1)
            hit = self.index[pos] == index
            # As int16: a bf16 assignment of one element goes through a float scalar, which
            # rewrites NaN payloads.
            out[hit] = _bits(self.values)[pos[hit]]
        return out.view(torch.bfloat16)


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The int16 bit patterns of a bf16 tensor (a view): copies of these are exact."""
    return values.view(torch.int16)


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
    _base: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _patches: dict[str, _Patch] = field(default_factory=dict, repr=False)
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

    def tensor(self, name: str) -> torch.Tensor:
        """The new full value of ``name`` (a fresh tensor; the receiver is not touched)."""
        if self._consumed:
            raise VersionError("this staged update was already applied; stage a new one")
        base = self._base[name]
        patch = self._patches.get(name)
        if patch is None:
            return base if self.kind == "anchor" else base.clone()
        out = base.clone()
        _bits(out.view(-1))[patch.index] = _bits(patch.values)
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, new value)`` for every changed parameter, one at a time."""
        for name in self.names:
            yield name, self.tensor(name)


class DeltaReceiver:
    """Keeps an exact bf16 copy of the published weights by following a bucket.

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
    """

    def __init__(
        self,
        bucket: str | os.PathLike[str] | Store,
        *,
        expected: Mapping[str, tuple[int, ...] | torch.Size] | None = None,
        max_attempts: int = _MAX_ATTEMPTS,
    ) -> None:
        self.store = open_store(bucket)
        self._state: dict[str, torch.Tensor] = {}
        self._version: int | None = None
        self._fingerprint: str | None = None
        self._manifest: dict[str, tuple[int, ...]] | None = _manifest(expected)
        if max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {max_attempts}")
        self.max_attempts = max_attempts

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

    def pointer(self) -> Pointer:
        """The bucket's committed pointer."""
        where = f"{self.store.url}/{POINTER_PATH}"
        try:
            data = read_limited(self.store, POINTER_PATH, MAX_POINTER_BYTES)
        except NotFoundError as exc:
            raise VersionError(f"{where}: no version is committed in this bucket yet") from exc
        return Pointer.from_bytes(data, where=where)

    def latest(self) -> int:
        """The newest committed version."""
        return self.pointer().version

    # ------------------------------------------------------------------ sync

    def sync(self, version: int | None = None) -> int:
        """Bring the state to ``version`` (default: the newest committed); return the version."""
        self.apply(self.stage(version))
        assert self._version is not None
        return self._version

    def stage(self, version: int | None = None) -> StagedUpdate:
        """Download, decode and validate the update to ``version``; change nothing."""
        pointer = self.pointer()
        try:
            for attempt in range(1, self.max_attempts + 1):
                try:
                    return self._stage(pointer, version)
                except NotFoundError:
                    # A new anchor may have been committed and older files retired while we
                    # read: start over from the newest pointer, as long as the bucket moves.
                    newer = self.pointer()
                    if newer == pointer or attempt == self.max_attempts:
                        raise
                    pointer = newer
            raise AssertionError("unreachable")
        except IntegrityError:
            target = pointer.version if version is None else version
            if not pointer.replays_from(self._version, self._fingerprint) or pointer.anchor_for(target) is None:
                raise  # no anchor at or below the target to rebuild from: the file's own error says why
            # Replaying on our own state failed a fingerprint check: the file may be fine and
            # our copy wrong. Rebuild from the anchor; if that fails too, the bucket is at fault.
            return self._stage(pointer, version, from_anchor=True)

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
            if patch.index.numel():
                _bits(self._state[name].view(-1))[patch.index] = _bits(patch.values)
        self._version, self._fingerprint = staged.version, staged.fingerprint
        staged._consumed = True
        return names

    # ------------------------------------------------------------------ staging

    def _stage(self, pointer: Pointer, version: int | None, *, from_anchor: bool = False) -> StagedUpdate:
        start = time.perf_counter()
        url = self.store.url
        target = pointer.version if version is None else version
        check_version(target)
        if target > pointer.version:
            raise VersionError(f"version {target} is not committed in {url} (the newest is {pointer.version})")
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
                raise FormatError(
                    f"{url}/{POINTER_PATH}: the bucket's state has {pointer.total} elements, the receiver "
                    f"serves {elements} (another model's weights, or a rewritten pointer)"
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
            # Streamed from the store straight into the tensors: the encoded file and the
            # decoded tensors are never both in memory.
            where = self._where(anchor)
            header, tensors, nbytes = fetch_anchor(self.store, anchor)
            self._check_header(header, anchor, pointer, where)
            got = fingerprint(tensors)
            if got != header.fingerprint:
                raise IntegrityError(
                    f"{where}: the anchor's tensors hash to {got}, its metadata says {header.fingerprint} "
                    "(the file was altered after it was written)"
                )
            self._check_manifest(tensors, where)
            staged._base = tensors
            staged.fingerprint = got
            staged.versions.append(anchor.version)
            staged.nbytes += nbytes
            first = anchor.version + 1
        numels = {name: t.numel() for name, t in staged._base.items()}
        for v in range(first, target + 1):
            entry = pointer.delta(v)
            files = self._read_version(entry)
            where = self._where(entry)
            header, changes = decode_version(  # type: ignore[assignment]
                files, entry, url=url, numels=numels, base_values=lambda n, i: self._current(staged, n, i)
            )
            self._check_header(header, entry, pointer, where)
            if header.base_fingerprint != staged.fingerprint:
                raise IntegrityError(
                    f"{where}: applies to a state with fingerprint {header.base_fingerprint}, but the state "
                    f"at version {v - 1} has {staged.fingerprint}"
                )
            staged.fingerprint = self._advance(staged, changes)
            if staged.fingerprint != header.fingerprint:
                raise IntegrityError(
                    f"{where}: applying it gives fingerprint {staged.fingerprint}, the file says "
                    f"{header.fingerprint} (corrupted values or a wrong base state)"
                )
            staged.versions.append(v)
            staged.nbytes += sum(map(len, files))
        staged.seconds = time.perf_counter() - start
        return staged

    def _read_version(self, entry: ChainEntry) -> list[bytes]:
        """Every file of a version (one, or one per part), each read with a bound and checked
        against the pointer's size and SHA-256."""
        return fetch_version(self.store, entry)

    def _where(self, entry: ChainEntry) -> str:
        if not entry.parts:
            return f"{self.store.url}/{entry.path} (version {entry.version})"
        return f"{self.store.url}/{entry.kind}s/{entry.version:08d}.part* ({len(entry.parts)} parts of version {entry.version})"

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

    @staticmethod
    def _check_header(header, entry: ChainEntry, pointer: Pointer, where: str) -> None:  # type: ignore[no-untyped-def]
        if header.version != entry.version:
            raise VersionError(f"{where}: the file is version {header.version}, the pointer lists it as {entry.version}")
        if header.kind != entry.kind:
            raise FormatError(f"{where}: the file is a(n) {header.kind}, the pointer lists a(n) {entry.kind}")
        root = entry.version if entry.kind == "anchor" else pointer.root
        if header.anchor != root:
            raise VersionError(f"{where}: descends from anchor {header.anchor}, the pointer's chain grew from {root}")
        if header.fingerprint != entry.fingerprint:
            raise IntegrityError(
                f"{where}: fingerprint {header.fingerprint} in the file, {entry.fingerprint} in the pointer"
            )
        if header.total != pointer.total:
            raise FormatError(f"{where}: says the state has {header.total} elements, the pointer says {pointer.total}")

    @staticmethod
    def _current(staged: StagedUpdate, name: str, index: torch.Tensor) -> torch.Tensor:
        base = staged._base[name].view(-1)
        patch = staged._patches.get(name)
        return _bits(base)[index].view(torch.bfloat16) if patch is None else patch.lookup(base, index)

    def _advance(self, staged: StagedUpdate, changes: dict[str, Change]) -> str:
        fp = staged.fingerprint
        for name, change in changes.items():
            old = self._current(staged, name, change.index)
            fp = fingerprint_update(fp, name, change.index, old, change.new)
            patch = staged._patches.get(name)
            if patch is None:
                staged._patches[name] = _Patch(change.index, change.new)
            else:
                patch.merge(change.index, change.new)
        return fp
