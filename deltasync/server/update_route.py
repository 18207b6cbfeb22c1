"""The update route: deltasync's routes and follow mode around any engine's ASGI API server.

:class:`UpdateRoute` wraps an ASGI app and drives its engine through the engine seam
(:class:`~deltasync.server.seam.Engine`, built by ``engine_of`` from the first request's scope).
vLLM's ``--middleware vllm_ext.UpdateMiddleware`` is this route over :class:`vllm_ext._vllm_engine.VllmEngine`.

vLLM's own sequence for a weight update is five HTTP calls (``/pause``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/resume``), each a round trip through the API
server. This middleware runs :class:`~deltasync.server.server_sync.ServerSync` in the API-server
process instead, and adds:

- ``POST /deltasync/update {"version": N, "auth": TAG}``: the whole update in one request. The
  workers stage N while the server keeps generating, then the scheduler pauses in ``keep``
  mode emptying the caches (in-flight requests freeze and recompute their KV with the new
  weights on resume; no KV of the old weights is reused), ``deltasync_apply`` runs on every
  worker (one ``collective_rpc``: staged, checked, all ranks or none), the served weight version
  is labelled, and the scheduler resumes, whatever happened. A version already served is a
  no-op. The answer carries the workers' results and the seconds the scheduler was paused.
- ``GET /deltasync/status``: what the server serves, as JSON (``version``, ``fingerprint``,
  ``mode``, ``follow``, ``workers``).
- follow mode (``DELTASYNC_FOLLOW=1``): the server reads its bucket's pointer every
  ``DELTASYNC_FOLLOW_INTERVAL`` seconds and brings itself to each newer version by the same flow.
- the response header ``x-deltasync-version`` on completions and chat completions: the version
  served when the request was admitted (``none`` before the first update); and where each
  version began in each choice's tokens, ``x-deltasync-token-versions`` (a header, or an SSE
  comment before ``data: [DONE]``; see :mod:`deltasync.protocol.token_versions` and
  :mod:`deltasync.server.token_versions`).
- ``deltasync_*`` metrics on vLLM's ``/metrics``.

Both routes need ``Authorization: Bearer $DELTASYNC_TOKEN`` when the server has a token, and an
update needs the version's tag, like every update. :class:`deltasync.RolloutClient` uses the
update route when a server has it and vLLM's five routes otherwise.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from deltasync.errors import DeltaSyncError
from deltasync.protocol import (
    INFERENCE_ROUTES,
    STATUS_ROUTE,
    TOKEN_VERSIONS_HEADER,
    UPDATE_ROUTE,
    VERSION_HEADER,
    VERSIONS_HEADER,
    ApplyCall,
    VersionRequest,
    bearer_matches,
    check_update_mode,
    fits_bounds,
    format_token_versions,
)

from .asgi import answer, error_body, header, read_body, refused, unauthorized
from .config import ServerConfig
from .middleware import route_path
from .seam import Engine
from .server_sync import FollowConfig, ServerSync

__all__ = ["STATUS_ROUTE", "TOKEN_VERSIONS_HEADER", "UPDATE_ROUTE", "VERSIONS_HEADER", "VERSION_HEADER", "UpdateRoute"]

logger = logging.getLogger(__name__)

#: The routes whose responses carry :data:`VERSION_HEADER` and :data:`VERSIONS_HEADER`, and
#: whose requests are salted with the version they are admitted at.
_INFERENCE_ROUTES = INFERENCE_ROUTES
#: vLLM's routes that can change the weights behind the flow (the "delta" backend's apply);
#: another engine's route sets :attr:`UpdateRoute.weight_routes` to its own.
VLLM_WEIGHT_ROUTES = frozenset({"/collective_rpc", "/update_weights", "/finish_weight_update"})


class UpdateRoute:
    """ASGI middleware adding deltasync's routes, follow mode and response header (see the module).

    Args:
        app: the API server's ASGI app.
        engine_of: the engine behind the app, from a request's ASGI scope (called once).
    """

    #: The engine's own routes that may change the weights behind the flow: held until the
    #: served version is read back (``/collective_rpc`` carries the worker calls).
    weight_routes: frozenset[str] = VLLM_WEIGHT_ROUTES

    def __init__(
        self, app: Any, engine_of: Callable[[Any], Engine], token: str | None = None,
        follow: FollowConfig | None = None, update_mode: str | None = None,
    ) -> None:  # fmt: skip
        self.app = app
        self.engine_of = engine_of
        config = ServerConfig.from_env()
        self.token = token if token is not None else config.token
        self.follow = follow or FollowConfig.of(config)
        self.update_mode = check_update_mode(update_mode or config.update_mode, "update mode")
        self.sync: ServerSync | None = None

    def _sync(self, scope: Any) -> ServerSync:
        if self.sync is None:
            engine = self.engine_of(scope)
            self.sync = ServerSync(engine, token=self.token, follow=self.follow, update_mode=self.update_mode)
        return self.sync

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, self._lifespan(scope, receive), send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if path == UPDATE_ROUTE:
            await self._update(scope, receive, send)
        elif path == STATUS_ROUTE:
            await self._status(scope, send)
        elif path in _INFERENCE_ROUTES and "app" in scope:
            await self._inference(scope, receive, send)
        elif path in self.weight_routes and "app" in scope:
            await self._weight_route(scope, receive, send, path)
        else:
            await self.app(scope, receive, send)

    async def _inference(self, scope: Any, receive: Any, send: Any) -> None:
        """A completion or chat request: admitted at the version served now (after any pause),
        salted with it for the prefix cache, and answered with the versions that made it."""
        sync = self._sync(scope)
        body = await read_body(receive)
        version = await sync.admitted()
        body = _salted(sync.engine, body, version)
        replay = _replay(body, receive)
        # The marker in vLLM's request id ties the engine's requests to this one (the client's
        # own X-Request-Id stays in front of it).
        marker = sync.tokens.track(version)
        given = header(scope, b"x-request-id")
        headers = [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"x-request-id"]
        headers.append((b"x-request-id", (f"{given}-{marker}" if given else marker).encode("latin-1")))
        scope = {**scope, "headers": _with_length(headers, len(body))}
        try:
            await self.app(scope, replay, _versioned(send, version, lambda: sync.served, lambda: sync.tokens.versions(marker)))
        finally:
            sync.tokens.untrack(marker)

    async def _weight_route(self, scope: Any, receive: Any, send: Any, path: str) -> None:
        """vLLM's weight-update routes and ``/collective_rpc``: a request that may change the
        weights behind the flow holds admissions until the served version is read back."""
        body = await read_body(receive)
        sync = self._sync(scope)
        if path == "/collective_rpc":
            try:
                request = json.loads(body or b"{}")
                method = request.get("method")
            except (ValueError, AttributeError):
                request, method = None, None
            if method != ApplyCall.method:
                await self.app(scope, _replay(body, receive), send)
                return
            call = _apply_call(request)
            if call is not None:
                # Through the engine core's counted apply, so the token versions stay exact.
                async with sync.outside_update(counted=True):
                    try:
                        results = await sync.tokens.apply(sync.engine, call)
                    except Exception as exc:  # noqa: BLE001  (vLLM's route answers a failed call with 500 too)
                        await answer(send, 500, error_body(str(exc), "InternalServerError", 500))
                        return
                await answer(send, 200, {"results": results})
                return
        async with sync.outside_update():
            await self.app(scope, _replay(body, receive), send)

    def _lifespan(self, scope: Any, receive: Any) -> Any:
        """``receive`` for the lifespan scope: starts the follower once the app has started up
        (its engine client is ready by then) and stops it at shutdown."""

        async def wrapped() -> Any:
            message = await receive()
            if message["type"] == "lifespan.startup" and "app" in scope:
                self._sync(scope).start()
            elif message["type"] == "lifespan.shutdown" and self.sync is not None:
                await self.sync.stop()
            return message

        return wrapped

    async def _update(self, scope: Any, receive: Any, send: Any) -> None:
        if await refused(scope, send, UPDATE_ROUTE, self.token):
            return
        try:
            request = json.loads(await read_body(receive) or b"{}")
            if not isinstance(request, dict) or set(request) - {"version", "auth", "mode"}:
                raise ValueError('the body must be a JSON object {"version": N, "auth": TAG, "mode": "pause"|"inflight"}')
            update = VersionRequest.parse(request.get("version"), request.get("auth"))
        except (ValueError, DeltaSyncError) as exc:
            await answer(send, 400, error_body(f"{UPDATE_ROUTE}: bad body ({exc})", "BadRequest", 400))
            return
        outcome = await self._sync(scope).bring_to(update.version, update.auth, mode=request.get("mode"))
        if not outcome.ok:
            await answer(send, outcome.status, error_body(outcome.error or "the update failed", "UpdateError", outcome.status))
            return
        await answer(send, 200, {
            "results": [r.to_json() for r in outcome.results], "paused_s": outcome.paused_s, "noop": outcome.noop,
            "mode": outcome.mode, "note": outcome.note,
        })  # fmt: skip

    async def _status(self, scope: Any, send: Any) -> None:
        if scope.get("method") != "GET":
            await answer(send, 405, error_body(f"{STATUS_ROUTE} takes GET", "MethodNotAllowed", 405))
            return
        given = header(scope, b"authorization")
        if self.token is not None and not bearer_matches(self.token, given):
            await answer(send, 401, error_body(unauthorized(STATUS_ROUTE, given), "Unauthorized", 401))
            return
        sync = self._sync(scope)
        try:
            workers = await sync.workers()
        except Exception as exc:  # noqa: BLE001
            await answer(send, 503, error_body(f"the workers did not answer ({type(exc).__name__}: {exc})", "Unavailable", 503))
            return
        versions = [w.version for w in workers]
        fingerprints = {w.fingerprint for w in workers}
        await answer(send, 200, {
            "version": None if any(v is None for v in versions) else min(v for v in versions if v is not None),
            "fingerprint": fingerprints.pop() if len(fingerprints) == 1 else None,
            "mode": workers[0].mode if len({w.mode for w in workers}) == 1 else "mixed",
            "view": workers[0].view,
            "follow": sync.follow_status(),
            "workers": [w.to_json() for w in workers],
        })  # fmt: skip


def _apply_call(request: Any) -> ApplyCall | None:
    """The apply a ``/collective_rpc`` body calling :attr:`ApplyCall.method` makes, or None for
    a call it cannot be, or whose version or tag is not one (vLLM then answers it, with the
    worker's own error)."""
    args, kwargs = request.get("args") or [], request.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict) or set(kwargs) - {"version", "auth"}:
        return None
    named = [kwargs.get("version"), kwargs.get("auth")]
    if len(args) > 2 or ("version" in kwargs and args) or ("auth" in kwargs and len(args) > 1):
        return None
    values = [*args, *named[len(args):]]
    try:
        return ApplyCall.parse(values[0], values[1])
    except DeltaSyncError:
        return None


