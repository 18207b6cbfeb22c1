"""What the served checkpoint holds: parameter names and shapes, read from safetensors headers.

An update is checked against this before it touches the model, so that a bucket holding
another model's weights is refused instead of half-loaded. Only the JSON headers are read.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from deltasync import FormatError

__all__ = ["read_checkpoint_shapes", "resolve_model_dir"]

_INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def resolve_model_dir(model: str, *, revision: str | None = None, cache_dir: str | None = None) -> Path | None:
    """The local directory of ``model`` (a path, or a Hub id vLLM has already downloaded)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            model,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=["*.safetensors", _INDEX],
            local_files_only=True,
        )
    except Exception:  # noqa: BLE001  (not in the cache, not a Hub id, offline: all mean "unknown")
        return None
    return Path(path)


def read_checkpoint_shapes(model_dir: str | os.PathLike[str]) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape for every tensor of the checkpoint in ``model_dir``.

    Uses ``model.safetensors.index.json`` when there is one (its files only), else every
    ``*.safetensors`` file in the directory.
    """
    root = Path(model_dir)
    index = root / _INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({root / name for name in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{root}: no *.safetensors files; deltasync needs a safetensors checkpoint")
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        for name, shape in _header_shapes(path).items():
            if name in shapes:
                raise FormatError(f"{path}: tensor {name!r} is in two files of the checkpoint")
            shapes[name] = shape
    return shapes


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise FormatError(f"{path}: too short to be a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER:
            raise FormatError(f"{path}: header of {size} bytes is not plausible for a safetensors file")
        header = json.loads(f.read(size))
    return {name: tuple(int(d) for d in info["shape"]) for name, info in header.items() if name != "__metadata__"}
