"""UpdateMiddleware called as a plain ASGI app with a recording engine client: the order of
pause, apply and resume, and what each refusal says.

Real servers answer the route in every integration test that updates a server
(``extension_args()`` adds the middleware), e.g. ``integration/vllm_ext/test_inplace.py``.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from servers import requires_vllm

pytestmark = requires_vllm

TOKEN = "s3cret"


class Engine:
    """Records the engine-client calls the route makes (status reads apart, in ``reads``);
    ``fail`` names a call that raises; its workers serve ``served`` and stage as soon as asked
    (``staged``: before the next call; else by the first status read after it), or fail to
    stage with ``stage_error``."""

    def __init__(self, fail: str | None = None, results: list | None = None, *, served: int | None = None,
                 stage_error: str | None = None, workers: int = 1, staged: bool = False) -> None:  # fmt: skip
        self.calls: list[object] = []
        self.reads = 0
        self.fail = fail
        self.results = results if results is not None else [{"version": 3}] * workers
        self.served = served
        self.stage_error = stage_error
        self.workers = workers
        self.staged = staged
        self.prefetch: dict | None = None
        self.engine_core = SimpleNamespace(pause_scheduler_async=self._pause)

    def _maybe_fail(self, name: str) -> None:
        if self.fail == name:
            raise RuntimeError(f"{name} failed")

    async def _pause(self, *, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode, clear_cache))
        self._maybe_fail("pause")

    def _status(self, prefetch: dict | None) -> list:
        return [{"rank": r, "version": self.served, "fingerprint": "00ff00ff00ff00ff", "mode": "in-place",
                 "prefetch": prefetch} for r in range(self.workers)]  # fmt: skip

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        if method == "deltasync_status":
            self.reads += 1
            return self._status(self.prefetch)
        self.calls.append((method, *args))
        self._maybe_fail(method)
        if method == "deltasync_begin":
            if args[0] == self.served:
                return self._status({"version": args[0], "state": "applied"})
            state = "failed" if self.stage_error else "ready"
            self.prefetch = {"version": args[0], "state": state, "error": self.stage_error}
            return self._status(self.prefetch if self.staged else {"version": args[0], "state": "running"})
        if method == "deltasync_apply" and not any(r.get("error") for r in self.results):
            self.served = args[0]
        return self.results

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("label", version))

    async def resume_generation(self) -> None:
        self.calls.append("resume")


def _post(engine: Engine, body: object, *, authorization: str | None = f"Bearer {TOKEN}", method: str = "POST",
          path: str = "/deltasync/update"):  # fmt: skip
    from vllm_ext import UpdateMiddleware

    passed: list[str] = []

    async def app(scope, receive, send):
        passed.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    state = SimpleNamespace(engine_client=engine)
    scope = {"type": "http", "method": method, "path": path, "root_path": "", "headers": headers,
             "app": SimpleNamespace(state=state)}  # fmt: skip
    sent: list[dict] = []
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(UpdateMiddleware(app, token=TOKEN)(scope, receive, send))
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:])), passed


STAGE = ("deltasync_begin", 3, "tag")


def test_stage_pause_apply_label_resume_in_one_request():
    engine = Engine()
    status, answer, passed = _post(engine, {"version": 3, "auth": "tag"})
    assert status == 200 and passed == []
    assert engine.calls == [STAGE, ("pause", "keep", True), ("deltasync_apply", 3, "tag"), ("label", "3"), "resume"]
    assert [r["version"] for r in answer["results"]] == [3] and 0 <= answer["paused_s"] < 5
    assert answer["noop"] is False


def test_a_version_already_served_is_a_noop_without_a_pause():
    engine = Engine(served=3)
    status, answer, _ = _post(engine, {"version": 3, "auth": "tag"})
    assert (status, answer["noop"], answer["results"], engine.calls) == (200, True, [], [STAGE])
    assert engine.reads == 0


@pytest.mark.parametrize("mode", ["inflight", "pause"])
def test_a_version_staged_already_takes_one_call_before_the_apply(mode):
    # Each call into the workers waits for an engine step to end: a prefetched version is
    # found staged by the call that reads the status, and nothing polls.
    engine = Engine(staged=True)
    status, answer, _ = _post(engine, {"version": 3, "auth": "tag", "mode": mode})
    assert status == 200 and answer["mode"] == mode and engine.reads == 0
    paused = [("pause", "keep", True)] if mode == "pause" else []
    assert engine.calls == [STAGE, *paused, ("deltasync_apply", 3, "tag"), ("label", "3"), *(["resume"] if paused else [])]
    # Not staged yet: the flow reads the status until it is.
    engine = Engine()
    assert _post(engine, {"version": 3, "auth": "tag", "mode": mode})[0] == 200 and engine.reads == 1


def test_a_version_that_cannot_be_staged_pauses_nothing():
    engine = Engine(stage_error="IntegrityError: deltas/00000003.safetensors: SHA-256 ... (corrupted or tampered)")
    status, answer, _ = _post(engine, {"version": 3, "auth": "tag"})
    message = answer["error"]["message"]
    assert status == 500 and "update to version 3 refused (IntegrityError): deltas/00000003" in message, message
    assert engine.calls == [STAGE] and engine.served is None


def test_a_failed_apply_still_resumes_and_keeps_the_workers_words():
    engine = Engine(fail="deltasync_apply")
    status, answer, _ = _post(engine, {"version": 3, "auth": "tag"})
    assert status == 500 and answer["error"]["message"] == "deltasync_apply failed"
    assert engine.calls == [STAGE, ("pause", "keep", True), ("deltasync_apply", 3, "tag"), "resume"]  # no label
    # A worker that reports an error without raising (not the last rank) is a failure too.
    engine = Engine(results=[{"version": 3, "error": "deltasync: refused on rank 0"}, {"version": 3}], workers=2)
    status, answer, _ = _post(engine, {"version": 3})
    assert status == 500 and answer["error"]["message"] == "deltasync: refused on rank 0"
    assert engine.calls[-1] == "resume" and ("label", "3") not in engine.calls


def test_a_failed_pause_applies_nothing_and_does_not_resume():
    engine = Engine(fail="pause")
    status, answer, _ = _post(engine, {"version": 3})
    assert status == 503 and answer["error"]["message"] == "pausing the server failed (RuntimeError: pause failed)"
    assert engine.calls == [("deltasync_begin", 3, None), ("pause", "keep", True)]


def test_refusals_before_anything_happens():
    for kwargs, body, want in [
        ({"authorization": None}, {"version": 1},
         (401, "/deltasync/update needs 'Authorization: Bearer <token>' with this server's DELTASYNC_TOKEN; none was sent")),
        ({"authorization": "Bearer wrong"}, {"version": 1}, (401, "/deltasync/update: the bearer token is wrong")),
        ({"method": "GET"}, {"version": 1}, (405, "/deltasync/update takes POST")),
        ({}, b"{not json", (400, "/deltasync/update: bad body")),
        ({}, [1], (400, 'the body must be a JSON object {"version": N, "auth": TAG, "mode": "pause"|"inflight"}')),
        ({}, {"version": 1, "path": "/etc"}, (400, "the body must be a JSON object")),
        # The version and the tag are parsed where they enter: nothing is staged or paused.
        ({}, {"version": "3", "auth": "tag"}, (400, "/deltasync/update: bad body (version must be a non-negative integer, got '3')")),
        ({}, {"version": True}, (400, "version must be a non-negative integer, got True")),
        ({}, {"auth": "tag"}, (400, "version must be a non-negative integer, got None")),
        ({}, {"version": 3, "auth": 5}, (400, "the auth tag of the update to version 3 must be a string, got int")),
    ]:
        engine = Engine()
        status, answer, passed = _post(engine, body, **kwargs)
        assert status == want[0] and want[1] in answer["error"]["message"], (kwargs, body, answer)
        assert engine.calls == [] and passed == []


def test_other_routes_pass_through():
    engine = Engine()
    for path in ("/v1/completions", "/deltasync/update/", "//deltasync/update"):
        status, _, passed = _post(engine, {"version": 1}, path=path)
        assert status == 200 and passed == [path]
    assert engine.calls == []


def _route(middleware_name: str, path: str, root_path: str = "") -> tuple[int, list[str]]:
    """What ``middleware_name`` does with a POST without a token to ``path``: the status sent,
    and the paths passed on to the app."""
    import vllm_ext

    passed: list[str] = []

    async def app(scope, receive, send):
        passed.append(scope["path"])
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    scope = {"type": "http", "method": "POST", "path": path, "root_path": root_path, "headers": [],
             "app": SimpleNamespace(state=SimpleNamespace())}  # fmt: skip
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(getattr(vllm_ext, middleware_name)(app, token=TOKEN)(scope, receive, send))
    return sent[0]["status"], passed


@pytest.mark.parametrize("middleware, route", [("UpdateMiddleware", "/deltasync/update"),
                                               ("LoraSyncMiddleware", "/deltasync/lora/update"),
                                               ("LoraSyncMiddleware", "/deltasync/lora/status")])  # fmt: skip
def test_routes_match_as_starlettes_router_does(middleware, route):
    # Served under --root-path, the route is matched after the prefix; a trailing slash or a
    # longer path is not the route (Starlette would not route it either) and goes to the app.
    assert _route(middleware, route) == (401, [])
    assert _route(middleware, "/rollout" + route, root_path="/rollout") == (401, [])
    for other in (route + "/", route + "x", "/rollout" + route):
        assert _route(middleware, other) == (404, [other])
