"""RolloutClient against fake servers (httpx.MockTransport): routes, bodies, auth, reports;
and, for the connections it keeps open, the same fake behind a real local HTTP server.

The real servers are exercised in tests/integration/vllm_ext/test_delta_server.py.
"""

from __future__ import annotations

import hashlib
import hmac
import http.server
import json
import threading
import time

import httpx
import pytest

from deltasync import (
    AdapterRolloutClient,
    BaseRolloutClient,
    ConfigError,
    RolloutClient,
    ServerResult,
    UpdateReport,
    VersionError,
)
from deltasync.control import client as client_module
from deltasync.protocol.auth import bearer_matches, update_tag
from deltasync.examples.launcher import free_port


class FakeServer:
    """Answers vLLM's routes like a server with vllm_ext, and records every request.

    ``one_route``: it also answers ``/deltasync/update`` (vllm_ext.UpdateMiddleware); without it,
    that route is a 404, as on a server started without the middleware.
    """

    def __init__(self, url: str, *, version: int | None = None, workers: int = 1, one_route: bool = False) -> None:
        self.url = url
        self.one_route = one_route
        self.version = version
        self.worker_versions: list[int | None] | None = None
        self.workers = workers
        self.requests: list[tuple[str, dict, object, str | None]] = []
        self.fail: dict[str, tuple[int, object]] = {}
        self.active = False
        self.delay = 0.0
        self.drop: dict[str, int] = {}  # route -> connections to drop before answering

    def handle(self, request: httpx.Request) -> httpx.Response:
        route = request.url.path
        body = json.loads(request.content) if request.content else None
        self.requests.append((route, dict(request.url.params), body, request.headers.get("authorization")))
        if self.drop.get(route):
            self.drop[route] -= 1
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if route in self.fail:
            status, payload = self.fail[route]
            return httpx.Response(status, json=payload)
        if route == "/deltasync/update" and self.one_route:
            time.sleep(self.delay)
            self.version = body["version"]
            return httpx.Response(200, json={"results": [{"version": self.version}], "paused_s": self.delay})
        if route == "/pause":
            time.sleep(self.delay)
            return httpx.Response(200, json={"status": "paused"})
        if route == "/start_weight_update":
            if self.active:
                return _vllm_error("start_weight_update called while a weight update is already active. "
                                   "Call finish_weight_update first.")
            self.active = True
            return httpx.Response(200, json={"message": "Weight update started"})
        if route == "/update_weights":
            self.active = False if body["update_info"]["version"] < 0 else self.active
            self.version = body["update_info"]["version"]
            return httpx.Response(200, json={"message": "Weights updated"})
        if route == "/finish_weight_update":
            self.active = False
            return httpx.Response(200, json={"message": "Weight update finished"})
        if route == "/resume":
            return httpx.Response(200, json={"status": "resumed"})
        if route == "/collective_rpc":
            versions = self.worker_versions or [self.version] * self.workers
            if body["method"] == "deltasync_status":
                results = [
                    {
                        "rank": rank,
                        "version": v,
                        "fingerprint": None if v is None else f"fp{v}",
                        "last_update": None if v is None else {
                            "version": v, "kind": "delta", "nbytes": 123, "stage_s": 0.01, "apply_s": 0.002 * (rank + 1),
                        },
                    }
                    for rank, v in enumerate(versions)
                ]  # fmt: skip
                return httpx.Response(200, json={"results": results})
            if body["method"] == "deltasync_prefetch":
                version = body["args"][0]
                return httpx.Response(200, json={"results": [{"version": version, "state": "running", "error": None}]})
        return httpx.Response(404, json={"detail": "Not Found"})

    def routes(self) -> list[str]:
        return [r for r, *_ in self.requests]

    def legacy_routes(self) -> list[str]:
        """The routes after the client's one-route attempt, which this server answered with 404."""
        routes = self.routes()
        assert not self.one_route and routes[0] == "/deltasync/update", routes
        return routes[1:]


def _vllm_error(message: str, status: int = 500) -> httpx.Response:
    return httpx.Response(status, json={"error": {"message": message, "type": "InternalServerError", "code": status}})


