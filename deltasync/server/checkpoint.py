"""What the served checkpoint holds: parameter names and shapes, read from safetensors headers.

An update is checked against this before it touches the model, so that a bucket holding
another model's weights is refused instead of half-loaded. Only the JSON headers are read.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deltasync import DeltaSyncError, FormatError, StagedUpdate
from deltasync.views.serving import checkpoint_view

__all__ = ["ServedCheckpoint", "read_checkpoint_dtypes", "read_checkpoint_shapes", "resolve_model_dir"]

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
# Checkpoint tensors that are not parameters: vLLM skips them when loading, and a trainer's
# state never holds them.
_NOT_PARAMETERS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_TIED_HEAD = "lm_head.weight"


@dataclass(frozen=True, kw_only=True)
class ServedCheckpoint:
    """The checkpoint a server started from, which every staged version must fit."""

    path: str
    """Its directory (or the model name, when its files were not found)."""
    shapes: dict[str, tuple[int, ...]] | None
    """Parameter name -> shape; None when unknown (updates are then not checked)."""
    tied: bool
    """Whether ``lm_head.weight`` is the embedding (an anchor may leave it out)."""
    dtypes: dict[str, torch.dtype] | None = None
    """Parameter name -> its dtype in the checkpoint (None when unknown or not one a chain holds)."""
    view: str | None = None
    """The quantized view the checkpoint is (its ``quantization_config`` as a scheme name), or
    None for a bf16 checkpoint."""

    @classmethod
    def read(cls, model: str, *, revision: str | None = None, tied: bool = False) -> ServedCheckpoint:
        """Read the names and shapes of the checkpoint ``model`` (a folder or a Hugging Face model
        name, at ``revision``); ``tied``: whether its head is its embedding (the engine's config)."""
        directory = resolve_model_dir(model, revision=revision)
        if directory is None:
            logger.warning(
                "deltasync: cannot find the safetensors files of %s; updates are not checked against its "
                "parameter names and shapes", model,
            )
            return cls(path=model, shapes=None, tied=tied)
        view = checkpoint_view(directory)  # a quantization deltasync cannot follow raises: refused at start
        try:
            return cls(
                path=str(directory), shapes=read_checkpoint_shapes(directory), tied=tied,
                dtypes=read_checkpoint_dtypes(directory), view=view,
            )
        except (OSError, ValueError, DeltaSyncError) as exc:
            logger.warning("deltasync: cannot read the checkpoint of %s (%s); updates are not checked against it",
                           model, exc)
            return cls(path=str(directory), shapes=None, tied=tied, view=view)

    def reader(self) -> Callable[[str], Any]:
        """``name -> tensor`` of the served checkpoint, read from its files when asked (None
        for a name it lacks, or when its files are unknown)."""
        root = Path(self.path)
        files = {}
        if self.shapes is not None:
            for path in sorted(root.glob("*.safetensors")):
                files.update(dict.fromkeys(_header_shapes(path), path))

        def read(name: str) -> Any:
            path = files.get(name)
            if path is None:
                return None
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)

        return read

    def check(self, staged: StagedUpdate) -> None:
        """Refuse parameter names and shapes that the served checkpoint does not have."""
        if staged.kind == "none" or self.shapes is None:
            return
        expected = self.shapes
        names = sorted(staged.names)  # the first problem reported is always the same one
        where = f"version {staged.version}"
        if staged.kind == "anchor":
            have = set(names)
            missing = [
                n for n in sorted(expected)
                if n not in have and not n.endswith(_NOT_PARAMETERS) and not (n == _TIED_HEAD and self.tied)
            ]  # fmt: skip
        else:
            missing = []
        unknown = [n for n in names if n not in expected]
        parts = [f"{len(missing)} parameters of the served checkpoint are missing (e.g. {missing[0]})"] if missing else []
        parts += [f"{len(unknown)} are not in the served checkpoint (e.g. {unknown[0]})"] if unknown else []
        if parts:
            raise FormatError(
                f"{where} does not fit the served model {self.path}: {'; '.join(parts)}. The bucket holds "
                "another model's weights, or the server was started from another checkpoint"
            )
        for name in names:
            shape = tuple(staged.shape(name))
            if shape != expected[name]:
                raise FormatError(
                    f"{where}: {name} has shape {list(shape)}, the served checkpoint's is {list(expected[name])}"
                )
            if self.dtypes is not None and staged.kind == "anchor":
                dtype = staged.dtype(name)
                if name in self.dtypes and dtype != self.dtypes[name] and (self.view is not None or dtype != torch.bfloat16):
                    raise FormatError(
                        f"{where}: {name} is {dtype}, the served checkpoint's is {self.dtypes[name]} "
                        f"(a {'quantized view' if self.view else 'bf16 chain'} was expected)"
                    )


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


def read_checkpoint_dtypes(model_dir: str | os.PathLike[str]) -> dict[str, torch.dtype] | None:
    """Parameter name -> dtype for every tensor of the checkpoint in ``model_dir``; None when a
    tensor has a dtype no chain holds (the checkpoint cannot be followed element by element)."""
    from deltasync.format.dtypes import dtype_from_code

    dtypes: dict[str, torch.dtype] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        for name, code in _header_info(path, "dtype").items():
            try:
                dtypes[name] = dtype_from_code(code, where=str(path))
            except FormatError:  # not in the element table
                return None
    return dtypes


def _header_info(path: Path, key: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise FormatError(f"{path}: too short to be a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > _MAX_HEADER:
            raise FormatError(f"{path}: header of {size} bytes is not plausible for a safetensors file")
        header = json.loads(f.read(size))
    return {name: info[key] for name, info in header.items() if name != "__metadata__"}


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(int(d) for d in shape) for name, shape in _header_info(path, "shape").items()}
