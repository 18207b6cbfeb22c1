"""What TRL 1.16's async GRPO trainer needs to run on a machine without a GPU.

Three things stop ``AsyncGRPOTrainer`` on a CPU, and each is handled as narrowly as possible:

- its training forward uses ``"tree_fa3"`` attention, a flash-attention kernel fetched from the
  Hub: :mod:`deltasync.trl._cpu_attention` registers a pure-PyTorch version under that name;
- ``AsyncGRPOTrainer.__init__`` calls ``get_peak_flops_per_device``, which asks
  ``torch.cuda.get_device_name`` and so raises on a CPU build of torch; the value only feeds MFU
  metrics, and TRL already treats ``None`` as "unknown device, MFU off";
- ``AsyncGRPOConfig`` defaults to ``bf16=True``, which transformers refuses without a
  bf16-capable accelerator: :func:`bf16_training_available` is the one rule that decides, and
  :func:`cpu_config_overrides` gives the settings that train in fp32 instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ._cpu_attention import register_cpu_tree_attention

__all__ = ["has_cuda", "bf16_training_available", "cpu_config_overrides", "async_grpo_cpu_patches"]

_TRAINER_MODULE = "trl.experimental.async_grpo.async_grpo_trainer"


def has_cuda() -> bool:
    """Whether the trainer will run on a CUDA device (and so needs none of this module)."""
    return torch.cuda.is_available()


def bf16_training_available() -> bool:
    """Whether transformers accepts ``bf16=True`` without ``use_cpu``: a bf16-capable CUDA, XPU,
    MPS, NPU, HPU or other accelerator, or XLA. The same predicates transformers checks, so the
    answer never disagrees with its refusal."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return is_torch_bf16_gpu_available() or is_torch_xla_available()


def cpu_config_overrides() -> dict[str, Any]:
    """``AsyncGRPOConfig`` keyword arguments that let TRL's own config validate and train here.

    Empty where bf16 training is available (see :func:`bf16_training_available`). Elsewhere
    ``bf16=False``, so the model trains in the fp32 that ``AsyncGRPOConfig.dtype`` loads it in
    by default (``use_cpu=True`` with bf16 autocast also validates, but trains in a precision
    neither side serves). ``deltasync.trl.AsyncGRPOConfig`` applies the same rule itself.
    """
    return {} if bf16_training_available() else {"bf16": False}


def _peak_flops_unless_cpu(original: Any) -> Any:
    def get_peak_flops_per_device(accelerator: Any, dtype: str) -> float | None:
        if accelerator.device.type != "cuda":
            return None
        return original(accelerator, dtype)

    get_peak_flops_per_device.__wrapped__ = original  # type: ignore[attr-defined]
    return get_peak_flops_per_device


@contextlib.contextmanager
def async_grpo_cpu_patches() -> Iterator[None]:
    """Construct an ``AsyncGRPOTrainer`` inside this block to make it usable on a CPU.

    While the block runs, the trainer module's ``get_peak_flops_per_device`` returns ``None``
    for a non-CUDA device (MFU metrics off, as TRL does for an unknown GPU) and defers to TRL's
    own otherwise; the original is restored on exit. When the block ends without an error, the
    CPU tree attention is registered over the flash-only function the trainer's ``__init__``
    just registered. On a CUDA machine both changes are no-ops for the trainer's device.

    Example::

        with async_grpo_cpu_patches():
            trainer = AsyncGRPOTrainer(model=path, args=AsyncGRPOConfig(**cpu_config_overrides(), ...))
        trainer.train()
    """
    import importlib

    module = importlib.import_module(_TRAINER_MODULE)
    original = module.get_peak_flops_per_device
    module.get_peak_flops_per_device = _peak_flops_unless_cpu(original)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        module.get_peak_flops_per_device = original  # type: ignore[attr-defined]
    register_cpu_tree_attention()