def _client(servers: list[FakeServer], token: str | None = None, **kwargs) -> RolloutClient:
    by_host = {httpx.URL(s.url).netloc.decode(): s for s in servers}
    transport = httpx.MockTransport(lambda request: by_host[request.url.netloc.decode()].handle(request))
    return RolloutClient([s.url for s in servers], token, transport=transport, **kwargs)


UPDATE_ROUTES = [
    "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume", "/collective_rpc",
]  # fmt: skip


def test_update_runs_vllms_weight_update_sequence_with_tag_and_bearer():
    server = FakeServer("http://a:8000")
    server.delay = 0.05
    client = _client([server], token="s3cret")
    report = client.update(3)
    assert server.legacy_routes() == UPDATE_ROUTES
    by_route = {route: (params, body) for route, params, body, _ in server.requests}
    # The pause empties the prefix cache: no separate /reset_prefix_cache round trip.
    assert by_route["/pause"][0] == {"mode": "keep", "clear_cache": "true"}
    assert by_route["/update_weights"][1] == {"update_info": {"version": 3, "auth": update_tag("s3cret", 3)}}
    assert by_route["/finish_weight_update"][1] == {"weight_version": "3"}
    assert by_route["/collective_rpc"][1]["method"] == "deltasync_status"
    assert {auth for *_, auth in server.requests} == {"Bearer s3cret"}
    assert isinstance(report, UpdateReport) and report.ok and report.version == 3
    assert report.updated == ["http://a:8000"] and report.failed == []
    (result,) = report.results
    assert result == ServerResult(
        url="http://a:8000", ok=True, version=3, fingerprint="fp3", kind="delta", nbytes=123, stage_s=0.01,
        apply_s=0.002, paused_s=result.paused_s, error=None,
    )  # fmt: skip
    assert 0.05 <= result.paused_s == report.paused_s < 5
    # The client remembers that this server has no one-request route.
    server.requests.clear()
    assert client.update(4).ok and server.routes() == UPDATE_ROUTES


def test_update_is_one_request_where_the_server_has_the_update_route():
    server = FakeServer("http://a:8000", one_route=True)
    server.delay = 0.05
    report = _client([server], token="s3cret").update(3)
    assert server.routes() == ["/deltasync/update", "/collective_rpc"]
    (_route, params, body, auth) = server.requests[0]
    assert body == {"version": 3, "auth": update_tag("s3cret", 3)} and auth == "Bearer s3cret" and params == {}
    (result,) = report.results
    assert report.ok and result.version == 3 and result.fingerprint == "fp3" and result.kind == "delta"
    assert 0.05 <= result.paused_s < 5


def test_a_refused_one_request_update_reports_the_servers_words():
    server = FakeServer("http://a:8000", version=2, one_route=True)
    message = "deltasync: update to version 3 refused (IntegrityError): ..."
    server.fail["/deltasync/update"] = (500, {"error": {"message": message, "type": "UpdateError", "code": 500}})
    client = _client([server], token="t")
    (failed,) = client.update(3).failed
    assert failed.error == f"POST /deltasync/update: HTTP 500: {message}"
    assert failed.version == 2 and failed.fingerprint == "fp2" and failed.kind is None
    # The server resumes by itself: no route of vLLM's sequence is called, then or on the next update.
    assert server.routes() == ["/deltasync/update", "/collective_rpc"]
    del server.fail["/deltasync/update"]
    assert client.update(3).ok and server.routes()[2:] == ["/deltasync/update", "/collective_rpc"]


def test_update_tag_is_hmac_sha256_of_the_version():
    expected = hmac.new(b"s3cret", b"deltasync-update:3", hashlib.sha256).hexdigest()
    assert update_tag("s3cret", 3) == expected
    assert expected == "7c5b1071cbb5f6d9052b5c6359f6aa1d693ef430438bdd11712ddd95d51886bd"  # pinned for other clients
    assert update_tag("s3cret", 4) != expected and update_tag("other", 3) != expected
    assert bearer_matches("s3cret", "Bearer s3cret") and bearer_matches("s3cret", "bearer s3cret")
    assert not bearer_matches("s3cret", "Bearer s3cre") and not bearer_matches("s3cret", None)
    assert not bearer_matches("s3cret", "Basic s3cret") and not bearer_matches("s3cret", "s3cret")


