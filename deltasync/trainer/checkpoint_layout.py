"""Where each element of a live (in-memory) parameter sits in the checkpoint ``save_pretrained`` writes.

transformers 5 holds some weights in another layout than its checkpoints: MoE experts are
fused (Qwen3-MoE's ``mlp.experts.gate_up_proj`` of shape ``(experts, 2 * inter, hidden)`` is
``mlp.experts.{e}.gate_proj.weight`` and ``up_proj.weight`` per expert on disk), some names
differ (Mixtral's ``mlp`` is ``block_sparse_moe``). Loading converts and ``save_pretrained``
converts back, through the model's weight-conversion mapping
(``transformers.core_model_loading.revert_weight_conversion``). Servers load checkpoints, so
versions are published in checkpoint layout.

The layout is derived from that same machinery, with no table per architecture: the reverse
conversion is run on index tensors (each element holds its own flat position), and every
checkpoint tensor that comes out is fitted exactly as a strided view of one live parameter
(offset and one step per dimension; a transpose is a permutation of the steps). With that a
sparse index into a live parameter maps to ``(checkpoint name, index)`` and back in
O(changed), and an anchor streams each checkpoint tensor from the live layout. Layers with
the same names (up to their numbers) and shapes share one index run.

This module imports transformers only for models that are transformers models.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..errors import ConfigError
from ..format import Change
from ..format.fingerprint import fingerprint_moves, fingerprint_runs_move
from .sharded import OwnedSlice, ShardLayout

__all__ = ["CheckpointLayout", "Piece", "checkpoint_layout", "find_pretrained"]

_CHUNK = 1 << 20
_MASK = (1 << 64) - 1
_DIGITS = re.compile(r"(?<=\.)\d+(?=\.|$)")


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor as a strided view of one live parameter's flat elements: checkpoint
    element ``c`` (a multi-index of ``shape``) is live flat element ``offset + sum(c[d] * steps[d])``."""

    name: str
    """The checkpoint name."""
    source: str
    """The live parameter's (checkpoint-style, wrapper-free) name."""
    shape: tuple[int, ...]
    offset: int
    steps: tuple[int, ...]
    contiguous: bool = field(init=False, repr=False, compare=False)
    """The checkpoint tensor is the live range ``offset .. offset + numel - 1`` in order (kept:
    a version of a MoE checkpoint asks it of every expert's tensor)."""

    def __post_init__(self) -> None:
        contiguous = all(s == c for s, c, n in zip(self.steps, _row_major(self.shape), self.shape) if n > 1)
        object.__setattr__(self, "contiguous", contiguous)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def span(self) -> tuple[int, int]:
        """The live flat range the piece covers (densely: checked when the layout is built)."""
        return self.offset, self.offset + self.numel

    def to_checkpoint(self, live: torch.Tensor) -> torch.Tensor:
        """Checkpoint flat indices of live flat indices ``live`` (all inside :attr:`span`)."""
        rest = live - self.offset
        if self.contiguous:
            return rest
        out = torch.zeros_like(rest)
        for dim in sorted((d for d, n in enumerate(self.shape) if n > 1), key=lambda d: -self.steps[d]):
            out += (rest // self.steps[dim]) * _row_major(self.shape)[dim]
            rest = rest % self.steps[dim]
        return out

    def to_live(self, index: torch.Tensor) -> torch.Tensor:
        """Live flat indices of checkpoint flat indices ``index``."""
        if self.contiguous:
            return index + self.offset
        out = torch.full_like(index, self.offset)
        for dim, (n, row) in enumerate(zip(self.shape, _row_major(self.shape))):
            if n > 1:
                out += ((index // row) % n) * self.steps[dim]
        return out

    def view(self, flat: torch.Tensor, begin: int) -> torch.Tensor:
        """The piece as a tensor of its checkpoint shape, viewing ``flat`` (live flat elements
        ``begin ..``, e.g. a rank's shard or the detector's snapshot of it)."""
        return flat.as_strided(self.shape, self.steps, flat.storage_offset() + self.offset - begin)


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    steps, step = [], 1
    for n in reversed(shape):
        steps.append(step)
        step *= n
    return tuple(reversed(steps))


class CheckpointLayout:
    """The checkpoint tensors of every live parameter (identity pieces where nothing converts).

    Args:
        pieces: every checkpoint tensor, as :class:`Piece` of the live parameter it comes from.
    """

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self.pieces: dict[str, Piece] = {p.name: p for p in sorted(pieces, key=lambda p: p.name)}
        """Checkpoint name -> its piece, sorted by name."""
        by_source: dict[str, list[Piece]] = {}
        for piece in pieces:
            by_source.setdefault(piece.source, []).append(piece)
        self._by_source = {name: sorted(found, key=lambda p: p.offset) for name, found in by_source.items()}
        self._begins = {name: torch.tensor([p.offset for p in found]) for name, found in self._by_source.items()}
        self._contiguous = {name: all(p.contiguous for p in found) for name, found in self._by_source.items()}
        self.identity = all(p.name == p.source and p.contiguous for p in pieces)
        """Every checkpoint tensor is a live parameter, as it is (nothing to convert)."""

    def of(self, source: str) -> list[Piece]:
        """The pieces of live parameter ``source``, in live order."""
        return self._by_source[source]

    @property
    def numels(self) -> dict[str, int]:
        return {name: p.numel for name, p in self.pieces.items()}

    # -------------------------------------------------------------- indices

    def to_checkpoint(self, changes: dict[str, Change]) -> dict[str, Change]:
        """Live-named changes as the checkpoint's: names, flat indices (sorted) and values."""
        if self.identity:
            return changes
        out: dict[str, Change] = {}
        for source, change in changes.items():
            pieces = self._by_source[source]
            if len(pieces) == 1 and pieces[0].contiguous and pieces[0].offset == 0:
                out[pieces[0].name] = change
                continue
            # Changes are sorted by live index, and pieces cover disjoint live ranges.
            begins = self._begins[source]
            which = torch.searchsorted(begins, change.index, right=True) - 1
            bounds = torch.searchsorted(which, torch.arange(len(pieces) + 1)).tolist()
            # A contiguous piece's indices are the live ones less its offset: made for all the
            # pieces at once (a fused MoE parameter holds hundreds), then sliced.
            shifted = change.index - begins[which] if self._contiguous[source] else None
            for k, piece in enumerate(pieces):
                lo, hi = bounds[k], bounds[k + 1]
                if hi == lo:
                    continue
                index = shifted[lo:hi] if shifted is not None else piece.to_checkpoint(change.index[lo:hi])
                new, old = change.new[lo:hi], None if change.old is None else change.old[lo:hi]
                if not piece.contiguous:
                    index, order = torch.sort(index)
                    new = new[order]
                    old = None if old is None else old[order]
                out[piece.name] = Change(index=index, new=new, old=old)
        return out

    def fingerprint_move(self, changes: dict[str, Change]) -> int:
        """How far live-named changes move the checkpoint's fingerprint (mod 2**64): the
        :func:`~deltasync.format.fingerprint.fingerprint_moves` of :meth:`to_checkpoint`'s
        changes. A live parameter whose checkpoint tensors are all contiguous ranges of it (a
        fused MoE parameter's experts) is hashed in one round, each change keyed with its
        checkpoint tensor's name and index, with no checkpoint change made; the others as
        :meth:`to_checkpoint` splits them."""
        total = 0
        rest: dict[str, Change] = {}
        for source, change in changes.items():
            pieces = self._by_source[source]
            if self.identity or not self._contiguous[source] or change.old is None or change.index.device.type != "cpu":
                rest[source] = change
                continue
            begins = self._begins[source]
            which = torch.searchsorted(begins, change.index, right=True) - 1
            counts = torch.bincount(which, minlength=len(pieces)).tolist()  # runs, in live order
            shifted = change.index - begins[which]
            total += fingerprint_runs_move([p.name for p in pieces], counts, shifted, change.old, change.new)
        if rest:
            total += fingerprint_moves((n, c.index, c.old, c.new) for n, c in self.to_checkpoint(rest).items())
        return total & _MASK

    def to_live(self, changes: dict[str, Change]) -> dict[str, Change]:
        """Checkpoint-named changes back on the live parameters (the inverse of :meth:`to_checkpoint`)."""
        if self.identity:
            return changes
        parts: dict[str, list[tuple[torch.Tensor, Change]]] = {}
        for name, change in changes.items():
            piece = self.pieces[name]
            parts.setdefault(piece.source, []).append((piece.to_live(change.index), change))
        out: dict[str, Change] = {}
        for source, found in parts.items():
            index = torch.cat([i for i, _ in found])
            new = torch.cat([c.new for _, c in found])
            olds = [c.old for _, c in found]
            old = None if any(o is None for o in olds) else torch.cat(olds)  # type: ignore[arg-type]
            index, order = torch.sort(index)
            out[source] = Change(index=index, new=new[order], old=None if old is None else old[order])
        return out

    # -------------------------------------------------------------- ranks and anchors

    def owned(self, layout: ShardLayout) -> ShardLayout:
        """``layout`` (what each rank owns of the live parameters) in checkpoint tensors: a rank
        owns the part of each checkpoint tensor that lies in its live range, which must be one
        contiguous range of the checkpoint tensor (a split anchor holds 1-D slices)."""
        slices: dict[str, OwnedSlice] = {}
        for name, piece in self.pieces.items():
            live = layout.slices[piece.source]
            lo, hi = piece.span
            begin, end = max(lo, live.begin), min(hi, live.end)
            if end <= begin:
                slices[name] = OwnedSlice(piece.shape, 0, 0, live.sharded)
            elif (begin, end) == (lo, hi):
                slices[name] = OwnedSlice(piece.shape, 0, piece.numel, live.sharded)
            elif piece.contiguous:
                slices[name] = OwnedSlice(piece.shape, begin - lo, end - lo, live.sharded)
            else:
                raise ConfigError(
                    f"{piece.source!r}: rank {layout.rank} ({layout.description}) holds part of its checkpoint tensor "
                    f"{name!r}, which is stored transposed or strided in memory, so that part is not one range of the "
                    "checkpoint tensor; shard the model so that each rank holds whole checkpoint tensors of it (for fused "
                    "experts: whole experts, e.g. a number of ranks that divides the number of experts)"
                )
        return replace(layout, slices=slices)

    def chunks(self, name: str, flat: torch.Tensor, begin: int, owned: OwnedSlice, size: int = _CHUNK) -> Iterator[torch.Tensor]:
        """The owned elements of checkpoint tensor ``name`` in bf16, in chunks of about ``size``
        elements, read from ``flat`` (the live parameter's flat elements from ``begin`` on: a
        snapshot, or the parameter)."""
        piece = self.pieces[name]
        if owned.end == owned.begin:
            return
        if piece.contiguous:
            lo = piece.offset + owned.begin - begin
            for at in range(lo, lo + owned.end - owned.begin, size):
                yield flat[at : min(at + size, lo + owned.end - owned.begin)].to(torch.bfloat16)
            return
        # Strided (a transpose): owned whole (checked by owned()), gathered a block of rows at a time.
        view = piece.view(flat, begin)
        rows = max(1, size // max(1, piece.numel // piece.shape[0]))
        for row in range(0, piece.shape[0], rows):
            yield view[row : row + rows].to(torch.bfloat16).reshape(-1)


# --------------------------------------------------------------------------- derivation


def find_pretrained(model: Any) -> Any | None:
    """The transformers model in ``model`` (itself, or inside DDP / PEFT), or None."""
    if "transformers" not in sys.modules:
        return None  # nothing can be a transformers model
    from transformers import PreTrainedModel

    modules: Callable[[], Iterator[Any]] | None = getattr(model, "modules", None)
    for module in modules() if modules is not None else ():
        if isinstance(module, PreTrainedModel):
            return module
    return None


def checkpoint_layout(model: Any, named: Sequence[tuple[str, Any]]) -> CheckpointLayout:
    """The checkpoint layout of the live parameters ``named`` (checkpoint-style names, wrapper
    prefixes removed) of ``model``: what ``save_pretrained`` writes for each of their elements.

    Raises :class:`ConfigError` naming the parameter when a checkpoint tensor is not a strided
    view of exactly one live parameter, or a parameter's elements do not land one-to-one.
    """
    shapes = {name: tuple(param.shape) for name, param in named}
    identity = [Piece(n, n, s, 0, _row_major(s)) for n, s in shapes.items()]
    pretrained = find_pretrained(model)
    if pretrained is None or not _has_conversions(pretrained):
        return CheckpointLayout(identity)
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in shapes:
        groups.setdefault(tuple(_DIGITS.findall(name)), []).append(name)
    fitted: dict[tuple[Any, ...], list[tuple[int, int, tuple[int, ...]]]] = {}
    pieces: list[Piece] = []
    for names in groups.values():
        signature = tuple((_DIGITS.sub("#", n), shapes[n]) for n in names)
        outputs = _revert(pretrained, {n: torch.empty(shapes[n], device="meta") for n in names}, names)
        if signature not in fitted:
            fitted[signature] = _fit(pretrained, names, shapes)
        found = fitted[signature]
        if len(found) != len(outputs):  # pragma: no cover - the same conversion on the same shapes
            raise ConfigError(f"{names[0]!r}: the weight conversion of its layer gives another set of tensors than its twin")
        for (ckpt, tensor), (position, offset, steps) in zip(outputs.items(), found):
            pieces.append(Piece(ckpt, names[position], tuple(tensor.shape), offset, steps))
    _check_one_to_one(pieces, shapes)
    return CheckpointLayout(pieces)


def _has_conversions(pretrained: Any) -> bool:
    """Whether ``save_pretrained`` converts anything (as ``revert_weight_conversion`` decides)."""
    if getattr(pretrained, "_weight_conversions", None) is not None:
        return True
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    found = get_model_conversion_mapping(pretrained, add_legacy=False)
    return any(not isinstance(x, PrefixChange) for x in found)


def _revert(pretrained: Any, state: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    from transformers.core_model_loading import revert_weight_conversion

    try:
        out = revert_weight_conversion(pretrained, state)
    except Exception as exc:
        raise ConfigError(
            f"{names[0]!r}: transformers' reverse weight conversion (what save_pretrained runs) failed on the parameters "
            f"of its layer ({len(names)} of them): {type(exc).__name__}: {exc}"
        ) from exc
    return dict(sorted(out.items()))


def _fit(pretrained: Any, names: Sequence[str], shapes: dict[str, tuple[int, ...]]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Run the reverse conversion on index tensors of the parameters ``names`` and fit each
    checkpoint tensor as a strided view of one of them: ``(position in names, offset, steps)``."""
    numels = [math.prod(shapes[n]) for n in names]
    bases = [0]
    for n in numels:
        bases.append(bases[-1] + n)
    dtype = torch.int32 if bases[-1] < 2**31 else torch.int64
    state = {n: torch.arange(bases[k], bases[k + 1], dtype=dtype).view(shapes[n]) for k, n in enumerate(names)}
    out = _revert(pretrained, state, names)
    edges = torch.tensor(bases[1:-1], dtype=torch.int64)
    fits = []
    for ckpt, ids in out.items():
        ids = ids.to(torch.int64)
        if ids.numel() == 0:
            raise ConfigError(f"checkpoint tensor {ckpt!r} is empty after the reverse weight conversion; deltasync cannot place it")
        lowest, highest = int(ids.min()), int(ids.max())
        first, last = (int(torch.searchsorted(edges, v, right=True)) for v in (lowest, highest))
        if first != last:
            raise ConfigError(
                f"checkpoint tensor {ckpt!r} is assembled from several in-memory parameters ({names[first]!r} and "
                f"{names[last]!r}); deltasync maps each checkpoint tensor to one parameter, so this model's layout is "
                "not supported"
            )
        flat = ids.reshape(-1) - bases[first]
        shape = tuple(ids.shape)
        steps = tuple(
            int(flat[row] - flat[0]) if n > 1 else 0 for n, row in zip(shape, _row_major(shape))
        )
        expected = torch.full(shape, int(flat[0]), dtype=torch.int64)
        for dim, (n, step) in enumerate(zip(shape, steps)):
            if n > 1:
                expected += (torch.arange(n, dtype=torch.int64) * step).view([-1 if d == dim else 1 for d in range(len(shape))])
        if any(s < 0 for s in steps) or not torch.equal(expected.reshape(-1), flat):
            raise ConfigError(
                f"{names[first]!r}: its checkpoint tensor {ckpt!r} is not a strided view of it (the weight conversion "
                "permutes elements in another way than splitting, stacking or transposing); this layout is not supported"
            )
        fits.append((first, int(flat[0]), steps))
    return fits


def _check_one_to_one(pieces: Sequence[Piece], shapes: dict[str, tuple[int, ...]]) -> None:
    """Every element of every live parameter lands in exactly one checkpoint tensor."""
    by_source: dict[str, list[Piece]] = {}
    for piece in pieces:
        by_source.setdefault(piece.source, []).append(piece)
    for name, shape in shapes.items():
        found = sorted(by_source.get(name, []), key=lambda p: p.offset)
        numel = math.prod(shape)
        at = 0
        for piece in found:
            dense = sorted((s, n) for s, n in zip(piece.steps, piece.shape) if n > 1)
            step = 1
            for s, n in dense:
                if s != step:
                    break
                step *= n
            else:
                if piece.offset == at:
                    at += piece.numel
                    continue
            raise ConfigError(
                f"{name!r}: its elements do not land one-to-one in checkpoint tensors ({piece.name!r} overlaps another "
                "or leaves gaps); deltasync cannot publish this layout"
            )
        if at != numel:
            raise ConfigError(
                f"{name!r}: {at} of its {numel} elements land in checkpoint tensors"
                + (f" ({', '.join(p.name for p in found[:3])})" if found else " (none: save_pretrained drops it)")
                + "; deltasync publishes every parameter under its checkpoint name"
            )
