"""TokenMiddleware, called as a plain ASGI app: what passes without the token, what a refusal says.

The real server and vLLM's own router are in ``test_token_middleware_server.py``.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from servers import requires_vllm

pytestmark = requires_vllm

TOKEN = "s3cret"


def _middleware(token: str | None = TOKEN):
    from vllm_ext import TokenMiddleware

    calls: list[str] = []

    async def app(scope, receive, send):
        calls.append(scope["path"])
        if scope["type"] == "websocket":
            await send({"type": "websocket.accept"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return (TokenMiddleware(app, token=token) if token is not None else TokenMiddleware(app)), calls


def _request(
    middleware,
    path: str,
    authorization: str | None = None,
    *,
    method: str = "POST",
    root_path: str = "",
    headers: list[tuple[bytes, bytes]] | None = None,
):
    headers = [(b"content-type", b"application/json"), *(headers or [])]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode()))
    scope = {"type": "http", "method": method, "path": path, "root_path": root_path, "headers": headers}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body


def _websocket(middleware, path: str, authorization: str | None = None):
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": "websocket", "path": path, "root_path": "", "headers": headers}
    received: list[str] = []
    sent: list[dict] = []

    async def receive():
        received.append("websocket.connect")
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return received, sent


def _public_routes():
    from deltasync.server.middleware import PUBLIC_ROUTES

    return sorted(PUBLIC_ROUTES)


#: What the issue names as public, route by route: nothing more may pass.
EXPECTED_PUBLIC = [
    "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
    "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/generative_scoring",
    "/tokenize", "/detokenize", "/v1/models", "/health", "/ping", "/version", "/metrics", "/load",
]  # fmt: skip

#: Weight, pause, RPC, cache, sleep and LoRA routes, their SageMaker twins, other vLLM 0.32
#: routes that are not inference, and routes that no vLLM has (yet).
PROTECTED = [
    "/pause", "/resume", "/is_paused", "/abort_requests", "/start_weight_update", "/update_weights",
    "/finish_weight_update", "/init_weight_transfer_engine", "/weight_info", "/collective_rpc", "/sleep",
    "/wake_up", "/release_kv_cache_memory", "/reset_prefix_cache", "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter", "/adapters", "/adapters/evil", "/invocations", "/server_info",
    "/inference/v1/abort_requests", "/inference/v1/generate", "/v1/responses", "/v1/responses/abc/cancel",
    "/scale_elastic_ep", "/fault_tolerance/apply", "/openapi.json", "/docs", "/", "", "/v2/load_adapter",
]  # fmt: skip


def test_the_public_list_is_the_documented_one():
    assert _public_routes() == sorted(EXPECTED_PUBLIC)


@pytest.mark.parametrize("method", ["GET", "POST", "HEAD"])
def test_public_routes_pass_without_a_token(method):
    middleware, calls = _middleware()
    for path in _public_routes():
        assert _request(middleware, path, method=method)[0] == 200
        # Not checked here: on public routes the header may carry vLLM's --api-key instead.
        assert _request(middleware, path, "Bearer wrong", method=method)[0] == 200
    assert calls == [path for path in _public_routes() for _ in range(2)]


@pytest.mark.parametrize("path", PROTECTED)
def test_every_other_route_needs_the_token(path):
    middleware, calls = _middleware()
    status, headers, body = _request(middleware, path)
    assert status == 401 and calls == []
    error = json.loads(body)["error"]
    assert error["message"] == (
        f"{path} needs 'Authorization: Bearer <token>' with this server's DELTASYNC_TOKEN; none was sent "
        "(without it only the public inference and read-only routes answer)"
    )
    assert error["type"] == "Unauthorized" and error["code"] == 401
    assert headers[b"www-authenticate"] == b'Bearer realm="deltasync"'
    status, _, body = _request(middleware, path, "Bearer wrong", method="GET")
    assert status == 401 and calls == []
    assert json.loads(body)["error"]["message"] == (
        f"{path}: the bearer token is wrong (it must equal this server's DELTASYNC_TOKEN)"
    )
    assert _request(middleware, path, f"Bearer {TOKEN}")[0] == 200 and calls == [path]


# Paths arrive percent-decoded (uvicorn unquotes them; the router matches the decoded path), so
# "%2F", "%2e" or "%70" below are what a client sent as "%252F" etc.: they are literal text.
PUBLIC_SPELLINGS = [
    "//v1/completions", "/v1//completions", "/v1/completions/", "/v1/completions//", "/v1/./completions",
    "/./v1/completions", "/v1/../v1/completions", "/v1/completions/.", "/v1/completions/..", "/V1/completions",
    "/v1/Completions", "/v1%2Fcompletions", "/v1/%63ompletions", "/v1/completions%00", "/v1/completions\x00",
    " /v1/completions", "/v1/completions ", "/v1/completions;x", "\\v1\\completions", "/v1/completions\\",
    "v1/completions", "/health/", "//health", "/metrics/", "/metrics/x", "/metricsx", "/v1/models/x",
    "/v1/models/../../pause", "/health/../pause", "/tokenize/..%2Fpause", "/ping#", "/ping?",
]  # fmt: skip
PROTECTED_SPELLINGS = [
    "/pause/", "//pause", "/pause//", "/./pause", "/x/../pause", "/%70ause", "/PAUSE", "/v1//load_lora_adapter",
    "/v1/load_lora_adapter/", "/adapters/", "//adapters", "/adapters/evil/", "/adapters/%2e%2e",
]  # fmt: skip


@pytest.mark.parametrize("path", PUBLIC_SPELLINGS + PROTECTED_SPELLINGS)
def test_other_spellings_need_the_token(path):
    middleware, calls = _middleware()
    assert _request(middleware, path, method="GET")[0] == 401
    assert _request(middleware, path)[0] == 401 and calls == []
    assert _request(middleware, path, f"Bearer {TOKEN}")[0] == 200 and calls == [path]


# (root_path, path, public): uvicorn's --root-path prefixes scope["path"]; FastAPI's root_path
# (vLLM's --root-path) sets scope["root_path"] and leaves the path as sent.
ROOT_PATHS = [
    ("/api", "/api/v1/completions", True),
    ("/api", "/v1/completions", True),
    ("/api", "/api/health", True),
    ("/api", "/api/pause", False),
    ("/api", "/pause", False),
    ("/api", "/api", False),
    ("/api", "/api/", False),
    ("/api", "/apiv1/completions", False),
    ("/api", "/api//v1/completions", False),
    ("/api", "/api/api/v1/completions", False),
    ("/api", "/api/./v1/completions", False),
    ("/v1", "/v1/completions", False),  # the router sees "/completions"
    ("/v1/", "/v1/completions", True),  # the router keeps the path whole
    ("/api/", "/api/v1/completions", False),
    ("/ap", "/api/v1/completions", False),
]


@pytest.mark.parametrize(("root_path", "path", "public"), ROOT_PATHS)
def test_root_path_is_stripped_as_the_router_strips_it(root_path, path, public):
    from starlette._utils import get_route_path

    from deltasync.server.middleware import PUBLIC_ROUTES

    scope = {"type": "http", "path": path, "root_path": root_path}
    assert (get_route_path(scope) in PUBLIC_ROUTES) == public  # what the router would serve
    middleware, calls = _middleware()
    assert _request(middleware, path, root_path=root_path)[0] == (200 if public else 401)
    assert calls == ([path] if public else [])


_PIECES = st.sampled_from(["/", "//", ".", "..", "api", "v1", "completions", "pause", "health", "%2F", "%", "\\", "x"])
_PATHS = st.lists(_PIECES, max_size=8).map("".join)


@given(root_path=_PATHS, path=_PATHS)
def test_route_path_agrees_with_starlette(root_path, path):
    from starlette._utils import get_route_path

    from deltasync.server.middleware import PUBLIC_ROUTES, route_path

    scope = {"type": "http", "path": path, "root_path": root_path}
    assert route_path(scope) == get_route_path(scope)
    middleware, calls = _middleware()
    status = _request(middleware, path, root_path=root_path)[0]
    assert (status == 200) == (get_route_path(scope) in PUBLIC_ROUTES)
    assert status in (200, 401) and len(calls) == (status == 200)


def test_the_environment_adds_public_routes(monkeypatch):
    monkeypatch.setenv("DELTASYNC_PUBLIC_ROUTES", " /v1/messages,/v1/responses\n/is_paused ,, ")
    middleware, calls = _middleware()
    for path in ["/v1/messages", "/v1/responses", "/is_paused", *_public_routes()]:
        assert _request(middleware, path)[0] == 200
    for path in ["/v1/messages/", "/v1/responses/abc/cancel", "/pause", "/v1/messages/count_tokens"]:
        assert _request(middleware, path)[0] == 401
    assert len(calls) == 3 + len(_public_routes())


@pytest.mark.parametrize("value", ["", "   ", ","])
def test_an_empty_environment_variable_adds_nothing(monkeypatch, value):
    from deltasync.server.middleware import PUBLIC_ROUTES

    monkeypatch.setenv("DELTASYNC_PUBLIC_ROUTES", value)
    middleware, _ = _middleware()
    assert middleware.config_error is None and middleware.public == PUBLIC_ROUTES


@pytest.mark.parametrize(
    "entry",
    ["v1/messages", "/v1/messages/", "//v1/messages", "/v1//messages", "/v1/./messages", "/v1/../pause",
     "/v1/%6dessages", "/v1/responses/{response_id}", "/v1/mess\x7fages", "/v1/méssages", "/.", "/.."],
)  # fmt: skip
def test_a_bad_public_route_refuses_to_start(monkeypatch, entry):
    monkeypatch.setenv("DELTASYNC_PUBLIC_ROUTES", f"/v1/responses,{entry}")
    middleware, calls = _middleware()
    expected = (
        f"vllm_ext.TokenMiddleware: DELTASYNC_PUBLIC_ROUTES lists {entry!r}, which is not an exact route path: "
        "give paths such as /v1/messages, starting with '/', without '//', a trailing '/', '.' or '..' segments, "
        "percent-escapes or {parameters}, separated by commas or spaces"
    )
    assert middleware.config_error == expected
    assert _lifespan_startup(middleware) == [{"type": "lifespan.startup.failed", "message": expected}]
    status, _, body = _request(middleware, "/v1/completions")
    assert status == 503 and json.loads(body)["error"]["message"] == expected and calls == []


def test_public_routes_raises_a_config_error():
    from deltasync import ConfigError
    from deltasync.server.middleware import PUBLIC_ROUTES, public_routes

    assert public_routes() == PUBLIC_ROUTES and public_routes("/") == PUBLIC_ROUTES | {"/"}
    with pytest.raises(ConfigError, match="lists '/pause/'"):
        public_routes("/pause/")


def test_other_authorization_forms_are_refused():
    middleware, calls = _middleware()
    for header in ("s3cret", "Basic s3cret", "Bearer", "Bearer s3cret2", "Bearer s3cre", "", "Bearer  "):
        assert _request(middleware, "/pause", header)[0] == 401
    assert calls == []
    assert _request(middleware, "/pause", "bearer s3cret")[0] == 200  # the scheme is case-insensitive


def test_only_a_cors_preflight_passes_without_the_token():
    middleware, calls = _middleware()
    preflight = [(b"origin", b"https://example.org"), (b"access-control-request-method", b"POST")]
    # Browsers send no credentials with a preflight; vLLM's CORSMiddleware answers it.
    assert _request(middleware, "/pause", method="OPTIONS", headers=preflight)[0] == 200 and calls == ["/pause"]
    assert _request(middleware, "/pause", method="OPTIONS")[0] == 401
    assert _request(middleware, "/pause", method="OPTIONS", headers=preflight[:1])[0] == 401
    assert _request(middleware, "/pause", method="POST", headers=preflight)[0] == 401
    assert calls == ["/pause"]


def test_the_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("DELTASYNC_TOKEN", "from-env")
    middleware, _ = _middleware(token=None)
    assert _request(middleware, "/pause", "Bearer from-env")[0] == 200
    assert _request(middleware, "/pause", "Bearer s3cret")[0] == 401


def _lifespan_startup(middleware):
    sent: list[dict] = []
    messages = iter([{"type": "lifespan.startup"}])

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    asyncio.run(middleware({"type": "lifespan"}, receive, send))
    return sent


def test_without_a_token_the_server_refuses_to_start(monkeypatch):
    monkeypatch.delenv("DELTASYNC_TOKEN", raising=False)
    middleware, calls = _middleware(token=None)
    assert _lifespan_startup(middleware) == [{
        "type": "lifespan.startup.failed",
        "message": "vllm_ext.TokenMiddleware needs a token: set DELTASYNC_TOKEN in the server's environment "
                   "(or drop --middleware vllm_ext.TokenMiddleware to run without authentication)",
    }]  # fmt: skip
    # Should a server run without its lifespan anyway, it answers nothing, public routes included.
    status, _, body = _request(middleware, "/v1/completions")
    assert status == 503 and "needs a token" in json.loads(body)["error"]["message"] and calls == []


def test_lifespan_passes_through_and_unknown_scopes_are_refused():
    middleware, _calls = _middleware()
    seen: list[str] = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    middleware.app = app
    asyncio.run(middleware({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]
    with pytest.raises(RuntimeError, match="unknown ASGI scope type 'webtransport'"):
        asyncio.run(middleware({"type": "webtransport", "path": "/v1/completions"}, None, None))
    assert seen == ["lifespan"]


@pytest.mark.parametrize("path", ["/collective_rpc", "/v1/realtime", "//v1/completions", "/v1/completions/"])
def test_websockets_follow_the_same_rule(path):
    middleware, calls = _middleware()
    received, sent = _websocket(middleware, path)
    # The handshake is read, then refused with 1008 (policy violation); the route never runs.
    assert received == ["websocket.connect"] and calls == []
    assert sent == [{
        "type": "websocket.close",
        "code": 1008,
        "reason": f"{path} needs 'Authorization: Bearer <token>' with this server's DELTASYNC_TOKEN; none was sent "
                  "(without it only the public inference and read-only routes answer)"[:123],
    }]  # fmt: skip
    assert _websocket(middleware, path, "Bearer wrong")[1][0]["code"] == 1008 and calls == []
    assert _websocket(middleware, path, f"Bearer {TOKEN}")[1] == [{"type": "websocket.accept"}] and calls == [path]


def test_websockets_on_public_routes_pass_and_long_reasons_stay_valid_utf8(monkeypatch):
    monkeypatch.setenv("DELTASYNC_PUBLIC_ROUTES", "/v1/realtime")
    middleware, calls = _middleware()
    assert _websocket(middleware, "/v1/realtime")[1] == [{"type": "websocket.accept"}] and calls == ["/v1/realtime"]
    path = "/" + "é" * 100
    reason = _websocket(middleware, path)[1][0]["reason"]
    assert len(reason.encode()) <= 123 and reason == f"/{'é' * 61}"  # 1 + 61 * 2 bytes


def test_the_server_docs_and_the_space_card_list_the_public_routes():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    readme = (root / "docs" / "server.md").read_text()
    table = readme[readme.index("| public without the token |") :].split("\n\n", 1)[0]
    card = (root / "spaces" / "vllm" / "README.md").read_text()
    section = card[card.index("## What is public") :].split("\n\n")[1]
    for listed in (table, section):
        assert sorted(set(re.findall(r"`(/[^`]*)`", listed))) == _public_routes()
    assert "DELTASYNC_PUBLIC_ROUTES" in readme and "DELTASYNC_PUBLIC_ROUTES" in card