def test_without_a_token_nothing_is_signed():
    server = FakeServer("http://a:8000")
    _client([server]).update(0)
    assert {auth for *_, auth in server.requests} == {None}
    update = next(body for route, _, body, _ in server.requests if route == "/update_weights")
    assert update == {"update_info": {"version": 0, "auth": None}}


def test_a_refused_update_still_resumes_and_reports_the_servers_words():
    server = FakeServer("http://a:8000", version=2)
    message = ("Call to collective_rpc method failed: Worker failed with error 'deltasync: update to version 3 "
               "refused (IntegrityError): .../deltas/00000003.safetensors (version 3): SHA-256 ...'")
    server.fail["/update_weights"] = (500, {"error": {"message": message, "type": "InternalServerError"}})
    report = _client([server], token="t").update(3)  # does not raise
    assert server.legacy_routes() == [
        "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume", "/collective_rpc",
    ]  # fmt: skip
    # The session is closed without a version label: the served version did not change.
    assert server.requests[4][2] is None
    assert not report.ok and report.updated == []
    (failed,) = report.failed
    assert failed.error == f"POST /update_weights: HTTP 500: {message}"
    assert failed.version == 2 and failed.fingerprint == "fp2" and failed.kind is None and failed.paused_s > 0


def test_resume_is_retried_on_a_dropped_connection():
    # vLLM closes the connection after a 500; the resume sent right after must still arrive.
    server = FakeServer("http://a:8000", version=2)
    server.fail["/update_weights"] = (500, {"error": {"message": "refused"}})
    server.drop["/resume"] = 2
    (result,) = _client([server]).update(3).results
    assert server.routes().count("/resume") == 3 and result.error == "POST /update_weights: HTTP 500: refused"
    server.drop["/resume"] = 3
    (result,) = _client([server]).update(3).results
    assert result.error == (
        "POST /update_weights: HTTP 500: refused; then POST /resume: RemoteProtocolError: Server disconnected "
        "without sending a response. (the server may still be paused)"
    )


def test_one_failed_server_does_not_stop_the_others():
    good, bad = FakeServer("http://good:1"), FakeServer("http://bad:2")
    bad.fail["/pause"] = (401, {"error": {"message": "/pause: the bearer token is wrong", "type": "Unauthorized"}})
    report = _client([good, bad], token="t").update(5)
    assert report.updated == ["http://good:1"]
    assert [r.url for r in report.failed] == ["http://bad:2"]
    assert report.failed[0].error == "POST /pause: HTTP 401: /pause: the bearer token is wrong"
    assert "/resume" in bad.routes() and "/update_weights" not in bad.routes()
    assert report.paused_s == max(r.paused_s for r in report.results)


def test_an_unreachable_server_is_reported():
    url = f"http://127.0.0.1:{free_port()}"
    report = RolloutClient(url, timeout=5).update(1)
    (result,) = report.failed
    assert result.url == url and result.error.startswith("POST /deltasync/update: ConnectError")


def test_a_stale_weight_update_session_is_closed_first():
    server = FakeServer("http://a:8000")
    server.active = True  # a client died between start and finish
    assert _client([server]).update(1).ok
    assert server.legacy_routes()[:4] == ["/pause", "/start_weight_update", "/finish_weight_update", "/start_weight_update"]


def test_wrong_version_after_the_update_or_a_pause_that_cannot_empty_the_cache_is_a_failure():
    server = FakeServer("http://a:8000")
    # vLLM's pause answers 500 when it cannot empty the prefix cache: nothing is loaded then.
    server.fail["/pause"] = (500, {"error": "Failed to pause generation: Failed to reset the KV connector cache."})
    (result,) = _client([server]).update(1).results
    assert not result.ok and "Failed to reset the KV connector cache" in result.error
    assert server.legacy_routes()[:2] == ["/pause", "/resume"] and "/update_weights" not in server.routes()

    lagging = FakeServer("http://b:8000")
    lagging.worker_versions = [0]  # the server keeps reporting the old version
    (result,) = _client([lagging]).update(1).results
    assert not result.ok
    assert result.error == "the server reports version 0 after the update to version 1"


