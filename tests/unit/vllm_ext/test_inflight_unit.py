"""In-flight updates on the API-server side, with the engine client recorded
(``test_update_route.Engine``): no pause, the fallback to a pause where parameters reload, the
prefix-cache salt of every request, the versions that made a response, and the weight routes
that change weights behind the flow. Real servers: ``integration/vllm_ext/test_inflight_server.py``."""

from __future__ import annotations

import asyncio
import logging
import json
from types import SimpleNamespace

from servers import requires_vllm
from test_update_route import TOKEN, Engine, _post

from deltasync.protocol import ApplyCall

pytestmark = requires_vllm


def test_an_inflight_update_applies_between_steps_without_a_pause():
    engine = Engine()
    status, answer, _ = _post(engine, {"version": 3, "auth": "tag", "mode": "inflight"})
    assert status == 200 and answer["mode"] == "inflight" and answer["note"] is None
    assert engine.calls == [("deltasync_begin", 3, "tag"), ("deltasync_apply", 3, "tag"), ("label", "3")]


def test_inflight_falls_back_to_a_pause_where_parameters_reload_and_says_so():
    engine = Engine()
    original = engine.collective_rpc

    async def reload_status(method, args=()):
        answers = await original(method, args)
        if method in ("deltasync_status", "deltasync_begin"):
            answers = [{**a, "mode": "reload", "fallback": ["model.layers.0.mlp.gate_proj.weight"]} for a in answers]
        return answers

    engine.collective_rpc = reload_status
    status, answer, _ = _post(engine, {"version": 3, "auth": "tag", "mode": "inflight"})
    assert status == 200 and answer["mode"] == "pause"
    assert "fall back to the reload (e.g. model.layers.0.mlp.gate_proj.weight), so this update paused" in answer["note"]
    assert ("pause", "keep", True) in engine.calls and engine.calls[-1] == "resume"


def test_an_unknown_mode_is_refused_before_anything_happens():
    engine = Engine()
    status, answer, _ = _post(engine, {"version": 3, "mode": "sideways"})
    assert status == 400 and "mode must be one of pause, inflight, got 'sideways'" in answer["error"]["message"]
    assert engine.calls == []


def test_cache_salt_separates_versions_and_keeps_the_clients_salt():
    from vllm_ext._vllm_engine import cache_salt

    assert cache_salt(None) == "deltasync-vbase" and cache_salt(7) == "deltasync-v7"
    mine, theirs = cache_salt(7, "alice"), cache_salt(7, "bob")
    assert mine != theirs and mine.startswith("deltasync-v7-") and len(mine) <= 128
    assert cache_salt(8, "alice") != mine and cache_salt(7, "x" * 500) == cache_salt(7, "x" * 500)
    assert not set("@/\\\x00") & set(cache_salt(7, "a/b@c"))


def _inference(engine: Engine, path: str, body: dict, chunks: list[bytes], content_type: bytes, *, after=None):
    """Run one inference request through the middleware; what the app received, and what was sent."""
    from vllm_ext import UpdateMiddleware

    received: list[dict] = []
    sent: list[dict] = []

    async def app(scope, receive, send):
        message = await receive()
        received.append(json.loads(message["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", content_type)]})
        if after is not None:
            after(middleware)  # e.g. an update lands while the answer is generated
        for chunk in chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    middleware = UpdateMiddleware(app, token=TOKEN)
    scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": [(b"content-length", b"2")],
             "app": SimpleNamespace(state=SimpleNamespace(engine_client=engine))}  # fmt: skip
    middleware._sync(scope).served = engine.served
    raw = json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return received[0], sent


def _bump(middleware) -> None:
    middleware.sync.served += 1


