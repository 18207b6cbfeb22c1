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

Under a sharded trainer (FSDP2, HSDP) each writing rank quantizes its own rows and writes one
part of each view version, as it does for the bf16 chain, and rank 0 commits (:class:`ViewChain`
says how block scales cross shard boundaries); under DDP rank 0 alone keeps and writes the view.
A view's files, part entries, agreement of the ranks, history, conditional pointer and
retention are the bf16 chain's code (:class:`~deltasync.trainer.committer.ChainCommitter`):
what is a view's own is here, quantizing, diffing the codes, and its identity in the pointer.
The view's history (``views/<SCHEME>/history.jsonl``) names the publisher's writer at each
version, as the bf16 chain's does.

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

from ..errors import ConfigError, IntegrityError
from ..format import (
    POINTER_PATH,
    AnchorSource,
    ChainEntry,
    Change,
    Pointer,
    delta_pieces,
    manifest_digest,
    view_prefix,
)
from ..format.dtypes import element_type
from ..format.fingerprint import fingerprint_moves, fingerprint_slice_share, format_fingerprint, parse_fingerprint
from ..stores._sub import sub_store
from ..views.identity import ViewIdentity
from .committer import ChainCommitter
from .ownership import PointerFile
from .retention import Retention
from .sharded import ShardLayout

if TYPE_CHECKING:
    from ..format import WriterRecord
    from ..stores import Store
    from ..views import ViewScheme

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


_SUFFIXES = ("weight", "weight_scale")

_ONE_WRITER = ShardLayout(rank=0, world=1, writer=True, part=0, parts=1, description="one writer", slices={})
"""The ranks of a view written one file a version: the writing rank alone."""


