"""A quantized view's chain, kept beside the bf16 chain by the publisher.

A *view* is the policy as a quantized rollout server holds it: for every weight the scheme
quantizes (:mod:`deltasync.views`), its codes (``<module>.weight``, ``float8_e4m3fn`` or
``int8``) and its scales (``<module>.weight_scale``, bf16), and every other parameter in bf16,
all under the checkpoint names a compressed-tensors checkpoint of the scheme uses. Version
``N`` of a view is, bit for bit, the scheme's quantization of version ``N`` of the bf16 chain.

Each view is an exact chain of its own, in the folder ``views/<SCHEME>/`` of the bucket
(:data:`VIEWS_PREFIX`): a pointer, anchors and deltas in the same format as the bf16 chain's
(docs/protocol.md, "Quantized views"), so every reader of a chain reads a view. Its deltas hold
the codes and scales that changed; its anchors are written at the versions the bf16 chain
anchors. The publisher keeps the view's last published codes and scales to diff against (one
byte per quantized weight element plus the scales); the view's bf16 parameters take their
changes from the bf16 chain's detection, and their values from its snapshot.

The bf16 chain commits first. A view that fails to write a version never fails the trainer:
the failure is reported with the next result, and the view starts a new chain (an anchor) at
the next version, so its readers rebuild from there.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from ._errors import ConfigError, IntegrityError
from ._fingerprint import fingerprint_slice_share, fingerprint_update, format_fingerprint
from .format import (
    POINTER_PATH,
    AnchorSource,
    ChainEntry,
    Change,
    Pointer,
    anchor_path,
    anchor_stream,
    delta_path,
    manifest_digest,
    encode_delta,
    sha256_hex,
    view_prefix,
)
from .stores import write_stream
from .stores._sub import sub_store

if TYPE_CHECKING:
    from .stores import Store
    from .views import ViewScheme

__all__ = ["ViewChain", "view_tensor_names", "read_view_config", "CONFIG_KEY", "VIEW_KEY"]

logger = logging.getLogger("deltasync")

CONFIG_KEY = "x-quantization-config"
"""The anchor metadata key holding the view's ``quantization_config`` (JSON)."""
VIEW_KEY = "x-view"
"""The anchor metadata key naming the view."""


def view_tensor_names(name: str, suffixes: list[str]) -> dict[str, str]:
    """Suffix of a quantized layer's tensors (``"weight"``, ``"weight_scale"``) -> the view's
    name for it, from the bf16 weight's checkpoint name ``<module>.weight``."""
    module = name[: -len("weight")]
    return {suffix: module + suffix for suffix in suffixes}


@dataclass
class _Head:
    """The view chain as committed: its pointer and where it stands."""

    pointer: Pointer
    version: int
    fingerprint: str
    total: int


