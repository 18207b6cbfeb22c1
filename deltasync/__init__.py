"""deltasync: exact sparse bf16 weight sync from RL trainers to vLLM rollout servers.

The trainer publishes anchors and sparse deltas into a bucket with :class:`DeltaPublisher`;
rollout servers follow it with :class:`DeltaReceiver`. See docs/protocol.md for the bytes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._client import BaseRolloutClient, RolloutClient, ServerResult, ServerStatus, UpdateReport
from ._errors import (
    AdapterError,
    AuthError,
    ConfigError,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    NotFoundError,
    PublishError,
    StoreError,
    VersionError,
)
from ._fingerprint import fingerprint
from .format import Change, Pointer
from ._receiver import DeltaReceiver, StagedUpdate
from ._token_versions import (
    TOKEN_VERSIONS_HEADER,
    TokenVersions,
    VersionedCompletion,
    parse_token_versions,
    version_of_token,
)
from .stores import Store, open_store

if TYPE_CHECKING:
    from ._detector import BF16ChangeDetector, bf16_state_dict, checkpoint_name
    from ._lora import AdapterRolloutClient, AdapterWeights, MergedLoraWeights, adapter_publisher, merged_publisher
    from ._publisher import DeltaPublisher, PublishOptions, PublishResult
    from ._sources import ModelWeights, SourceWeight, WeightSource
    from ._view_export import export_checkpoint, write_view_checkpoint

# The trainer side's names load their modules on first use (PEP 562): a vLLM worker, which
# imports the reader, the format and the protocol from this package, loads no publisher,
# detector or weight source (tests/unit/test_imports.py checks it).
_TRAINER_SIDE = {
    "BF16ChangeDetector": "._detector",
    "bf16_state_dict": "._detector",
    "checkpoint_name": "._detector",
    "AdapterRolloutClient": "._lora",
    "AdapterWeights": "._lora",
    "MergedLoraWeights": "._lora",
    "adapter_publisher": "._lora",
    "merged_publisher": "._lora",
    "DeltaPublisher": "._publisher",
    "PublishOptions": "._publisher",
    "PublishResult": "._publisher",
    "ModelWeights": "._sources",
    "SourceWeight": "._sources",
    "WeightSource": "._sources",
    "export_checkpoint": "._view_export",
    "write_view_checkpoint": "._view_export",
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
    "WeightSource",
    "adapter_publisher",
    "bf16_state_dict",
    "checkpoint_name",
    "fingerprint",
    "merged_publisher",
    "open_store",
]