def test_a_streamed_answer_ends_with_its_versions_before_done():
    engine = Engine(served=4)
    chunks = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n']
    request, sent = _inference(engine, "/v1/completions", {"prompt": "hi", "stream": True, "cache_salt": "me"}, chunks,
                               b"text/event-stream", after=_bump)  # fmt: skip
    assert request["cache_salt"].startswith("deltasync-v4-") and request["prompt"] == "hi"
    headers = dict(sent[0]["headers"])
    assert headers[b"x-deltasync-version"] == b"4" and b"x-deltasync-versions" not in headers
    body = b"".join(m.get("body", b"") for m in sent[1:])
    assert body.endswith(b": x-deltasync-versions 4-5\n\ndata: [DONE]\n\n")  # OpenAI clients skip comments


def test_a_whole_answer_carries_its_versions_in_a_header():
    engine = Engine(served=2)
    request, sent = _inference(engine, "/v1/chat/completions", {"messages": []}, [b'{"choices": []}'], b"application/json")
    assert request["cache_salt"] == "deltasync-v2"
    headers = dict(sent[0]["headers"])
    assert (headers[b"x-deltasync-version"], headers[b"x-deltasync-versions"]) == (b"2", b"2-2")


def test_weight_routes_hold_admissions_until_the_served_version_is_read_back():
    engine = Engine(served=1)
    for body, gated in [({"method": "deltasync_apply", "args": [2, None]}, True), ({"method": "deltasync_status"}, False)]:
        engine.reads = 0
        status, answer, passed = _post(engine, body, path="/collective_rpc")
        # An apply is run by the middleware itself (so where the version began is recorded),
        # and answered as vLLM's route answers; any other method goes on to vLLM.
        assert status == 200 and passed == ([] if gated else ["/collective_rpc"])
        assert engine.reads == (1 if gated else 0), body  # read back only after an apply
    assert engine.calls == [("deltasync_apply", 2, None)] and answer == {}
    engine.reads = 0
    status, _, passed = _post(engine, {"update_info": {"version": 2}}, path="/update_weights")
    assert passed == ["/update_weights"] and engine.reads == 1


def test_an_apply_whose_version_is_not_one_goes_on_to_vllm_and_still_holds_admissions():
    # Parsed where it enters: not an apply the middleware can run, so vLLM's route answers it
    # (with the workers' own refusal); the served version is still read back after it.
    engine = Engine(served=1)
    for args in (["2", None], [True], [2, 5]):
        engine.reads = 0
        _, _, passed = _post(engine, {"method": ApplyCall.method, "args": args}, path="/collective_rpc")
        assert passed == ["/collective_rpc"] and engine.reads == 1, args
    assert engine.calls == []


def test_token_version_log_tells_finished_requests_from_ones_sent_after_the_write():
    """The engine core reports the tokens of the requests it holds at the write; of the others,
    one sent before the write had finished, one sent after it has every token from the new version."""
    from deltasync.server.token_versions import TokenVersionLog
    from vllm_ext._vllm_engine import ENGINE_METHOD, VllmEngine

    held: dict[str, int] = {}
    sent: list[str] = []

    async def add_request_async(request):
        sent.append(request.request_id)

    async def call_utility_async(method, version, auth):
        assert method == ENGINE_METHOD
        return {"tokens": [[k, None, v] for k, v in held.items()], "answers": [{"version": version}]}

    engine = SimpleNamespace(engine_core=SimpleNamespace(add_request_async=add_request_async,
                                                         call_utility_async=call_utility_async))  # fmt: skip
    log = TokenVersionLog()
    log.hook(VllmEngine(engine))
    one, two, late = log.track(4), log.track(4), log.track(4)

    def request(internal: str, external: str):
        return SimpleNamespace(request_id=internal, external_req_id=external)

    async def scenario():
        # one: a completion of two prompts; two: a chat answer with two choices (n=2).
        await engine.engine_core.add_request_async(request(f"cmpl-{one}-1-abcdefgh", f"cmpl-{one}-1"))
        await engine.engine_core.add_request_async(request(f"cmpl-{one}-0-abcdefgh", f"cmpl-{one}-0"))
        await engine.engine_core.add_request_async(request(f"1_chatcmpl-{two}-ijklmnop", f"chatcmpl-{two}"))
        await engine.engine_core.add_request_async(request(f"0_chatcmpl-{two}-ijklmnop", f"chatcmpl-{two}"))
        held.update({f"cmpl-{one}-0-abcdefgh": 7, f"1_chatcmpl-{two}-ijklmnop": 3, f"0_chatcmpl-{two}-ijklmnop": 3})
        # cmpl-{one}-1 finished before the write
        assert await log.apply(VllmEngine(engine), ApplyCall(version=5)) == [{"version": 5}]
        await engine.engine_core.add_request_async(request(f"cmpl-{late}-0-qrstuvwx", f"cmpl-{late}-0"))
        held.clear()
        held[f"cmpl-{late}-0-qrstuvwx"] = 2
        await log.apply(VllmEngine(engine), ApplyCall(version=6))

    asyncio.run(scenario())
    assert log.versions(one) == [[(4, 0), (5, 7)], [(4, 0)]]  # prompt 0, then prompt 1 (finished before)
    assert log.versions(two) == [[(4, 0), (5, 3)], [(4, 0), (5, 3)]]
    assert log.versions(late) == [[(4, 0), (5, 0), (6, 2)]]  # sent after the first write
    for marker in (one, two, late):
        log.untrack(marker)
    assert log.versions(one) is None and log._applies == []  # nothing is kept for nobody


