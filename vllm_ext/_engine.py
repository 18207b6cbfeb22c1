"""The "delta" weight-transfer backend for vLLM's weight-update routes.

Start the server with ``--weight-transfer-config '{"backend": "delta"}'``; then
``/start_weight_update``, ``/update_weights {"update_info": {"version": N, "auth": TAG}}``
and ``/finish_weight_update`` apply committed version N from the server's bucket. Nothing is
loaded between those HTTP calls: staging, checks and the reload all happen inside
``/update_weights``, so a failure or a client that disappears never leaves the model half
loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from deltasync.protocol import check_version
from deltasync.server.updater import WorkerUpdater

from ._worker import vllm_updater

__all__ = ["DeltaWeightTransferEngine", "DeltaInitInfo", "DeltaUpdateInfo"]


@dataclass
class DeltaInitInfo(WeightTransferInitInfo):
    """No fields: the bucket and token come from the server's environment at start-up."""


@dataclass
class DeltaUpdateInfo(WeightTransferUpdateInfo):
    """What ``/update_weights`` carries: a version, and its auth tag when the server has a token."""

    version: int
    """The committed version to serve."""
    auth: str | None = None
    """Hex HMAC-SHA256 of ``"deltasync-update:<version>"`` under ``DELTASYNC_TOKEN``."""

    def __post_init__(self) -> None:
        # TypeError: the engine's parse_update_info turns it into a ValueError naming the engine.
        check_version(self.version, TypeError)
        if self.auth is not None and not isinstance(self.auth, str):
            raise TypeError(f"auth must be a hex string or null, got {type(self.auth).__name__}")


class DeltaWeightTransferEngine(WeightTransferEngine[DeltaInitInfo, DeltaUpdateInfo]):
    """Applies versions from the bucket named by ``DELTASYNC_BUCKET`` (see :mod:`vllm_ext`)."""

    init_info_cls = DeltaInitInfo
    update_info_cls = DeltaUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        # Created now, when the server starts: reads the environment and the checkpoint.
        self.updater: WorkerUpdater = vllm_updater(model, vllm_config)
        self.last_result: dict[str, Any] | None = None

    def init_transfer_engine(self, init_info: DeltaInitInfo) -> None:
        """Nothing to connect to: servers pull from the bucket."""

    def start_weight_update(self) -> None:
        """Nothing to prepare: ``receive_weights`` stages, checks and reloads in one step."""

    def receive_weights(self, update_info: DeltaUpdateInfo) -> None:
        self.last_result = self.updater.update(update_info.version, update_info.auth)

    def finish_weight_update(self) -> None:
        """Nothing to finish: the model was complete again when ``receive_weights`` returned."""

    def shutdown(self) -> None:
        """No connection to release."""
