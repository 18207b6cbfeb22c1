"""The publisher's quantized views: each bf16 version, carried into every view's own chain.

:class:`ViewPublisher` holds one :class:`~deltasync.trainer.view_chain.ViewChain` per name in
``PublishOptions.views`` and brings each to the version the bf16 chain just committed, from
the same changes and the committed bf16 values. A view never fails the bf16 chain: one that
cannot be written is reported and starts a new chain of its own at the next version.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from .view_chain import ViewChain

if TYPE_CHECKING:
    from ..format import Change, WriterRecord
    from ..stores import Store
    from .checkpoint_layout import CheckpointLayout
    from .detector import BF16ChangeDetector
    from .sharded import ShardLayout
    from .writer import LateWarnings

__all__ = ["ViewPublisher", "check_device_dtype"]


def check_device_dtype(device: torch.device, dtype: torch.dtype, view: str) -> None:
    """A ConfigError unless ``device`` holds and converts to ``dtype`` (a view's codes are
    quantized where the weights are)."""
    try:
        torch.zeros(2, dtype=torch.bfloat16, device=device).to(dtype).view(torch.uint8).sum()
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        raise ConfigError(
            f"view {view!r}: the weights are on {device}, which has no {dtype} ({type(exc).__name__}: {exc}); "
            "publish the view from weights on a device that has it, or leave the view out"
        ) from exc


class ViewPublisher:
    """Writes the quantized views of each committed bf16 version (never raises to the trainer).

    Args:
        chains: the views' chains (:meth:`build` makes them from the options).
        detector, params, checkpoint, live_layout, layout: where the committed bf16 values
            are read (as the publisher's writer reads them).
        warnings: where a view's failure goes.
    """

    def __init__(
        self,
        chains: list[ViewChain],
        detector: BF16ChangeDetector,
        params: dict[str, torch.Tensor],
        checkpoint: CheckpointLayout,
        live_layout: ShardLayout,
        layout: ShardLayout,
        warnings: LateWarnings,
    ) -> None:
        self.chains = chains
        self.detector = detector
        self.params = params
        self.checkpoint = checkpoint
        self.live_layout = live_layout
        self.layout = layout
        self.warnings = warnings

    @staticmethod
    def build(
        store: Store, names: Sequence[str], ignore: Sequence[str], model: object, layout: ShardLayout, *,
        codec: str, level: int | None, keep_anchors: int, group: Any, writer: WriterRecord | None = None,
    ) -> list[ViewChain]:  # fmt: skip
        """One :class:`ViewChain` per scheme name in ``names``, for ``model`` (an nn.Module,
        whose Linear layers the views quantize, but those ``ignore`` names); ``writer``: the
        publisher's, which each view's history names."""
        if not names:
            return []
        from ..views import get_scheme
        from .view_targets import ignore_list, quantized_names

        shapes = {name: owned.shape for name, owned in layout.slices.items()}
        module = model if isinstance(model, torch.nn.Module) else None
        if module is None:
            raise ConfigError("quantized views need the model (an nn.Module) to tell its Linear layers")
        ignore = tuple(ignore)
        targets = {n for n in quantized_names(module, list(shapes), ignore) if len(shapes[n]) == 2}
        # The config names every Linear left in bf16 (an MoE's routers too), as llm-compressor writes it.
        listed = tuple(ignore_list(module, ignore))
        devices = {p.device for p in module.parameters()}
        for name in names:
            for device in devices:
                check_device_dtype(device, get_scheme(name).code_dtype, name)
        return [
            ViewChain(
                store, get_scheme(name), targets=targets, shapes=shapes, ignore=listed, codec=codec, level=level,
                keep_anchors=keep_anchors, layout=layout if layout.world > 1 else None, group=group, writer=writer,
            )
            for name in names
        ]

    @property
    def names(self) -> tuple[str, ...]:
        """The views written, by scheme name."""
        return tuple(view.name for view in self.chains)

    def fingerprint(self, name: str) -> str | None:
        """The fingerprint of view ``name`` at its newest committed version (None before one)."""
        for view in self.chains:
            if view.name == name:
                return None if view.head is None else view.head.fingerprint
        raise ConfigError(f"this publisher writes no view {name!r} (it writes {', '.join(self.names) or 'none'})")

    def publish(self, version: int, changes: dict[str, Change] | None, anchor: bool) -> dict[str, int]:
        """Bring every view to ``version`` (just committed in the bf16 chain): a delta from
        ``changes`` (None: a new chain), and an anchor beside it when ``anchor``. Never raises:
        a view that fails is reported and starts a new chain at the next version."""
        written: dict[str, int] = {}
        for view in self.chains:
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
                self.warnings.warn(f"view {view.name}: version {version} was not written (the bf16 chain has it; the "
                                   f"view starts a new chain at the next version): {exc}")  # fmt: skip
        return written

    def _checkpoint_values(self) -> Callable[[str], torch.Tensor]:
        """Checkpoint tensor name -> the elements of it this rank owns (all of it in a single
        process), flat, at the newest committed version, in bf16 on the CPU, from the snapshot (a
        parameter that is not trained: its live value). Only the live elements the name covers
        are read: a fused MoE tensor serves each of its experts' names a block at a time, in any
        order and from any thread. Ranks that own no element of ``name`` never call it."""

        def value(name: str) -> torch.Tensor:
            piece, owned = self.checkpoint.pieces[name], self.layout.slices[name]
            live = self.live_layout.slices[piece.source]
            if owned.end == owned.begin:
                return torch.empty(0, dtype=torch.bfloat16)
            # The live flat range of the owned elements (a strided piece is owned whole), in this
            # rank's flat elements of the parameter, which start at live.begin.
            lo, hi = (piece.offset + owned.begin, piece.offset + owned.end) if piece.contiguous else piece.span
            lo, hi = lo - live.begin, hi - live.begin
            if self.detector.is_tracked(piece.source):
                flat = self.detector.published_flat(piece.source, lo, hi)
            else:
                flat = live.local(self.params[piece.source])[lo:hi]
            chunks = self.checkpoint.chunks(name, flat, live.begin + lo, owned)
            pieces = [c.detach().to("cpu", torch.bfloat16) for c in chunks]
            return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.bfloat16)

        return value
