"""Checkpoint folders of a bucket's versions, and of a model's weights as a quantized view."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

from .reader.receiver import DeltaReceiver
from .trainer.publisher import DeltaPublisher
from .trainer.view_chain import read_view_config

__all__ = ["export_checkpoint", "write_view_checkpoint"]


def export_checkpoint(
    bucket: Any, out_dir: str | os.PathLike[str], *, view: str | None = None, version: int | None = None,
    like: str | os.PathLike[str] | None = None, max_shard_bytes: int = 5 << 30, quiet: bool = False,
) -> DeltaReceiver:
    """Write version ``version`` (default: the newest) of a bucket's bf16 chain, or of its
    quantized ``view``, as a checkpoint folder (see :func:`deltasync.views.write_checkpoint`):
    config and tokenizer from ``like``, with the view's ``quantization_config``. Progress goes
    to stderr unless ``quiet``. Returns the receiver that read it (its version, fingerprint)."""
    from .errors import FormatError
    from .views import from_quantization_config, write_checkpoint
    from .views.checkpoint import make_folder

    make_folder(Path(out_dir), create=False)  # refused before the bucket is read
    receiver = DeltaReceiver(bucket, view=view)
    staged = receiver.stage(version)
    receiver.apply(staged)
    config = read_view_config(staged.anchor_metadata)
    if view is not None and config is None:
        raise FormatError(f"{receiver.store.url}: the anchor of view {view} carries no quantization_config")
    if view is not None and config is not None and from_quantization_config(config).name != receiver.view:
        found = from_quantization_config(config).name
        raise FormatError(
            f"{receiver.store.url}: view {receiver.view} was asked for, the anchor of version {staged.versions[0]} "
            f"carries the quantization_config of {found}"
        )
    state = receiver.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())

    def progress(done: int, total: int) -> None:
        if not quiet:
            print(f"  written {done / 1e6:.1f} of {total / 1e6:.1f} MB ({100 * done / max(total, 1):.0f}%)", file=sys.stderr)

    with warnings.catch_warnings():  # "tensors only" is the caller's to say
        warnings.simplefilter("ignore", UserWarning)
        write_checkpoint(out_dir, sorted(state.items()), quantization_config=config, like=like,
                         max_shard_bytes=max_shard_bytes, progress=progress, total_bytes=total)  # fmt: skip
    return receiver


def write_view_checkpoint(
    model: Any, out_dir: str | os.PathLike[str], view: str, *, like: str | os.PathLike[str],
    ignore: tuple[str, ...] = ("lm_head",),
) -> list[Path]:
    """Write ``model``'s bf16 weights, quantized as ``view``, as a checkpoint folder like ``like``
    (its config, with the view's ``quantization_config``, and its tokenizer): what a rollout
    server of the view starts from before the trainer publishes. It is exactly what a publisher
    of ``model`` would commit as the view's first version, and ``deltasync export --view`` would
    write: that is how it is made, through a temporary bucket."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="deltasync-view-") as tmp:
        with DeltaPublisher(tmp, model, None, views=(view,), view_ignore=tuple(ignore)) as publisher:
            publisher.publish()
        export_checkpoint(tmp, out_dir, view=view, like=like, quiet=True)
    return sorted(Path(out_dir).iterdir())