def test_an_apply_behind_the_flow_leaves_the_start_unknown_for_requests_it_straddles():
    """vLLM's own weight routes change the weights without the engine core's count: a request
    sent before shows the new version at an unknown token ('?'), one sent after at token 0."""
    from deltasync.protocol.token_versions import format_token_versions
    from deltasync.server.token_versions import TokenVersionLog
    from vllm_ext._vllm_engine import VllmEngine

    sent: list[str] = []

    async def add_request_async(request):
        sent.append(request.request_id)

    engine = SimpleNamespace(engine_core=SimpleNamespace(add_request_async=add_request_async))
    log = TokenVersionLog()
    log.hook(VllmEngine(engine))
    before, after = log.track(4), log.track(4)

    async def scenario():
        await engine.engine_core.add_request_async(SimpleNamespace(request_id=f"cmpl-{before}-0-ab", external_req_id=f"cmpl-{before}-0"))
        log.note_unknown(5)
        await engine.engine_core.add_request_async(SimpleNamespace(request_id=f"cmpl-{after}-0-cd", external_req_id=f"cmpl-{after}-0"))

    asyncio.run(scenario())
    assert log.versions(before) == [[(4, 0), (5, None)]] and format_token_versions(log.versions(before)) == "4:0,5:?"
    assert log.versions(after) == [[(4, 0), (5, 0)]]


def test_a_list_past_the_parsers_bounds_is_not_sent(caplog):
    """The server sends only lists a client parses: none past vLLM's largest n (MAX_CHOICES) or
    MAX_ENTRIES entries; the largest it sends parses back."""
    from deltasync.protocol import parse_token_versions
    from deltasync.protocol.token_versions import MAX_CHOICES, MAX_ENTRIES
    from deltasync.server.update_route import _versioned

    sent: list = []

    async def send(message) -> None:
        sent.append(message)

    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    cases = [([[(3, 0), (4, 2)]] * MAX_CHOICES, True), ([[(3, 0)]] * (MAX_CHOICES + 1), False),
             ([[(3, 0)] * (MAX_ENTRIES + 1)], False)]  # fmt: skip
    for choices, sends in cases:
        sent.clear()
        # The logger's own level: another test (or library) may have raised the root's.
        with caplog.at_level(logging.WARNING, logger="deltasync.server.update_route"):
            asyncio.run(_versioned(send, 3, lambda: 4, lambda choices=choices: choices)(start))
        headers = dict(sent[0]["headers"])
        assert headers[b"x-deltasync-version"] == b"3"
        assert (b"x-deltasync-token-versions" in headers) == sends
        if sends:
            assert parse_token_versions(headers[b"x-deltasync-token-versions"].decode()) == choices
    assert "pass the bounds of x-deltasync-token-versions; not sent" in caplog.text
