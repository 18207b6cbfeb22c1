"""What a server reads from its environment, read in one place, once, at start-up.

The variables are named in :mod:`deltasync.protocol.env`; ``deltasync serve`` writes them. Every part
of ``vllm_ext`` (workers, middleware, follow mode, the plain-GEMM switch) takes its settings
from :meth:`ServerConfig.from_env`, never from ``os.environ`` itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from deltasync.errors import ConfigError
from deltasync.protocol import (
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
    TOKEN_ENV,
    UPDATE_MODE_ENV,
    VIEW_ENV,
    UpdateMode,
    check_update_mode,
)

from .cpus import STAGING_CPUS_PATTERN

__all__ = ["ServerConfig"]

_TRUE, _FALSE = ("1", "true", "yes"), ("", "0", "false", "no")


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """A server's settings from its environment (``from_env``); the defaults are a server
    started with none of the variables set."""

    bucket: str | None = None
    """The bucket it follows (``DELTASYNC_BUCKET``); no request can name another."""
    token: str | None = None
    """The shared secret (``DELTASYNC_TOKEN``); None leaves updates unauthenticated."""
    follow: bool = False
    """Follow the bucket by itself (``DELTASYNC_FOLLOW``)."""
    follow_interval: float = DEFAULT_FOLLOW_INTERVAL
    """Seconds between two reads of the pointer in follow mode (``DELTASYNC_FOLLOW_INTERVAL``)."""
    update_mode: UpdateMode = "pause"
    """"pause" or "inflight" (``DELTASYNC_UPDATE_MODE``)."""
    public_routes: str | None = None
    """Routes the token middleware adds to its public ones, as written (``DELTASYNC_PUBLIC_ROUTES``;
    the middleware parses them and answers with the error if they are wrong)."""
    plain_gemm: str = ""
    """The plain-GEMM switch as written (``DELTASYNC_CPU_PLAIN_GEMM``: "", "0", "1" or patterns)."""
    staging_cpus: str = "auto"
    """Where a worker's background work runs (``DELTASYNC_STAGING_CPUS``: "auto", "inherit" or a
    CPU list; see ``deltasync.server.cpus``)."""
    staging_nice: int | str = DEFAULT_STAGING_NICE
    """How far those threads lower their priority (``DELTASYNC_STAGING_NICE``: 0-19, or "idle")."""
    test_hooks: bool = False
    """The test extension's RPCs may run (``DELTASYNC_TEST_HOOKS=1``)."""
    view: str | None = None
    """The quantized view followed (``DELTASYNC_VIEW``); None: the one the served checkpoint is."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ServerConfig:
        flag = environ.get(FOLLOW_ENV, "").strip().lower()
        if flag not in _TRUE + _FALSE:
            raise ConfigError(f"{FOLLOW_ENV} must be 1 or 0, got {environ[FOLLOW_ENV]!r}")
        raw = environ.get(FOLLOW_INTERVAL_ENV) or str(DEFAULT_FOLLOW_INTERVAL)
        try:
            interval = float(raw)
        except ValueError as exc:
            raise ConfigError(f"{FOLLOW_INTERVAL_ENV} must be a number of seconds, got {raw!r}") from exc
        mode = check_update_mode(environ.get(UPDATE_MODE_ENV) or "pause", UPDATE_MODE_ENV)
        cpus = environ.get(STAGING_CPUS_ENV, "").strip() or "auto"
        if not STAGING_CPUS_PATTERN.fullmatch(cpus):
            raise ConfigError(f"{STAGING_CPUS_ENV} must be 'auto', 'inherit' or a CPU list such as 1,3-4, got {cpus!r}")
        raw_nice = environ.get(STAGING_NICE_ENV, "").strip() or str(DEFAULT_STAGING_NICE)
        if raw_nice != "idle" and (not raw_nice.isdigit() or int(raw_nice) > 19):
            raise ConfigError(f"{STAGING_NICE_ENV} must be a whole number from 0 to 19 or 'idle', got {raw_nice!r}")
        return cls(
            bucket=environ.get(BUCKET_ENV) or None,
            token=environ.get(TOKEN_ENV) or None,
            follow=flag in _TRUE,
            follow_interval=interval,
            update_mode=mode,
            public_routes=environ.get(PUBLIC_ROUTES_ENV),
            plain_gemm=environ.get(PLAIN_GEMM_ENV, "").strip(),
            staging_cpus=cpus,
            staging_nice=raw_nice if raw_nice == "idle" else int(raw_nice),
            test_hooks=environ.get(TEST_HOOKS_ENV) == "1",
            view=_view(environ.get(VIEW_ENV, "").strip()),
        )


def _view(name: str) -> str | None:
    if not name:
        return None
    from deltasync.format import VIEW_NAME_RE

    if not VIEW_NAME_RE.match(name):
        raise ConfigError(f"{VIEW_ENV} must be a scheme name such as FP8_DYNAMIC, got {name!r}")
    return name

