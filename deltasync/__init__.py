"""deltasync: exact sparse bf16 weight sync from RL trainers to vLLM rollout servers.

The trainer publishes anchors and sparse deltas into a bucket with :class:`DeltaPublisher`;
rollout servers follow it with :class:`DeltaReceiver`. See docs/protocol.md for the bytes.
"""

from __future__ import annotations

from ._client import BaseRolloutClient, RolloutClient, ServerResult, ServerStatus, UpdateReport
from ._detector import BF16ChangeDetector, bf16_state_dict, checkpoint_name
from ._errors import (
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
from ._lora import (
    AdapterError,
    AdapterRolloutClient,
    AdapterWeights,
    MergedLoraWeights,
    adapter_publisher,
    merged_publisher,
)
from .format import Change, Pointer
from ._publisher import DeltaPublisher, PublishOptions, PublishResult
from ._receiver import DeltaReceiver, StagedUpdate
from ._view_export import export_checkpoint, write_view_checkpoint
from ._sources import ModelWeights, SourceWeight, WeightSource
from ._token_versions import (
    TOKEN_VERSIONS_HEADER,
    TokenVersions,
    VersionedCompletion,
    parse_token_versions,
    version_of_token,
)
from .stores import Store, open_store

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