def test_status_reports_disagreeing_workers():
    server = FakeServer("http://a:8000")
    server.worker_versions = [3, 3]
    status = _client([server]).status()["http://a:8000"]
    assert status.ok and (status.version, status.fingerprint) == (3, "fp3") and len(status.workers) == 2
    server.worker_versions = [3, 2]
    status = _client([server]).status()["http://a:8000"]
    assert not status.ok and status.version is None
    assert status.error == "the server's workers disagree: rank 0 at version 3 (fp3); rank 1 at version 2 (fp2)"
    server.fail["/collective_rpc"] = (500, {"error": {"message": "Call to collective_rpc method failed: no such method"}})
    status = _client([server]).status()["http://a:8000"]
    assert not status.ok and status.error == "POST /collective_rpc: HTTP 500: Call to collective_rpc method failed: no such method"


def test_prefetch_asks_every_server_to_stage_in_the_background():
    servers = [FakeServer("http://a:1", version=1), FakeServer("http://b:2", version=1)]
    results = _client(servers, token="t", timeout=30).prefetch(2)
    assert list(results) == ["http://a:1", "http://b:2"] and all(r.ok for r in results.values())
    assert results["http://a:1"].version == 1  # still serving the old version
    for server in servers:
        route, _, body, auth = server.requests[0]
        assert (route, auth) == ("/collective_rpc", "Bearer t")
        assert body == {"method": "deltasync_prefetch", "args": [2, update_tag("t", 2)], "timeout": 30.0}


def test_a_prefetch_refused_by_any_worker_is_a_failure():
    server = FakeServer("http://a:8000", version=1)
    refusal = "deltasync: prefetch of version 9 refused: version 9 is not committed in file:///b (the newest is 1)"
    server.fail["/collective_rpc"] = (200, {"results": [{"version": 9, "error": refusal}, {"version": 9, "error": None}]})
    (result,) = _client([server]).prefetch(9).values()
    assert not result.ok and result.error == refusal


def test_bad_arguments():
    with pytest.raises(ConfigError, match="urls is empty"):
        RolloutClient([])
    with pytest.raises(ConfigError, match="lists a server twice"):
        RolloutClient(["http://a:1", "http://a:1/"])
    with pytest.raises(ConfigError, match="must start with http:// or https://"):
        RolloutClient("a:1")
    with pytest.raises(ConfigError, match="token is empty"):
        RolloutClient("http://a:1", "")
    client = RolloutClient("http://a:1")
    for version in (-1, True, "3", 1.0):
        with pytest.raises(VersionError, match="version must be a non-negative integer"):
            client.update(version)  # type: ignore[arg-type]