class ViewChain:
    """One view's chain: quantizes the bf16 chain's versions and commits them in its folder.

    Made by :class:`~deltasync.DeltaPublisher` for each name in ``PublishOptions.views``;
    driven from the publisher's background thread, one version at a time, after the bf16 chain
    committed it.

    Several trainer processes write a view as they write the bf16 chain (``layout``). With
    one file per version (a single process, DDP, HSDP with one shard) the writing rank alone
    keeps and writes the view, and the other ranks do nothing for it (:attr:`active` is False).
    With one part per shard rank (FSDP2, HSDP) each writing rank quantizes the rows it owns
    (``ViewScheme.quantize_rows``; for block scales the ranks first all-reduce the blocks'
    abs-max), keeps their codes and the scale rows it owns, and writes part ``r`` of every
    anchor and delta; rank 0 commits the view's pointer once every rank wrote. Every step runs
    through :meth:`~deltasync.trainer.sharded.ShardLayout.agree` over ``group``, so a failure on one
    rank fails the version on every rank alike.

    The files, the commits and retention go through :attr:`chain`, the commit sequence the
    bf16 chain's writer shares. The view's pointer is written conditionally, as the bf16
    chain's: on the tag it last wrote (the first commit: the one found then), and read once
    more before a version's files are written. A view whose pointer changed under it stops
    alone (:attr:`stopped`), and says why in each result's warnings.

    Args:
        parent: the bucket.
        scheme: the view's scheme.
        targets: checkpoint names of the bf16 weights the scheme quantizes (2-D).
        shapes: every checkpoint name of the bf16 chain -> its shape.
        ignore: the ignore list (written into the view's ``quantization_config``).
        codec, level: the delta codec (as the bf16 chain's).
        keep_anchors: complete anchors to keep (as the bf16 chain's).
        layout: how the ranks write the bf16 chain, in checkpoint layout (None: one process).
        group: the process group of the publisher's background thread (split layouts).
        writer: the publisher's writer (the bf16 chain's, on rank 0), which the view's history
            names at each version it commits.
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
        layout: ShardLayout | None = None,
        group: Any = None,
        writer: WriterRecord | None = None,
    ) -> None:
        self.scheme = scheme
        self.name = scheme.name
        self.store = sub_store(parent, view_prefix(scheme.name))
        self.targets = targets
        self.shapes = dict(shapes)
        self.config = scheme.quantization_config(list(ignore))
        self.identity = ViewIdentity.of(scheme.name)
        """What identifies the view's chain: in its pointer and in every file's metadata."""
        self.codec, self.level, self.keep_anchors = codec, level, keep_anchors
        self.layout, self.group = layout, group
        self.split = layout is not None and layout.parts > 1
        """One part file per shard rank (FSDP2, HSDP), committed by rank 0."""
        self.active = layout is None or self.split or layout.writer
        """This rank takes part in the view (False on the ranks of a one-file layout that do not write)."""
        self._owned = {name: (0, math.prod(shape)) for name, shape in self.shapes.items()}
        if self.split:
            assert layout is not None
            self._owned = {name: (s.begin, s.end) for name, s in layout.slices.items()}
            for name in sorted(targets):
                begin, end = self._owned[name]
                cols = self.shapes[name][1]
                if begin % cols or end % cols:
                    raise ConfigError(
                        f"view {self.name}: this rank holds elements {begin}..{end - 1} of {name!r} {list(self.shapes[name])}, "
                        "not whole rows; a sharded trainer's views need row shards (Shard(0))"
                    )
        self.quantized: dict[str, dict[str, torch.Tensor]] = {}
        """Target name -> the last published tensors of its layer (this rank's rows), by suffix."""
        self.head: _Head | None = None
        self.broken = False
        """A version failed to commit: the next version starts a new chain (an anchor)."""
        # One file a version: the writing rank alone writes and commits it, as a world of one.
        ranks = layout if self.split and layout is not None else _ONE_WRITER
        owner = PointerFile(self.store, self._changed, writer) if ranks.rank == 0 else None
        self.chain = ChainCommitter(self.store, ranks, owner, label=f"view {self.name}: ")
        """The view's files and commits: the bf16 chain's code, in the view's folder."""
        self._retention = Retention(self.store, self.chain.owned_pointer, 0.0)

    @property
    def stopped(self) -> str | None:
        """Why this view writes nothing more (its pointer changed under it), or None."""
        return None if self.chain.owner is None else self.chain.owner.stopped

    def _changed(self, what: str, exc: Exception | None) -> str:
        return (
            f"view {self.name}: the pointer {self.store.url}/{POINTER_PATH} changed under this writer while "
            f"{what}: another writer commits this view. Nothing was committed, and this view writes nothing more"
            + (f" [{exc}]" if exc is not None else "")
        )

    # ------------------------------------------------------------------ what a view holds

    @property
    def metadata(self) -> dict[str, str]:
        """The ``x-`` metadata of every anchor of the view: its identity and its config."""
        return {**self.identity.metadata(), CONFIG_KEY: json.dumps(self.config, sort_keys=True)}

    def _rows(self, name: str) -> tuple[int, int]:
        """The first row of target ``name`` this rank owns, and how many."""
        begin, end = self._owned[name]
        cols = self.shapes[name][1]
        return begin // cols, (end - begin) // cols

    def _suffix_shapes(self, name: str) -> dict[str, tuple[int, ...]]:
        shape = self.shapes[name]
        return {"weight": tuple(shape), "weight_scale": self.scheme.scale_shape(shape)}

    def _ranges(self, name: str) -> dict[str, tuple[int, int]]:
        """The flat elements of target ``name``'s full view tensors this rank owns, by suffix:
        its rows' codes, and the scale rows of its rows (block: of the blocks whose first row it holds)."""
        begin, end = self._owned[name]
        s0, s1 = self.scheme.scale_rows(*self._rows(name))
        width = self.scheme.scale_shape(self.shapes[name])[1]
        return {"weight": (begin, end), "weight_scale": (s0 * width, s1 * width)}

    def _view_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in self.shapes.items():
            if name in self.targets:
                for suffix, key in view_tensor_names(name, list(_SUFFIXES)).items():
                    shapes[key] = self._suffix_shapes(name)[suffix]
            else:
                shapes[name] = tuple(shape)
        return shapes

    def _local(self, name: str, value: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """This rank's elements of bf16 tensor ``name``, flat (``value`` gives them)."""
        begin, end = self._owned[name]
        if end == begin:
            return torch.empty(0, dtype=torch.bfloat16)
        return value(name).reshape(-1)

    def _quantize(self, name: str, flat: torch.Tensor, amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        shape = self.shapes[name]
        if self.split:
            row0, nrows = self._rows(name)
            out = self.scheme.quantize_rows(flat.view(nrows, shape[1]), row0, shape, block_amax=amax)
        else:
            out = self.scheme.quantize(flat.view(shape))
        if "weight" not in out:
            raise ConfigError(f"scheme {self.name} gave no codes for {name!r}")
        return out

    # ------------------------------------------------------------------ ranks

    def _agree(self, what: str, step: Callable[[], tuple[Any, Any]]) -> tuple[Any, list[Any]]:
        """Run ``step`` (returns ``(result, shared)``); split: on every rank, all failing if one does."""
        return self.chain.agree(what, step, self.group)

    def _block_amax(self, what: str, names: list[str], value: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """Split layouts, block scales: every block's abs-max over all ranks (an all-reduce MAX
        of each rank's :meth:`~deltasync.views.ViewScheme.block_absmax_rows`) for ``names``,
        in the same order on every rank. Empty otherwise."""
        if not self.split or self.scheme.block is None or not names:
            return {}

        def local() -> tuple[torch.Tensor, None]:
            flats = []
            for name in names:
                row0, nrows = self._rows(name)
                rows = self._local(name, value).view(nrows, self.shapes[name][1])
                flats.append(self.scheme.block_absmax_rows(rows, row0, self.shapes[name]).reshape(-1))
            return torch.cat(flats), None

        amax, _ = self._agree(f"the block abs-max of {what}", local)
        import torch.distributed as dist

        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        out, at = {}, 0
        for name in names:
            shape = self.scheme.scale_shape(self.shapes[name])
            out[name] = amax[at : at + math.prod(shape)].view(shape)
            at += math.prod(shape)
        return out

    # ------------------------------------------------------------------ versions

    def _anchor_sources(
        self, value: Callable[[str], torch.Tensor], amax: Mapping[str, torch.Tensor]
    ) -> tuple[list[AnchorSource], dict[str, dict[str, torch.Tensor]]]:
        """This rank's view state as anchor sources (every target quantized now from ``value``,
        every other parameter read from ``value`` when streamed), and the quantized layers."""
        sources: list[AnchorSource] = []
        quantized: dict[str, dict[str, torch.Tensor]] = {}
        for name, shape in self.shapes.items():
            if name in self.targets:
                layer = self._quantize(name, self._local(name, value), amax.get(name))
                quantized[name] = layer
                shapes, ranges = self._suffix_shapes(name), self._ranges(name)
                for suffix, key in view_tensor_names(name, list(layer)).items():
                    t = layer[suffix]
                    begin, end = ranges[suffix]
                    if t.numel() != end - begin:
                        raise AssertionError(f"view {self.name}: {key} has {t.numel()} local values, its slice {end - begin}")
                    sources.append(AnchorSource(key, shapes[suffix], begin, end, lambda t=t: (t.reshape(-1),), t.dtype))  # type: ignore[misc]
            else:
                begin, end = self._owned[name]
                chunks = lambda name=name: (self._local(name, value),)  # noqa: E731
                sources.append(AnchorSource(name, tuple(shape), begin, end, chunks, torch.bfloat16))
        return sources, quantized

    def publish_anchor(self, version: int, value: Callable[[str], torch.Tensor], *, new_chain: bool) -> ChainEntry:
        """Write and commit an anchor of ``version`` (a new chain when ``new_chain`` or the view
        has none yet, else beside the deltas). ``value(name)`` gives this rank's elements of the
        bf16 checkpoint tensor ``name`` at the version (all of it in a single process)."""
        quantized_before = self.quantized
        self.quantized = {}
        try:
            amax = self._block_amax(f"the anchor of version {version}", sorted(self.targets), value)

            def quantize() -> tuple[list[AnchorSource], int]:
                self.chain.check_owner(f"writing the anchor of version {version}")
                sources, self.quantized = self._anchor_sources(value, amax)
                share = 0
                for source in sources:
                    at = source.begin
                    for chunk in source.chunks():
                        share += fingerprint_slice_share(source.name, chunk, at)
                        at += chunk.numel()
                return sources, share

            sources, shares = self._agree(f"quantizing the anchor of version {version}", quantize)
            fp = format_fingerprint(sum(shares))
            if self.head is not None and not new_chain and not self.broken and fp != self.head.fingerprint:
                raise IntegrityError(
                    f"view {self.name}: the anchor of version {version} hashes to {fp}, its chain says "
                    f"{self.head.fingerprint} (the snapshot is not the published state)"
                )
            total = sum(math.prod(shape) for shape in self._view_shapes().values())
            # Every rank lists every tensor (its own slice of each), under its full shape.
            manifest = manifest_digest((s.name, s.shape, s.dtype) for s in sources)
            files = self.chain.anchor_files(
                version, sources, fingerprint=fp, total=total, extra_metadata=self.metadata, manifest=manifest
            )
            # The pointer was checked as the version was quantized.
            entry, _ = self.chain.write_anchor_file(version, fp, files, self.group, check=False)
            head = None if new_chain or self.broken else self.head
            if head is None:
                pointer = Pointer.start(entry, total=total, manifest=manifest, view=self.identity.to_json())
                record: dict[str, object] | None = self.chain.record("anchor", entry, total)
            else:
                pointer, record = head.pointer.with_anchor(entry, self.keep_anchors), None
            self.chain.commit(f"the anchor of version {version}", lambda _: pointer, record, self.group)
            if head is None:
                self.head = _Head(pointer, version, fp, total)
            else:
                head.pointer = pointer
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
        (checkpoint layout, with old values; this rank's); ``value(name)`` gives this rank's
        elements of a target's bf16 tensor at ``version``. Returns None when the view needs a
        new chain (the caller then writes an anchor)."""
        head = self.head
        if head is None or self.broken or head.version != version - 1:
            return None
        try:
            changed = [n for n, c in changes.items() if n in self.targets and c.index.numel()]
            names = changed
            if self.split and self.scheme.block is not None:
                # A changed row moves the scale, hence the codes, of every row of its blocks,
                # which other ranks may hold: every rank requantizes the layers any rank changed.
                _, lists = self._agree(f"the layers changed by version {version}", lambda: (None, changed))
                names = [*changed, *sorted(set().union(*lists) - set(changed))]
            amax = self._block_amax(f"version {version}", sorted(names), value)

            def diff() -> tuple[tuple[dict[str, Change], dict[str, dict[str, torch.Tensor]]], int]:
                self.chain.check_owner(f"writing delta {version}")
                view_changes: dict[str, Change] = {}
                new_layers: dict[str, dict[str, torch.Tensor]] = {}
                requantize = set(names)
                ordered = [n for n, c in changes.items() if c.index.numel()]
                ordered += [n for n in names if n not in changes or not changes[n].index.numel()]
                for name in ordered:
                    if name not in self.targets:
                        view_changes[name] = changes[name]
                        continue
                    if name not in requantize:
                        continue
                    layer = self._quantize(name, self._local(name, value), amax.get(name))
                    before = self.quantized[name]
                    new_layers[name] = layer
                    ranges = self._ranges(name)
                    for suffix, key in view_tensor_names(name, list(layer)).items():
                        moved = _diff(before[suffix], layer[suffix], ranges[suffix][0])
                        if moved is not None:
                            view_changes[key] = moved
                for key, change in view_changes.items():
                    assert change.old is not None, key
                share = fingerprint_moves((k, c.index, c.old, c.new) for k, c in view_changes.items())
                return (view_changes, new_layers), share

            (view_changes, new_layers), shares = self._agree(f"quantizing version {version}", diff)
            fp = format_fingerprint(parse_fingerprint(head.fingerprint) + sum(shares))
            numels = {key: math.prod(shape) for key, shape in self._view_shapes().items()}

            def encode() -> tuple[list[memoryview], int]:
                data = delta_pieces(
                    view_changes, version=version, anchor=head.pointer.root, codec=self.codec, total=head.total,
                    fingerprint=fp, base_fingerprint=head.fingerprint, level=self.level, numels=numels,
                    part=self.chain.part, manifest=head.pointer.manifest, extra_metadata=self.identity.metadata(),
                )  # fmt: skip
                return data, sum(c.index.numel() for c in view_changes.values())

            # The pointer was checked as the version was quantized.
            entry = self.chain.write_delta_file(version, fp, encode, self.group, check=False)
            pointer = replace(head.pointer, version=version, fingerprint=fp, chain=(*head.pointer.chain, entry))
            self.chain.commit(f"version {version}", lambda _: pointer, self.chain.record("delta", entry, head.total), self.group)
        except BaseException:
            self.broken = True
            raise
        self.quantized.update(new_layers)
        self.head = _Head(pointer, version, fp, head.total)
        return entry

    def _retain(self) -> None:
        """Delete the view's data files its pointer no longer needs (rank 0; never raises)."""
        if self.head is None or self.chain.owner is None:
            return
        try:
            self._retention.retain()
        except Exception as exc:  # noqa: BLE001 - housekeeping never fails a publish
            logger.warning("deltasync: view %s: retention failed, old files are left: %s", self.name, exc)


def _diff(old: torch.Tensor, new: torch.Tensor, offset: int = 0) -> Change | None:
    """The elements whose bits differ between two tensors of one element dtype, as a Change
    whose indices are ``offset`` plus the flat index (a shard's place in the full tensor)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise AssertionError(f"a quantized tensor changed shape or dtype: {tuple(old.shape)} {old.dtype} -> {tuple(new.shape)} {new.dtype}")
    o, n = old.reshape(-1), new.reshape(-1)
    width = element_type(o.dtype).raw  # compared as bits: -0.0 and NaN payloads count
    index = torch.nonzero(o.view(width) != n.view(width)).reshape(-1)
    if not index.numel():
        return None
    return Change(index=index + offset if offset else index, new=n[index], old=o[index])


def read_view_config(metadata: Mapping[str, str]) -> dict[str, Any] | None:
    """The ``quantization_config`` an anchor of a view carries (None for the bf16 chain)."""
    raw = metadata.get(CONFIG_KEY)
    return None if raw is None else json.loads(raw)

