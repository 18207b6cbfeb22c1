"""``--middleware vllm_ext.TokenMiddleware``: every vLLM route but the public ones needs a token.

``VLLM_SERVER_DEV_MODE=1`` (which the weight-update routes need) opens routes that pause the
server, run methods on its workers, put it to sleep or reset its caches; runtime LoRA updating
opens routes (and SageMaker twins such as ``/adapters``) that make it serve new weights. Each
vLLM release adds more. So this ASGI middleware names what may pass without a token,
:data:`PUBLIC_ROUTES` (inference and read-only routes), and answers every other request with
401 unless it carries ``Authorization: Bearer $DELTASYNC_TOKEN``. Websockets follow the same
rule (closed with 1008, policy violation). ``DELTASYNC_PUBLIC_ROUTES`` adds routes to the public
list; vLLM's ``--api-key`` closes the public ``/v1`` routes too. CORS preflights pass (browsers
send them without credentials; vLLM's CORS middleware answers them before any route). Without
a token the server refuses to start.

A path is public only when the router sees exactly a public route's path: the same
``scope["path"]`` (which the ASGI server has already percent-decoded), less ``root_path``
as Starlette strips it. Any other spelling (``//v1/completions``, ``/v1/completions/``,
``/v1/./completions``, or ``/v1/%2e/completions`` which arrives as the latter) needs the
token, so no spelling of a protected route can pass as a public one.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from deltasync.errors import ConfigError
from deltasync.protocol import PUBLIC_ROUTES_ENV, TOKEN_ENV, bearer_matches

from .asgi import header, unauthorized
from .config import ServerConfig

__all__ = ["PUBLIC_ROUTES", "PUBLIC_ROUTES_ENV", "TokenMiddleware", "public_routes", "route_path"]

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The routes that answer without the token (any method): inference and read-only routes
#: of vLLM 0.32. Everything else needs ``Authorization: Bearer $DELTASYNC_TOKEN``, including
#: routes a later vLLM adds. Paths are matched exactly as the router sees them.
PUBLIC_ROUTES = frozenset(
    {
        # completions and chat (OpenAI API)
        "/v1/completions",
        "/v1/chat/completions",
        # embeddings
        "/v1/embeddings",
        # scoring: score, rerank, generative scoring
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/generative_scoring",
        # tokenize / detokenize
        "/tokenize",
        "/detokenize",
        # models, health, ping, version, metrics, load
        "/v1/models",
        "/health",
        "/ping",
        "/version",
        "/metrics",
        "/load",
    }
)

_SEPARATORS = re.compile(r"[\s,]+")


def _is_exact_path(entry: str) -> bool:
    # The one spelling the router matches: printable ASCII, "/" then segments that are not
    # empty, "." or "..", no trailing "/", no percent-escape (paths arrive decoded), no {template}.
    if not entry.startswith("/") or not entry.isascii() or not entry.isprintable() or " " in entry:
        return False
    return entry == "/" or all(
        segment not in ("", ".", "..") and not any(char in segment for char in "%{}")
        for segment in entry.split("/")[1:]
    )


def public_routes(extra: str | None = None) -> frozenset[str]:
    """:data:`PUBLIC_ROUTES` plus the routes listed in ``extra`` (``$DELTASYNC_PUBLIC_ROUTES``).

    Raises :class:`~deltasync.ConfigError` naming an entry that is not an exact route path.
    """
    added = [entry for entry in _SEPARATORS.split(extra or "") if entry]
    for entry in added:
        if not _is_exact_path(entry):
            raise ConfigError(
                f"{PUBLIC_ROUTES_ENV} lists {entry!r}, which is not an exact route path: give paths "
                "such as /v1/messages, starting with '/', without '//', a trailing '/', '.' or '..' "
                "segments, percent-escapes or {parameters}, separated by commas or spaces"
            )
    return PUBLIC_ROUTES.union(added)


def route_path(scope: Mapping[str, Any]) -> str:
    """The path Starlette's router matches: ``scope["path"]`` less a leading ``root_path``.

    The same rule as ``starlette._utils.get_route_path`` (the test suite checks that they agree).
    """
    path: str = scope["path"]
    root_path: str = scope.get("root_path") or ""
    if not root_path or not path.startswith(root_path):
        return path
    if path == root_path:
        return ""
    if path[len(root_path)] == "/":
        return path[len(root_path) :]
    return path


class TokenMiddleware:
    """Plain ASGI middleware: 401 on every route but the public ones without ``Bearer $DELTASYNC_TOKEN``.

    ``token`` defaults to ``$DELTASYNC_TOKEN``; the public routes are
    :func:`public_routes` of ``$DELTASYNC_PUBLIC_ROUTES``, read when the server starts.
    """

    def __init__(self, app: ASGIApp, token: str | None = None) -> None:
        self.app = app
        config = ServerConfig.from_env()
        self.token = token if token is not None else config.token
        self.public: frozenset[str] = PUBLIC_ROUTES
        self.config_error: str | None = None
        try:
            self.public = public_routes(config.public_routes)
        except ConfigError as exc:
            self.config_error = f"vllm_ext.TokenMiddleware: {exc}"
        if not self.token:
            self.config_error = (
                f"vllm_ext.TokenMiddleware needs a token: set {TOKEN_ENV} in the server's environment "
                "(or drop --middleware vllm_ext.TokenMiddleware to run without authentication)"
            )
        if self.config_error is not None:
            logger.error(self.config_error)
        elif added := sorted(self.public - PUBLIC_ROUTES):
            logger.info("vllm_ext.TokenMiddleware: also public (%s): %s", PUBLIC_ROUTES_ENV, ", ".join(added))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.config_error is not None:
            await self._refuse_to_run(scope, receive, send)
            return
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, receive, send)
            return
        if kind not in ("http", "websocket"):
            raise RuntimeError(f"vllm_ext.TokenMiddleware: unknown ASGI scope type {kind!r}")
        path = route_path(scope)
        if path in self.public or _cors_preflight(scope):
            await self.app(scope, receive, send)
            return
        given = header(scope, b"authorization")
        assert self.token is not None
        if bearer_matches(self.token, given):
            await self.app(scope, receive, send)
            return
        why = unauthorized(path, given)
        if given is None:
            why += " (without it only the public inference and read-only routes answer)"
        await _deny(scope, receive, send, 401, why)

    async def _refuse_to_run(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.config_error is not None
        if scope["type"] == "lifespan":
            # Failing the startup makes uvicorn exit: the server never serves unprotected.
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.failed", "message": self.config_error})
            return
        await _deny(scope, receive, send, 503, self.config_error)


def _cors_preflight(scope: Scope) -> bool:
    # Browsers send no credentials with a preflight; vLLM's CORSMiddleware (inside this one)
    # answers it without calling any route.
    return (
        scope["type"] == "http"
        and scope.get("method") == "OPTIONS"
        and header(scope, b"origin") is not None
        and header(scope, b"access-control-request-method") is not None
    )


async def _deny(scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
    if scope["type"] == "websocket":
        if (await receive())["type"] != "websocket.connect":
            return
        # A close frame's reason holds at most 123 bytes of UTF-8.
        reason = message.encode()[:123].decode(errors="ignore")
        await send({"type": "websocket.close", "code": 1008, "reason": reason})
        return
    kind = "Unauthorized" if status == 401 else "ServiceUnavailable"
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="deltasync"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
