"""TokenMiddleware, called as a plain ASGI app: which routes need the token, what a refusal says."""

from __future__ import annotations

import asyncio
import json

import pytest
from vllm_fixtures import requires_vllm

pytestmark = requires_vllm


def _middleware(token: str | None = "s3cret"):
    from vllm_ext import TokenMiddleware

    calls: list[str] = []

    async def app(scope, receive, send):
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return TokenMiddleware(app, token=token) if token is not None else TokenMiddleware(app), calls


def _request(middleware, path: str, authorization: str | None = None, *, method: str = "POST", root_path: str = ""):
    headers = [(b"content-type", b"application/json")]
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


PROTECTED = [
    "/pause", "/resume", "/is_paused", "/start_weight_update", "/update_weights", "/finish_weight_update",
    "/init_weight_transfer_engine", "/weight_info", "/collective_rpc", "/sleep", "/wake_up", "/reset_prefix_cache",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/abort_requests", "/server_info",
]  # fmt: skip
PUBLIC = ["/v1/completions", "/v1/chat/completions", "/health", "/v1/models", "/tokenize", "/metrics", "/version"]


@pytest.mark.parametrize("path", PROTECTED)
def test_control_routes_need_the_token(path):
    middleware, calls = _middleware()
    status, headers, body = _request(middleware, path)
    assert status == 401 and calls == []
    error = json.loads(body)["error"]
    assert error["message"] == f"{path} needs 'Authorization: Bearer <token>' with this server's DELTASYNC_TOKEN; none was sent"
    assert error["type"] == "Unauthorized" and error["code"] == 401
    assert headers[b"www-authenticate"] == b'Bearer realm="deltasync"'
    status, _, body = _request(middleware, path, "Bearer wrong")
    assert status == 401
    assert json.loads(body)["error"]["message"] == (
        f"{path}: the bearer token is wrong (it must equal this server's DELTASYNC_TOKEN)"
    )
    assert _request(middleware, path, "Bearer s3cret")[0] == 200 and calls == [path]


@pytest.mark.parametrize("path", PUBLIC)
def test_public_routes_pass_without_a_token(path):
    middleware, calls = _middleware()
    assert _request(middleware, path, method="GET")[0] == 200 and calls == [path]


@pytest.mark.parametrize("path", ["/pause/", "//pause", "/v1//load_lora_adapter", "/api/pause"])
def test_spellings_of_a_protected_path_are_protected(path):
    middleware, calls = _middleware()
    root_path = "/api" if path.startswith("/api") else ""
    assert _request(middleware, path, root_path=root_path)[0] == 401 and calls == []


def test_other_authorization_forms_are_refused():
    middleware, calls = _middleware()
    for header in ("s3cret", "Basic s3cret", "Bearer", "Bearer s3cret2", ""):
        assert _request(middleware, "/pause", header)[0] == 401
    assert _request(middleware, "/pause", "bearer s3cret")[0] == 200  # the scheme is case-insensitive
    assert _request(middleware, "/pause", method="OPTIONS")[0] == 200  # CORS preflight carries no credentials


def test_the_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("DELTASYNC_TOKEN", "from-env")
    middleware, _ = _middleware(token=None)
    assert _request(middleware, "/pause", "Bearer from-env")[0] == 200
    assert _request(middleware, "/pause", "Bearer s3cret")[0] == 401


def test_without_a_token_the_server_refuses_to_start(monkeypatch):
    monkeypatch.delenv("DELTASYNC_TOKEN", raising=False)
    middleware, calls = _middleware(token=None)
    sent: list[dict] = []
    messages = iter([{"type": "lifespan.startup"}])

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    asyncio.run(middleware({"type": "lifespan"}, receive, send))
    assert sent == [{
        "type": "lifespan.startup.failed",
        "message": "vllm_ext.TokenMiddleware needs a token: set DELTASYNC_TOKEN in the server's environment "
                   "(or drop --middleware vllm_ext.TokenMiddleware to run without authentication)",
    }]  # fmt: skip
    # Should a server run without its lifespan anyway, it answers nothing.
    status, _, body = _request(middleware, "/v1/completions")
    assert status == 503 and "needs a token" in json.loads(body)["error"]["message"] and calls == []


def test_websockets_on_protected_paths_are_closed():
    middleware, calls = _middleware()
    sent: list[dict] = []

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "websocket", "path": "/collective_rpc", "headers": []}
    asyncio.run(middleware(scope, receive, send))
    assert sent[0]["type"] == "websocket.close" and sent[0]["code"] == 1008 and calls == []
