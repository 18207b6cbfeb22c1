"""Write a checkpoint folder that vLLM and transformers load: safetensors shards, config.json, tokenizer.

Used for quantized views (config.json's ``quantization_config`` set to the view's) and for bf16
(``quantization_config=None``: the key is removed). Every final file is written under a hidden
temporary name in the folder and renamed into place once complete, the shards first and
config.json last, so a crash leaves no half-written file under a final name (only ``.*.tmp``
files, which loaders ignore).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError

__all__ = ["COPIED_FILES", "write_checkpoint"]

#: Files copied from ``like`` (glob patterns): tokenizer, chat template and generation settings.
COPIED_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.tiktoken",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "preprocessor_config.json",
)


def make_folder(out: Path, *, create: bool = True) -> None:
    """Create the folder ``out`` (and its parents), or a :class:`ConfigError` naming it and why
    not: a file of that name, or a folder the OS will not create. ``create=False`` only checks
    that ``out`` is not a file (before anything is read or written)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a folder; name a new or empty folder to write the checkpoint to")
    if not create:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the folder {out}: {exc.strerror or exc}; name a folder that can be created"
        ) from None


def write_checkpoint(
    out_dir: str | os.PathLike[str],
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    quantization_config: dict[str, Any] | None,
    like: str | os.PathLike[str] | None,
    max_shard_bytes: int = 5 << 30,
    progress: Callable[[int, int], None] | None = None,
    total_bytes: int | None = None,
) -> list[Path]:
    """Write ``tensors`` (checkpoint name, tensor) as a checkpoint in ``out_dir`` and return the
    paths written.

    - Tensors go to safetensors shards of at most ``max_shard_bytes`` each (a larger tensor gets a
      shard of its own), in the order given: ``model.safetensors``, or ``model-0000i-of-0000n
      .safetensors`` plus ``model.safetensors.index.json`` when there are several.
    - ``like`` (a model folder): its ``config.json`` is written with ``quantization_config`` set
      (removed when it is None), and its tokenizer, chat template and generation files
      (:data:`COPIED_FILES`) are copied. Without ``like`` only the tensors are written, and a
      ``UserWarning`` says so: the folder then needs a config.json before anything loads it.
    - ``progress(done_bytes, total_bytes)`` is called after each shard. ``total_bytes`` is the sum of
      the tensors' bytes: taken from ``total_bytes`` if given, else (with ``progress`` only)
      ``tensors`` is listed first to add it up, which holds every tensor it yields at once; pass
      ``total_bytes`` to stream tensors made on the fly.

    Raises :class:`ConfigError` if ``out_dir`` is a file or cannot be created, already holds safetensors files (stale shards
    would be loaded beside the new ones), a name repeats, or ``like`` has no config.json.
    """
    out = Path(out_dir)
    if max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes={max_shard_bytes} must be positive")
    if like is not None and not (Path(like) / "config.json").is_file():
        raise ConfigError(f"like={str(like)!r} has no config.json; pass the model folder the checkpoint is of")
    make_folder(out)
    stale = sorted(p.name for p in out.glob("*.safetensors*"))
    if stale:
        raise ConfigError(
            f"{out} already holds {', '.join(stale[:3])}{' ...' if len(stale) > 3 else ''}; "
            "write the checkpoint to an empty folder (old shards would be loaded beside the new ones)"
        )
    if total_bytes is None and progress is not None:
        tensors = list(tensors)
        total_bytes = sum(_nbytes(t) for _, t in tensors)

    temps: list[Path] = []
    shards: list[tuple[Path, list[str]]] = []
    seen: set[str] = set()
    done = 0
    try:
        batch: dict[str, torch.Tensor] = {}
        size = 0
        for name, tensor in tensors:
            if name in seen:
                raise ConfigError(f"tensor {name!r} is given twice")
            seen.add(name)
            nbytes = _nbytes(tensor)
            if batch and size + nbytes > max_shard_bytes:
                done += _flush(out, batch, temps, shards)
                _report(progress, done, total_bytes or 0)
                batch, size = {}, 0
            batch[name] = tensor
            size += nbytes
        if batch or not shards:
            done += _flush(out, batch, temps, shards)
            _report(progress, done, total_bytes or 0)
        written = _finish(out, shards, total=done)
        if like is None:
            warnings.warn(
                f"{out}: wrote the tensors only (no like= model folder): add config.json and the tokenizer "
                "files before loading it",
                UserWarning,
                stacklevel=2,
            )
            return written
        written += _copy_files(Path(like), out)
        config = json.loads((Path(like) / "config.json").read_text())
        if quantization_config is None:
            config.pop("quantization_config", None)
        else:
            config["quantization_config"] = quantization_config
        written.append(_write_text(out / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n"))
        return written
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _report(progress: Callable[[int, int], None] | None, done: int, total: int) -> None:
    if progress is not None:
        progress(done, max(total, done))


def _flush(out: Path, batch: dict[str, torch.Tensor], temps: list[Path], shards: list[tuple[Path, list[str]]]) -> int:
    from safetensors.torch import save_file

    temp = out / f".shard-{len(shards):05d}.{os.getpid()}.tmp"
    temps.append(temp)
    # safetensors refuses views into a larger storage (shared memory); copy only those.
    ready = {name: _own(t) for name, t in batch.items()}
    save_file(ready, str(temp), metadata={"format": "pt"})
    # safetensors creates its file with mode 0600; a checkpoint is written as any file is
    # (0666 less the umask), so that a server running as another user can read it.
    os.chmod(temp, 0o666 & ~_umask())
    shards.append((temp, list(batch)))
    return sum(_nbytes(t) for t in batch.values())


def _umask() -> int:
    """This process's umask, read without changing it where Linux says it (``os.umask`` sets
    it, which another thread could see)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _own(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach().contiguous()
    if tensor.untyped_storage().nbytes() != _nbytes(tensor) or tensor.device.type != "cpu":
        tensor = tensor.to("cpu", copy=True)
    return tensor


def _finish(out: Path, shards: Sequence[tuple[Path, list[str]]], total: int) -> list[Path]:
    """Rename the temporary shards to their final names (count known now) and write the index."""
    if len(shards) == 1:
        final = out / "model.safetensors"
        shards[0][0].replace(final)
        return [final]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    for i, (temp, names) in enumerate(shards):
        final = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        temp.replace(final)
        written.append(final)
        weight_map.update({name: final.name for name in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    written.append(_write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n"))
    return written


def _copy_files(like: Path, out: Path) -> list[Path]:
    written = []
    for pattern in COPIED_FILES:
        for source in sorted(like.glob(pattern)):
            if source.is_file():
                temp = out / f".{source.name}.{os.getpid()}.tmp"
                shutil.copyfile(source, temp)
                final = out / source.name
                temp.replace(final)
                written.append(final)
    return written


def _write_text(path: Path, text: str) -> Path:
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temp.write_text(text)
    temp.replace(path)
    return path