class ViewChain:
    """One view's chain: quantizes the bf16 chain's versions and commits them in its folder.

    Made by :class:`~deltasync.DeltaPublisher` for each name in ``PublishOptions.views``, on a
    single writer (see :meth:`check_layout`); driven from the publisher's background thread,
    one version at a time, after the bf16 chain committed it.

    Args:
        parent: the bucket.
        scheme: the view's scheme.
        targets: checkpoint names of the bf16 weights the scheme quantizes (2-D).
        shapes: every checkpoint name of the bf16 chain -> its shape.
        ignore: the ignore list (written into the view's ``quantization_config``).
        codec, level: the delta codec (as the bf16 chain's).
        keep_anchors: complete anchors to keep (as the bf16 chain's).
    """

    def __init__(
        self,
        parent: Store,
        scheme: ViewScheme,
        *,
        targets: set[str],
        shapes: Mapping[str, tuple[int, ...]],
        ignore: tuple[str, ...],
        codec: str,
        level: int | None,
        keep_anchors: int,
    ) -> None:
        self.scheme = scheme
        self.name = scheme.name
        self.store = sub_store(parent, view_prefix(scheme.name))
        self.targets = targets
        self.shapes = dict(shapes)
        self.config = scheme.quantization_config(list(ignore))
        self.codec, self.level, self.keep_anchors = codec, level, keep_anchors
        self.quantized: dict[str, dict[str, torch.Tensor]] = {}
        """Target name -> the last published tensors of its layer, by suffix."""
        self.head: _Head | None = None
        self.broken = False
        """A version failed to commit: the next version starts a new chain (an anchor)."""

    # ------------------------------------------------------------------ what a view holds

    @property
    def metadata(self) -> dict[str, str]:
        """The ``x-`` metadata of every anchor of the view."""
        return {VIEW_KEY: self.name, CONFIG_KEY: json.dumps(self.config, sort_keys=True)}

    def _quantize(self, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.scheme.quantize(weight)
        if "weight" not in out:
            raise ConfigError(f"scheme {self.name} gave no codes for {name!r}")
        return out

    def sources(self, value: Callable[[str], torch.Tensor]) -> list[AnchorSource]:
        """The full view state as anchor sources: every target quantized now from
        ``value(name)`` (the bf16 checkpoint tensor of a name, at the version) and kept in
        :attr:`quantized`; every other parameter read from ``value`` when streamed."""
        sources: list[AnchorSource] = []
        for name, shape in self.shapes.items():
            if name in self.targets:
                layer = self._quantize(name, value(name))
                self.quantized[name] = layer
                for suffix, key in view_tensor_names(name, list(layer)).items():
                    t = layer[suffix]
                    sources.append(AnchorSource(key, tuple(t.shape), 0, t.numel(), lambda t=t: (t.reshape(-1),), t.dtype))
            else:
                chunks = lambda name=name: (value(name).reshape(-1),)  # noqa: E731
                sources.append(AnchorSource(name, tuple(shape), 0, math.prod(shape), chunks, torch.bfloat16))
        return sources

    # ------------------------------------------------------------------ versions

    def publish_anchor(self, version: int, value: Callable[[str], torch.Tensor], *, new_chain: bool) -> ChainEntry:
        """Write and commit an anchor of ``version`` (a new chain when ``new_chain`` or the view
        has none yet, else beside the deltas). ``value`` as in :meth:`state`."""
        quantized_before = self.quantized
        self.quantized = {}
        try:
            sources = self.sources(value)
            share = 0
            for source in sources:
                for chunk in source.chunks():
                    share += fingerprint_slice_share(source.name, chunk, 0)
            fp = format_fingerprint(share)
            if self.head is not None and not new_chain and not self.broken and fp != self.head.fingerprint:
                raise IntegrityError(
                    f"view {self.name}: the anchor of version {version} hashes to {fp}, its chain says "
                    f"{self.head.fingerprint} (the snapshot is not the published state)"
                )
            total = sum(s.end for s in sources)
            path = anchor_path(version)
            manifest = manifest_digest((s.name, s.shape, s.dtype) for s in sources)
            stream = anchor_stream(
                sources, version=version, fingerprint=fp, total=total, extra_metadata=self.metadata, manifest=manifest
            )
            nbytes, digest = write_stream(self.store, path, stream)
            entry = ChainEntry(
                version=version, kind="anchor", path=path, nbytes=nbytes, sha256=digest, fingerprint=fp, changed=total
            )
            if self.head is None or new_chain or self.broken:
                pointer = Pointer.start(entry, total=total, manifest=manifest)
                self._commit(pointer)
                self.head = _Head(pointer, version, fp, total)
            else:
                pointer = self.head.pointer.with_anchor(entry, self.keep_anchors)
                self._commit(pointer)
                self.head.pointer = pointer
            self.broken = False
        except BaseException:
            self.quantized = quantized_before
            self.broken = True
            raise
        self._retain()
        return entry

    def publish_delta(
        self, version: int, changes: Mapping[str, Change], value: Callable[[str], torch.Tensor]
    ) -> ChainEntry | None:
        """Write and commit the delta to ``version`` from the bf16 chain's ``changes`` to it
        (checkpoint layout, with old values); ``value(name)`` gives a changed target's bf16
        tensor at ``version``. Returns None when the view needs a new chain (the caller then
        writes an anchor)."""
        head = self.head
        if head is None or self.broken or head.version != version - 1:
            return None
        view_changes: dict[str, Change] = {}
        new_layers: dict[str, dict[str, torch.Tensor]] = {}
        for name, change in changes.items():
            if not change.index.numel():
                continue
            if name not in self.targets:
                view_changes[name] = change
                continue
            layer = self._quantize(name, value(name))
            before = self.quantized[name]
            new_layers[name] = layer
            for suffix, key in view_tensor_names(name, list(layer)).items():
                moved = _diff(before[suffix], layer[suffix])
                if moved is not None:
                    view_changes[key] = moved
        fp = head.fingerprint
        for key, change in view_changes.items():
            assert change.old is not None
            fp = fingerprint_update(fp, key, change.index, change.old, change.new)
        numels = {key: math.prod(shape) for key, shape in self._view_shapes().items()}
        data = encode_delta(
            view_changes, version=version, anchor=head.pointer.root, codec=self.codec, total=head.total,
            fingerprint=fp, base_fingerprint=head.fingerprint, level=self.level, numels=numels,
            manifest=head.pointer.manifest,
        )
        path = delta_path(version)
        try:
            self.store.write_bytes(path, data)
            entry = ChainEntry(
                version=version, kind="delta", path=path, nbytes=len(data), sha256=sha256_hex(data), fingerprint=fp,
                changed=sum(c.index.numel() for c in view_changes.values()),
            )
            pointer = replace(head.pointer, version=version, fingerprint=fp, chain=(*head.pointer.chain, entry))
            self._commit(pointer)
        except BaseException:
            self.broken = True
            raise
        self.quantized.update(new_layers)
        self.head = _Head(pointer, version, fp, head.total)
        return entry

    def _view_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in self.shapes.items():
            layer = self.quantized.get(name)
            if layer is None:
                shapes[name] = shape
            else:
                for suffix, key in view_tensor_names(name, list(layer)).items():
                    shapes[key] = tuple(layer[suffix].shape)
        return shapes

    def _commit(self, pointer: Pointer) -> None:
        self.store.write_bytes(POINTER_PATH, pointer.to_bytes())

    def _retain(self) -> None:
        """Delete the view's data files its pointer no longer needs (never raises)."""
        head = self.head
        if head is None:
            return
        try:
            stale = head.pointer.stale([*self.store.list("anchors/"), *self.store.list("deltas/")])
            if stale:
                self.store.delete(stale)
        except Exception as exc:  # noqa: BLE001 - housekeeping never fails a publish
            logger.warning("deltasync: view %s: retention failed, old files are left: %s", self.name, exc)


def _diff(old: torch.Tensor, new: torch.Tensor) -> Change | None:
    """The elements whose bits differ between two tensors of one element dtype, as a Change."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise AssertionError(f"a quantized tensor changed shape or dtype: {tuple(old.shape)} {old.dtype} -> {tuple(new.shape)} {new.dtype}")
    o, n = old.reshape(-1), new.reshape(-1)
    width = torch.int16 if o.dtype == torch.bfloat16 else torch.uint8
    index = torch.nonzero(o.view(width) != n.view(width)).reshape(-1)
    if not index.numel():
        return None
    return Change(index=index, new=n[index], old=o[index])


def read_view_config(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The ``quantization_config`` an anchor of a view carries (None for the bf16 chain)."""
    raw = metadata.get(CONFIG_KEY)
    return None if raw is None else json.loads(raw)

