"""deltasync: exact sparse bf16 weight sync from RL trainers to vLLM rollout servers.

The trainer publishes anchors and sparse deltas into a bucket with :class:`DeltaPublisher`;
rollout servers follow it with :class:`DeltaReceiver`. See docs/protocol.md for the bytes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AdapterError,
    AuthError,
    ConfigError,
    ConflictError,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    NotFoundError,
    PublishError,
    StoreError,
    VersionError,
    WriterConflictError,
)
from .format import Change, Pointer
from .format.fingerprint import fingerprint
from .protocol.token_versions import (
    TOKEN_VERSIONS_HEADER,
    TokenVersions,
    VersionedCompletion,
    parse_token_versions,
    version_of_token,
)
from .reader.receiver import DeltaReceiver, StagedUpdate
from .stores import Store, open_store

if TYPE_CHECKING:
    from .control.client import BaseRolloutClient, RolloutClient, ServerResult, ServerStatus, UpdateReport
    from .control.lora_client import AdapterRolloutClient
    from .export import export_checkpoint, write_view_checkpoint
    from .trainer.detector import BF16ChangeDetector, bf16_state_dict, checkpoint_name
    from .trainer.lora import (
        AdapterWeights,
        MergedLoraWeights,
        adapter_publisher,
        merged_publisher,
    )
    from .trainer.publisher import DeltaPublisher, PublishOptions, PublishResult
    from .trainer.sources import ModelWeights, SourceWeight, WeightSource

# The trainer side's names (the control plane's clients too) load their modules on first use
# (PEP 562): a vLLM worker, which imports the reader, the format and the protocol from this
# package, loads no publisher, detector, weight source or client (tests/unit/test_imports.py
# checks it).
_TRAINER_SIDE = {
    "BaseRolloutClient": ".control.client",
    "RolloutClient": ".control.client",
    "ServerResult": ".control.client",
    "ServerStatus": ".control.client",
    "UpdateReport": ".control.client",
    "AdapterRolloutClient": ".control.lora_client",
    "BF16ChangeDetector": ".trainer.detector",
    "bf16_state_dict": ".trainer.detector",
    "checkpoint_name": ".trainer.detector",
    "AdapterWeights": ".trainer.lora",
    "MergedLoraWeights": ".trainer.lora",
    "adapter_publisher": ".trainer.lora",
    "merged_publisher": ".trainer.lora",
    "DeltaPublisher": ".trainer.publisher",
    "PublishOptions": ".trainer.publisher",
    "PublishResult": ".trainer.publisher",
    "ModelWeights": ".trainer.sources",
    "SourceWeight": ".trainer.sources",
    "WeightSource": ".trainer.sources",
    "export_checkpoint": ".export",
    "write_view_checkpoint": ".export",
}


def __getattr__(name: str) -> Any:
    module = _TRAINER_SIDE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_TRAINER_SIDE})


__version__ = "0.1.0"

__all__ = [
    "export_checkpoint",
    "write_view_checkpoint",
    "TOKEN_VERSIONS_HEADER",
    "TokenVersions",
    "VersionedCompletion",
    "parse_token_versions",
    "version_of_token",
    "AdapterError",
    "AdapterRolloutClient",
    "AdapterWeights",
    "AuthError",
    "BaseRolloutClient",
    "BF16ChangeDetector",
    "Change",
    "ConfigError",
    "ConflictError",
    "DeltaPublisher",
    "DeltaReceiver",
    "DeltaSyncError",
    "FormatError",
    "IntegrityError",
    "MergedLoraWeights",
    "ModelWeights",
    "NotFoundError",
    "Pointer",
    "PublishError",
    "PublishOptions",
    "PublishResult",
    "RolloutClient",
    "ServerResult",
    "ServerStatus",
    "SourceWeight",
    "StagedUpdate",
    "Store",
    "StoreError",
    "UpdateReport",
    "VersionError",
    "WriterConflictError",
    "WeightSource",
    "adapter_publisher",
    "bf16_state_dict",
    "checkpoint_name",
    "fingerprint",
    "merged_publisher",
    "open_store",
]
