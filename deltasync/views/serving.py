"""Which view a server follows: the one its checkpoint is, checked against the bucket."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["checkpoint_view", "resolve_view", "check_bucket_has_view"]


def checkpoint_view(model_dir: str | os.PathLike[str]) -> str | None:
    """The view a checkpoint folder is: the scheme its ``config.json``'s ``quantization_config``
    names (a :class:`~deltasync.ConfigError` for a quantization deltasync cannot follow), None
    for a checkpoint without one (bf16)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    if quantization is None:
        return None
    from .schemes import from_quantization_config

    return from_quantization_config(quantization).name


def resolve_view(configured: str | None, served: str | None, checkpoint: str) -> str | None:
    """The view a server follows: its checkpoint's (``served``), which ``configured``
    (``--view``) may name again but never contradict: the served layers are quantized one way."""
    if configured is None or configured == served:
        return served
    if served is None:
        raise ConfigError(
            f"the server is asked to follow view {configured}, but its checkpoint {checkpoint} is not quantized "
            f"(no quantization_config): start it from a {configured} checkpoint (deltasync export --view "
            f"{configured}), or drop the view to follow the bf16 chain"
        )
    raise ConfigError(
        f"the server is asked to follow view {configured}, but its checkpoint {checkpoint} is quantized as "
        f"{served}: start it from a {configured} checkpoint, or follow view {served}"
    )


def check_bucket_has_view(store: Any, view: str | None, checkpoint: str) -> None:
    """Refuse a quantized checkpoint whose view a bucket that holds versions does not hold
    (an empty bucket is not refused: its trainer may not have started yet)."""
    from ..format import POINTER_PATH, view_names

    if view is None or not store.exists(POINTER_PATH):
        return
    held = view_names(store)
    if view not in held:
        raise ConfigError(
            f"the checkpoint {checkpoint} is quantized as {view}, but the bucket {store.url} holds no view {view} "
            f"(it holds {', '.join(held) if held else 'the bf16 chain only'}): publish it with "
            f"PublishOptions(views=({view!r},)), or serve a checkpoint of a view the bucket holds"
        )
