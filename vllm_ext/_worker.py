"""vLLM's side of the worker seam (:class:`deltasync.server.seam.Worker`): one worker's model,
ranks, layerwise reload, served checkpoint and platform checks.

- ranks: vLLM's tensor- and pipeline-parallel groups (:mod:`._ranks`);
- loading: vLLM's config current, and a view's load-time parameters put back (:mod:`._quantized`);
- reload: vLLM's layerwise reload (:mod:`._reload`);
- platform: vLLM-CPU repacks linear weights unless the plain GEMM switch is on (:mod:`._plain_gemm`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from deltasync.server.checkpoint import ServedCheckpoint
from deltasync.server.config import ServerConfig
from deltasync.server.updater import WorkerUpdater, updater_for

from ._plain_gemm import PLAIN_GEMM_ENV, plain_gemm_enabled
from ._quantized import load_time_params
from ._ranks import gather, is_last_rank, rank_index
from ._reload import reload_weights, transformed

if TYPE_CHECKING:
    from deltasync.views import ViewScheme

__all__ = ["VllmWorker", "vllm_updater"]


class VllmWorker:
    """One vLLM worker (a :class:`deltasync.server.seam.Worker`).

    Args:
        model: the worker's model (``worker.model_runner.get_model()``).
        vllm_config: the worker's ``VllmConfig``.
    """

    def __init__(self, model: torch.nn.Module, vllm_config: Any) -> None:
        self._model = model
        self.vllm_config = vllm_config

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def rank_index(self) -> int:
        return rank_index()

    def is_last_rank(self) -> bool:
        return is_last_rank()

    def gather(self, obj: Any) -> list[Any]:
        return gather(obj)

    def checkpoint(self) -> ServedCheckpoint:
        model_config = self.vllm_config.model_config
        text_config = getattr(model_config, "hf_text_config", None) or model_config.hf_config
        return ServedCheckpoint.read(str(model_config.model), revision=getattr(model_config, "revision", None),
                                     tied=bool(getattr(text_config, "tie_word_embeddings", False)))  # fmt: skip

    def packed(self) -> dict[str, list[str]]:
        return dict(getattr(self._model, "packed_modules_mapping", None) or {})

    def in_place_refusal(self) -> str | None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or plain_gemm_enabled():
            return None
        if ServerConfig.from_env().plain_gemm not in ("", "0"):
            return (f"{PLAIN_GEMM_ENV} is set, but deltasync's vLLM plugin did not run before the model loaded "
                    "(install the package, pip install deltasync, and leave 'deltasync' in VLLM_PLUGINS if set)")  # fmt: skip
        return f"vLLM's CPU build repacks linear weights for its kernels (set {PLAIN_GEMM_ENV}=1 to keep them plain)"

    @contextlib.contextmanager
    def loading(self, scheme: ViewScheme | None) -> Iterator[None]:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), load_time_params(self._model, scheme):
            yield

    def transformed(self, module: torch.nn.Module) -> str | None:
        return transformed(module)

    def reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
        return reload_weights(self._model, self.vllm_config, weights)[1]

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from vllm.model_executor.model_loader import get_model_loader

        loader = get_model_loader(self.vllm_config.load_config)
        return iter(loader.get_all_weights(self.vllm_config.model_config, self._model))


def vllm_updater(model: torch.nn.Module, vllm_config: Any) -> WorkerUpdater:
    """The updater of a vLLM worker's ``model`` (one per worker, held by the model)."""
    return updater_for(VllmWorker(model, vllm_config))
