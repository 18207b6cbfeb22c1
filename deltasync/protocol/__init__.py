"""What the trainer and the servers agree on, and nothing else: both sides import this package.

- :mod:`.routes`: the HTTP routes and headers of a server's update surface;
- :mod:`.messages`: the typed messages they carry (answers, worker status, heals);
- :mod:`.calls`: the worker calls (each method's name, arguments and answer), and the typed
  update request every entry point parses;
- :mod:`.auth`: the bearer token and the per-update tag;
- :mod:`.env`: the environment variables a server reads, and the update modes;
- :mod:`.token_versions`: which weights sampled each token (``x-deltasync-token-versions``);
- :mod:`.lora`: the adapter sync's keys, routes, name rule and checks.

None of it imports torch, a trainer-side module or an engine.
"""
from __future__ import annotations

from .auth import TOKEN_ENV, bearer_matches, check_update_tag, update_tag
from .env import (
    BUCKET_ENV,
    DEFAULT_FOLLOW_INTERVAL,
    DEFAULT_STAGING_NICE,
    FOLLOW_ENV,
    FOLLOW_INTERVAL_ENV,
    PLAIN_GEMM_ENV,
    PUBLIC_ROUTES_ENV,
    STAGING_CPUS_ENV,
    STAGING_NICE_ENV,
    TEST_HOOKS_ENV,
    UPDATE_MODE_ENV,
    UPDATE_MODES,
    VIEW_ENV,
    UpdateMode,
    check_update_mode,
)
from .calls import (
    ALL_CALLS,
    ApplyCall,
    BeginCall,
    LoraFingerprintCall,
    LoraModulesCall,
    PrefetchCall,
    StatusCall,
    VerifyCall,
    VersionRequest,
    WorkerCall,
)
from .messages import (
    Heal,
    LoraFingerprintAnswer,
    LoraModulesAnswer,
    PrefetchState,
    ServedBody,
    UpdateAnswer,
    WorkerStatus,
    check_version,
)
from .routes import (
    INFERENCE_ROUTES,
    LORA_STATUS_ROUTE,
    LORA_UPDATE_ROUTE,
    MAX_POLL_S,
    STATUS_ROUTE,
    TOKEN_VERSIONS_HEADER,
    UPDATE_ROUTE,
    VERSION_HEADER,
    VERSIONS_HEADER,
)
from .token_versions import (
    TokenVersions,
    VersionedCompletion,
    fits_bounds,
    format_token_versions,
    parse_token_versions,
    version_of_token,
    versioned_completion,
)

__all__ = [
    "ALL_CALLS",
    "BUCKET_ENV",
    "DEFAULT_FOLLOW_INTERVAL",
    "DEFAULT_STAGING_NICE",
    "FOLLOW_ENV",
    "FOLLOW_INTERVAL_ENV",
    "INFERENCE_ROUTES",
    "LORA_STATUS_ROUTE",
    "LORA_UPDATE_ROUTE",
    "MAX_POLL_S",
    "PLAIN_GEMM_ENV",
    "PUBLIC_ROUTES_ENV",
    "STAGING_CPUS_ENV",
    "STAGING_NICE_ENV",
    "STATUS_ROUTE",
    "TEST_HOOKS_ENV",
    "TOKEN_ENV",
    "TOKEN_VERSIONS_HEADER",
    "UPDATE_MODES",
    "UPDATE_MODE_ENV",
    "UPDATE_ROUTE",
    "VERSIONS_HEADER",
    "VERSION_HEADER",
    "VIEW_ENV",
    "ApplyCall",
    "BeginCall",
    "Heal",
    "LoraFingerprintAnswer",
    "LoraFingerprintCall",
    "LoraModulesAnswer",
    "LoraModulesCall",
    "PrefetchCall",
    "PrefetchState",
    "ServedBody",
    "StatusCall",
    "TokenVersions",
    "UpdateAnswer",
    "UpdateMode",
    "VerifyCall",
    "VersionRequest",
    "VersionedCompletion",
    "WorkerCall",
    "WorkerStatus",
    "bearer_matches",
    "check_update_mode",
    "check_update_tag",
    "check_version",
    "fits_bounds",
    "format_token_versions",
    "parse_token_versions",
    "update_tag",
    "version_of_token",
    "versioned_completion",
]