def test_the_adapter_client_shares_the_base_and_stages_nothing():
    requests: list[tuple[str, object]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        requests.append((request.url.path, body))
        if request.url.path == "/deltasync/lora/update":
            return httpx.Response(200, json={"version": body["version"], "fingerprint": "fp3", "kind": "delta", "nbytes": 10})
        if request.url.path == "/deltasync/lora/status":
            return httpx.Response(200, json={"version": 3, "fingerprint": "fp3"})
        return httpx.Response(404, json={"detail": "Not Found"})

    client = AdapterRolloutClient("http://a:8000", "t", lora_name="policy", keep=3, transport=httpx.MockTransport(handle))
    assert isinstance(client, BaseRolloutClient) and not isinstance(client, RolloutClient)
    (result,) = client.update(3).results
    assert result.ok and (result.version, result.fingerprint, result.nbytes, result.paused_s) == (3, "fp3", 10, 0.0)
    assert requests == [("/deltasync/lora/update", {"version": 3, "auth": update_tag("t", 3), "name": "policy", "keep": 3})]
    assert client.status()["http://a:8000"].version == 3 and client.adapter_name(3) == "policy-v3"
    # What it used to disable is deprecated: it warns and asks nothing of the servers.
    with pytest.warns(DeprecationWarning, match=r"AdapterRolloutClient\.prefetch is deprecated"):
        assert client.prefetch(4) == {}
    with pytest.warns(DeprecationWarning, match=r"AdapterRolloutClient\.wait_prefetched is deprecated"):
        assert client.wait_prefetched(4) == {"http://a:8000": True}
    assert len(requests) == 2


def test_the_adapter_clients_old_mode_and_served_calls_warn_and_work_as_before():
    adapter_requests: list[tuple[str, object]] = []

    def handle_adapter(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        adapter_requests.append((request.url.path, body))
        return httpx.Response(200, json={"version": body["version"], "fingerprint": "fp5", "kind": "delta"})

    client = AdapterRolloutClient("http://a:8000", "t", transport=httpx.MockTransport(handle_adapter))
    # update(mode=...) warns and sends the same request as without it; a bad mode is still refused.
    with pytest.warns(DeprecationWarning, match=r"AdapterRolloutClient\.update\(mode=\.\.\.\) is deprecated: adapter servers have one update mode"):
        assert client.update(5, mode="inflight").ok
    assert adapter_requests == [("/deltasync/lora/update", {"version": 5, "auth": update_tag("t", 5), "name": "trl-policy", "keep": 2})]
    with pytest.raises(ConfigError, match="mode must be"):
        client.update(5, mode="fast")  # type: ignore[arg-type]

    # served() / wait_served() warn and answer what RolloutClient's do for the same servers.
    headers: list[str | None] = []

    def handle_base(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("authorization"))
        assert (request.method, request.url.path) == ("GET", "/deltasync/status")
        worker = {"rank": 0, "version": 4, "fingerprint": "fp4", "mode": "in-place"}
        follow = {"enabled": True, "interval": 1.0, "latest_seen": 4, "lag": 0}
        return httpx.Response(200, json={"version": 4, "fingerprint": "fp4", "mode": "in-place", "follow": follow, "workers": [worker]})

    transport = httpx.MockTransport(handle_base)
    adapter = AdapterRolloutClient(["http://a:8000", "http://b:8000"], "t", timeout=5, transport=transport)
    base = RolloutClient(["http://a:8000", "http://b:8000"], "t", timeout=5, transport=transport)
    with pytest.warns(DeprecationWarning, match=r"AdapterRolloutClient\.served is deprecated: it reports the base model's"):
        served = adapter.served()
    assert served == base.served() and served["http://b:8000"].version == 4 and served["http://b:8000"].follow["lag"] == 0
    with pytest.warns(DeprecationWarning, match=r"AdapterRolloutClient\.wait_served is deprecated: .* use status\(\)"):
        waited = adapter.wait_served(4, timeout=1)
    assert waited == base.wait_served(4, timeout=1) == served
    assert set(headers) == {"Bearer t"}


def test_waiting_for_staging_backs_off(monkeypatch):
    """Each status read is a call into every worker between two engine steps: the wait starts at
    ``poll`` and doubles up to MAX_POLL_S, so a staging of seconds costs a handful of reads."""
    import deltasync.control.client as client_module

    server = FakeServer("http://a:8000", version=2)
    answer = server.handle
    reads = []

    def handle(request: httpx.Request) -> httpx.Response:
        response = answer(request)
        if request.url.path == "/collective_rpc" and json.loads(request.content)["method"] == "deltasync_status":
            reads.append(1)
            results = response.json()["results"]
            state = "ready" if len(reads) >= 8 else "running"
            return httpx.Response(200, json={"results": [{**r, "prefetch": {"version": 3, "state": state}} for r in results]})
        return response

    server.handle = handle
    slept: list[float] = []
    monkeypatch.setattr(client_module.time, "sleep", slept.append)
    assert _client([server]).wait_prefetched(3, poll=0.05) == {"http://a:8000": True}
    assert len(reads) == 8 and slept == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4]
    assert client_module.MAX_POLL_S == 0.4


class _Counted(http.server.BaseHTTPRequestHandler):
    """A real HTTP/1.1 server's handler that keeps connections open, answers as ``fake`` does,
    and counts the TCP connections it accepted."""

    protocol_version = "HTTP/1.1"
    fake: FakeServer
    connections: list[tuple[str, int]]

    def setup(self) -> None:
        super().setup()
        self.connections.append(self.client_address)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        request = httpx.Request("POST", self.fake.url + self.path, content=body, headers=dict(self.headers))
        response = self.fake.handle(request)
        response.read()
        self.send_response(response.status_code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(response.content)))
        self.end_headers()
        self.wfile.write(response.content)

    def log_message(self, *args: object) -> None:
        pass


