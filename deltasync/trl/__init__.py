"""TRL integration: ``AsyncGRPOTrainer(delta_sync=True)``.

Built on TRL 1.16's ``trl.experimental.async_grpo`` as subclasses: publishing into a bucket
replaces the NCCL weight transfer; everything else is TRL's. Needs ``pip install 'deltasync[trl]'``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ..errors import ConfigError

_SUPPORTED = ((1, 16), (1, 17))  # [min, max) of TRL's (major, minor)

try:
    _trl_version = version("trl")
except PackageNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("deltasync.trl needs TRL: pip install 'deltasync[trl]'") from exc
_parts = tuple(int(p) for p in _trl_version.split(".")[:2] if p.isdigit())
if not _SUPPORTED[0] <= _parts < _SUPPORTED[1]:  # pragma: no cover
    raise ImportError(
        f"deltasync.trl supports TRL >=1.16,<1.17 (its experimental async GRPO API changes between "
        f"releases); found {_trl_version}. Install 'deltasync[trl]'."
    )

from ._cpu_attention import register_cpu_tree_attention  # noqa: E402
from ._cpu_compat import async_grpo_cpu_patches, bf16_training_available, cpu_config_overrides  # noqa: E402
from ._trainer import AsyncGRPOConfig, AsyncGRPOTrainer, DeltaSyncConfig  # noqa: E402

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "ConfigError",
    "DeltaSyncConfig",
    "async_grpo_cpu_patches",
    "bf16_training_available",
    "cpu_config_overrides",
    "register_cpu_tree_attention",
]