def _salted(engine: Engine, body: bytes, version: int | None) -> bytes:
    """The request body salted for ``version`` by the engine (vLLM: its ``cache_salt`` bound to
    ``version``, the client's own salt kept inside it); a body that is not a JSON object goes on
    as it is, for vLLM to refuse."""
    try:
        request = json.loads(body or b"{}")
    except ValueError:
        return body
    if not isinstance(request, dict):
        return body
    return json.dumps(engine.salt(request, version)).encode()


def _replay(body: bytes, receive: Any) -> Any:
    """A ``receive`` that gives the (already read) ``body`` once, then the client's own messages
    (a disconnect, when it goes: vLLM aborts a request whose client left)."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_length(headers: Any, length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() not in (b"content-length", b"transfer-encoding")]
    return [*kept, (b"content-length", str(length).encode())]


def _label(version: int | None) -> str:
    return "none" if version is None else str(version)


def _versioned(send: Any, admitted: int | None, served: Any, token_versions: Any = lambda: None) -> Any:
    """``send`` that adds the admission version to the response's start, the span of versions
    and where each version began in each choice: as headers of a non-streamed answer (complete
    when its start is sent), as SSE comments before ``data: [DONE]`` of a streamed one."""
    streaming = False

    def span() -> str:
        last = served()
        first = admitted if admitted is not None else last
        return f"{_label(first)}-{_label(last if last is not None else first)}"

    def starts() -> str | None:
        choices = token_versions()
        if choices and not fits_bounds(choices):
            # Past what a client parses (vLLM's largest n): say nothing rather than a list it refuses.
            entries = sum(len(c) for c in choices)
            logger.warning("deltasync: %d choices with %d version entries pass the bounds of %s; not sent",
                           len(choices), entries, TOKEN_VERSIONS_HEADER)  # fmt: skip
            return None
        return format_token_versions(choices) if choices else None

    async def wrapped(message: Any) -> None:
        nonlocal streaming
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
            headers.append((VERSION_HEADER.encode(), _label(admitted).encode()))
            if not streaming:
                headers.append((VERSIONS_HEADER.encode(), span().encode()))
                if (value := starts()) is not None:
                    headers.append((TOKEN_VERSIONS_HEADER.encode(), value.encode()))
            message = {**message, "headers": headers}
        elif message["type"] == "http.response.body" and streaming:
            body = message.get("body", b"")
            marker = body.find(b"data: [DONE]")
            if marker >= 0:
                comment = f": {VERSIONS_HEADER} {span()}\n\n"
                if (value := starts()) is not None:
                    comment += f": {TOKEN_VERSIONS_HEADER} {value}\n\n"
                message = {**message, "body": body[:marker] + comment.encode() + body[marker:]}
        await send(message)

    return wrapped
