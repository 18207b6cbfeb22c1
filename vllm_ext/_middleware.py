"""``--middleware vllm_ext.TokenMiddleware``: a bearer token on vLLM's control routes.

``VLLM_SERVER_DEV_MODE=1`` (which the weight-update routes need) also opens routes that
pause the server, run methods on its workers, put it to sleep or load adapters. This ASGI
middleware lets those through only with ``Authorization: Bearer $DELTASYNC_TOKEN``;
completions, health, models and the other public routes pass untouched (use vLLM's
``--api-key`` for those). Without a token the server refuses to start.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from deltasync._auth import TOKEN_ENV, bearer_matches

__all__ = ["PROTECTED_PATHS", "TokenMiddleware"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Routes that need the token: weight transfer, pause/resume, RPC, sleep/wake, caches,
#: LoRA loading, and the other operator routes of vLLM 0.32.
PROTECTED_PATHS = frozenset(
    {
        # weight transfer
        "/init_weight_transfer_engine",
        "/shutdown_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/update_weight_version",
        "/weight_info",
        "/weight_checker",
        # pause / resume
        "/pause",
        "/resume",
        "/is_paused",
        "/abort_requests",
        # RPC into the workers
        "/collective_rpc",
        # sleep / wake
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/release_kv_cache_memory",
        # caches
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/reset_encoder_cache",
        # LoRA loading
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        # other operator routes
        "/server_info",
        "/get_world_size",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
    }
)
_PROTECTED_PREFIXES = ("/fault_tolerance/",)
_SLASHES = re.compile(r"/{2,}")


def _protected(path: str) -> bool:
    # Routes match exactly; normalise so "//pause" or "/pause/" cannot slip past.
    path = _SLASHES.sub("/", path).rstrip("/") or "/"
    return path in PROTECTED_PATHS or path.startswith(_PROTECTED_PREFIXES)


class TokenMiddleware:
    """Plain ASGI middleware: 401 on protected routes without ``Bearer $DELTASYNC_TOKEN``."""

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        self.app = app
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self.config_error: str | None = None
        if not self.token:
            self.config_error = (
                f"vllm_ext.TokenMiddleware needs a token: set {TOKEN_ENV} in the server's environment "
                "(or drop --middleware vllm_ext.TokenMiddleware to run without authentication)"
            )
            logger.error(self.config_error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.config_error is not None:
            await self._refuse_to_run(scope, receive, send)
            return
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "") or "")
        if not _protected(path):
            await self.app(scope, receive, send)
            return
        header = _header(scope, b"authorization")
        assert self.token is not None
        if bearer_matches(self.token, header):
            await self.app(scope, receive, send)
            return
        if header is None:
            why = f"{path} needs 'Authorization: Bearer <token>' with this server's {TOKEN_ENV}; none was sent"
        else:
            why = f"{path}: the bearer token is wrong (it must equal this server's {TOKEN_ENV})"
        await _deny(scope, send, 401, why)

    async def _refuse_to_run(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.config_error is not None
        if scope["type"] == "lifespan":
            # Failing the startup makes uvicorn exit: the server never serves unprotected.
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.failed", "message": self.config_error})
            return
        await _deny(scope, send, 503, self.config_error)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _deny(scope: Scope, send: Send, status: int, message: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    kind = "Unauthorized" if status == 401 else "ServiceUnavailable"
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="deltasync"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
