"""Quantized views of the policy: compressed-tensors' preset schemes (FP8_DYNAMIC, FP8_BLOCK, W8A8)
computed from bf16 weights exactly as llm-compressor writes them, a checkpoint writer that vLLM
and transformers load, and which view a server serves. The schemes are a registry
(:mod:`deltasync.views.schemes`): a new one is one module and one :func:`register_scheme` line. Which weights of a trainer's model a
scheme quantizes is the trainer's (:mod:`deltasync.trainer.view_targets`).

compressed-tensors is imported only when a view is computed (``pip install 'deltasync[views]'``).
"""

from __future__ import annotations

from .checkpoint import write_checkpoint
from .schemes import (
    SCHEMES,
    LiveLayout,
    ViewScheme,
    check_codes,
    check_scale,
    from_quantization_config,
    get_scheme,
    register_scheme,
    scale_name,
    unregister_scheme,
)
from .serving import check_bucket_has_view, checkpoint_view, resolve_view

__all__ = [
    "SCHEMES",
    "LiveLayout",
    "ViewScheme",
    "check_codes",
    "check_scale",
    "from_quantization_config",
    "get_scheme",
    "register_scheme",
    "unregister_scheme",
    "scale_name",
    "write_checkpoint",
    "check_bucket_has_view",
    "checkpoint_view",
    "resolve_view",
]