def test_calls_share_one_client_and_its_open_connection(monkeypatch):
    """Many calls, one TCP connection: no call makes a client of its own (each would load the
    TLS certificates again, 10-30 ms of CPU, and open a new connection)."""
    port = free_port()
    fake = FakeServer(f"http://127.0.0.1:{port}", version=3, one_route=True)
    handler = type("Handler", (_Counted,), {"fake": fake, "connections": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with RolloutClient(fake.url, "t0ken") as client:
            for version in range(4, 8):
                assert client.update(version).ok
                assert client.status()[fake.url].version == version
            assert len(handler.connections) == 1, handler.connections
            assert fake.routes().count("/deltasync/update") == 4
            assert {auth for *_, auth in fake.requests} == {"Bearer t0ken"}
        # Closed: the next call opens a new connection, and works.
        assert client.status()[fake.url].version == 7
        assert len(handler.connections) == 2
        client.close()
        # The adapter client's calls through its base client share its connection too.
        adapters = AdapterRolloutClient(fake.url, "t0ken", lora_name="policy")
        adapters.status()
        adapters._base_client().status()
        assert len(handler.connections) == 3
        adapters.close()
        # A connection idle for longer than KEEPALIVE_S is not used again (vLLM's server closes
        # one after 5 s): the next call opens a new one.
        monkeypatch.setattr(client_module, "KEEPALIVE_S", 0.2)
        with RolloutClient(fake.url, "t0ken") as client:
            client.status()
            client.status()
            assert len(handler.connections) == 4
            time.sleep(0.4)
            client.status()
            assert len(handler.connections) == 5
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_fleet_of_more_than_a_hundred_servers_is_updated_all_at_once():
    """One shared client, no cap on its connections: 110 servers' updates are all in flight at
    once (httpx's default pool would hold the last 10 back until others finished). Every server
    here is one real HTTP server on 110 loopback addresses, and its update route answers only
    once all 110 updates have arrived."""
    servers = 110
    arrived = threading.Barrier(servers, timeout=120)  # a loaded machine connects slowly

    class Fleet(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path == "/deltasync/update":
                try:
                    arrived.wait()
                except threading.BrokenBarrierError:
                    self.send_error(503, "not every update arrived at once")
                    return
                answer = {"results": [{"version": body["version"]}], "paused_s": 0.0}
            else:  # the status read after the update
                answer = {"results": [{"rank": 0, "version": 1, "fingerprint": "fp1", "last_update": None}]}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        request_queue_size = 2 * servers  # socketserver's backlog of 5 drops connections and retries them seconds later

    port = free_port()
    httpd = Server(("", port), Fleet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.{i}:{port}" for i in range(2, 2 + servers)]
        with RolloutClient(urls, timeout=300) as client:
            report = client.update(1)
        assert report.ok, report.failed[:2]
        assert [r.url for r in report.results] == urls
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_forked_child_makes_its_own_client_and_leaves_its_parents_open():
    import os

    client = RolloutClient("http://a:8000", transport=httpx.MockTransport(lambda request: httpx.Response(404)))
    parent = client._connections.get()
    pid = os.fork()
    if pid == 0:  # the child: a new client; the parent's stays as it was
        ok = client._connections.get() is not parent and not parent.is_closed
        client.close()
        os._exit(0 if ok and not parent.is_closed else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client._connections.get() is parent and not parent.is_closed
    client.close()
    assert parent.is_closed
