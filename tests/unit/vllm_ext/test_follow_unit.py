"""Follow mode, the status route and the version header, on a real local bucket with the
engine client recorded (``test_update_route.Engine``); real servers follow in
``integration/vllm_ext/test_follow_server.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from helpers import small_transformer, train_step
from servers import requires_vllm
from test_update_route import TOKEN, Engine, _post

from deltasync import DeltaPublisher
from deltasync.protocol.auth import update_tag

pytestmark = requires_vllm


def _sync(engine: Engine, bucket, *, interval: float = 0.5, token: str | None = TOKEN):
    from deltasync.server.server_sync import FollowConfig, ServerSync
    from vllm_ext._vllm_engine import VllmEngine

    return ServerSync(VllmEngine(engine), token=token, follow=FollowConfig(enabled=True, interval=interval, bucket=str(bucket)))


def _publish(bucket, versions: int):
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    with DeltaPublisher(bucket, model, opt) as publisher:
        for v in range(versions):
            if v:
                train_step(model, opt, seed=v)
            publisher.publish()


def test_the_follower_goes_straight_to_the_newest_version(tmp_path):
    bucket = tmp_path / "bucket"
    _publish(bucket, 4)
    engine = Engine(results=[{"version": 3}])
    sync = _sync(engine, bucket)
    delay = asyncio.run(sync.follow_once())
    tag = update_tag(TOKEN, 3)  # the follower tags its own updates with the server's token
    # The workers are handed the pointer the follower read, byte for byte: none reads it again.
    pointer = (bucket / "latest.json").read_bytes()
    assert engine.calls == [("deltasync_begin", 3, tag, pointer), ("pause", "keep", True), ("deltasync_apply", 3, tag),
                            ("label", "3"), "resume"]  # fmt: skip
    assert (delay, sync.served, sync.latest_seen, sync.last_error) == (0.5, 3, 3, None)
    engine.calls.clear()
    assert asyncio.run(sync.follow_once()) == 0.5 and engine.calls == []  # nothing newer: no update
    status = sync.follow_status()
    assert status["lag"] == 0 and status["enabled"] is True and status["last_update_at"] is not None


def test_a_bucket_that_fails_backs_off_keeps_serving_and_recovers(tmp_path):
    bucket = tmp_path / "bucket"
    engine = Engine()
    sync = _sync(engine, bucket)
    delays = [asyncio.run(sync.follow_once()) for _ in range(3)]  # nothing committed yet
    assert delays == [1.0, 2.0, 4.0]
    assert "VersionError" in sync.last_error and "no version is committed" in sync.last_error
    bucket.mkdir()
    (bucket / "latest.json").write_text('{"format": "deltasync", "format_version": 3, "version": "9"}')
    assert asyncio.run(sync.follow_once()) == 8.0
    assert "latest.json" in sync.last_error and "version" in sync.last_error
    assert engine.calls == [] and sync.served is None  # nothing was staged or paused
    sync.follower._failures = 10_000  # days of failures: the wait stays at its bound, the follower goes on
    assert asyncio.run(sync.follow_once()) == 60.0
    (bucket / "latest.json").unlink()
    _publish(bucket, 2)
    engine.results = [{"version": 1}]
    assert asyncio.run(sync.follow_once()) == 0.5  # repaired: on at the normal interval
    assert (sync.served, sync.last_error) == (1, None)


def test_a_file_that_fails_to_stage_is_reported_and_retried(tmp_path):
    bucket = tmp_path / "bucket"
    _publish(bucket, 2)
    engine = Engine(stage_error="IntegrityError: deltas/00000001.safetensors: SHA-256 does not match")
    sync = _sync(engine, bucket)
    assert asyncio.run(sync.follow_once()) == 1.0
    assert "update to version 1 refused (IntegrityError): deltas/00000001.safetensors" in sync.last_error
    assert sync.last_error.endswith("; still serving the checkpoint it started with")
    assert all(call[0] == "deltasync_begin" for call in engine.calls)  # never paused
    engine.stage_error, engine.results = None, [{"version": 1}]
    asyncio.run(sync.follow_once())
    assert (sync.served, sync.last_error) == (1, None)


def test_push_and_follow_never_apply_twice_or_go_back(tmp_path):
    bucket = tmp_path / "bucket"
    _publish(bucket, 3)
    engine = Engine(results=[{"version": 2}])
    sync = _sync(engine, bucket)

    async def both():
        # A push and a follower read at once: they take turns; the second finds it served.
        return await asyncio.gather(sync.bring_to(2, update_tag(TOKEN, 2)), sync.follow_once())

    outcome, _ = asyncio.run(both())
    assert outcome.ok and engine.calls.count(("label", "2")) == 1
    assert sum(1 for c in engine.calls if c[0] == "pause") == 1
    older = asyncio.run(sync.bring_to(1, update_tag(TOKEN, 1)))
    assert not older.noop  # an older version goes to the workers, which refuse it (integration test)


def test_status_route_and_version_header():
    engine = Engine(served=7, workers=2)
    status, body, _ = _post(engine, None, method="GET", path="/deltasync/status")
    assert status == 200
    assert (body["version"], body["fingerprint"], body["mode"]) == (7, "00ff00ff00ff00ff", "in-place")
    assert [w["rank"] for w in body["workers"]] == [0, 1] and body["follow"]["enabled"] is False
    for kwargs, want in [({"authorization": None}, 401), ({"authorization": "Bearer no"}, 401), ({"method": "POST"}, 405)]:
        status, body, _ = _post(engine, None, path="/deltasync/status", **{"method": "GET", **kwargs})
        assert status == want, (kwargs, body)


def test_completions_carry_the_version_served_at_admission():
    from vllm_ext import UpdateMiddleware

    engine = Engine(served=5)
    sent: list[dict] = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def run(path: str) -> None:
        middleware = UpdateMiddleware(app, token=TOKEN)
        scope = {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": [],
                 "app": SimpleNamespace(state=SimpleNamespace(engine_client=engine))}  # fmt: skip
        middleware._sync(scope).served = 5

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            sent.append(message)

        await middleware(scope, receive, send)

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        sent.clear()
        asyncio.run(run(path))
        headers = dict(sent[0]["headers"])
        assert headers.get(b"x-deltasync-version") == (None if path == "/v1/models" else b"5"), path


def test_follow_settings_from_the_environment():
    from deltasync import ConfigError
    from deltasync.server.server_sync import FollowConfig

    config = FollowConfig.from_env({"DELTASYNC_FOLLOW": "1", "DELTASYNC_BUCKET": "/b", "DELTASYNC_FOLLOW_INTERVAL": "0.25"})
    assert (config.enabled, config.interval, config.bucket) == (True, 0.25, "/b")
    assert FollowConfig.from_env({}).enabled is False and FollowConfig.from_env({}).interval == 2.0
    for env, message in [
        ({"DELTASYNC_FOLLOW": "maybe"}, "DELTASYNC_FOLLOW must be 1 or 0"),
        ({"DELTASYNC_FOLLOW": "1"}, "needs the bucket to follow"),
        ({"DELTASYNC_FOLLOW_INTERVAL": "soon"}, "must be a number of seconds"),
        ({"DELTASYNC_FOLLOW_INTERVAL": "-1"}, "must be a positive number of seconds"),
    ]:
        with pytest.raises(ConfigError, match=message):
            FollowConfig.from_env(env)


def test_metrics_count_updates_failures_and_bytes_of_their_own_flow(tmp_path):
    from prometheus_client import CollectorRegistry

    bucket = tmp_path / "bucket"
    _publish(bucket, 2)
    engine = Engine(results=[{"version": 1, "nbytes": 1234}])
    sync = _sync(engine, bucket)
    failing = _sync(Engine(fail="deltasync_apply"), bucket)  # a second flow in the process counts apart
    value = sync.metrics.registry.get_sample_value
    assert value("deltasync_served_version") == -1 and value("deltasync_update_seconds_count") == 0
    asyncio.run(sync.follow_once())
    assert value("deltasync_served_version") == 1 and value("deltasync_latest_version") == 1
    assert value("deltasync_downloaded_bytes_total") == 1234 and value("deltasync_update_seconds_count") == 1
    asyncio.run(failing.bring_to(1, update_tag(TOKEN, 1)))
    assert failing.metrics.registry.get_sample_value("deltasync_update_failures_total") == 1
    assert value("deltasync_update_failures_total") == 0
    # Exposed on a registry (vLLM's /metrics serves the default one) from start-up to shutdown;
    # a second flow's series cannot be exposed beside them, and the first stays.
    served = CollectorRegistry(auto_describe=True)
    sync.metrics.expose(served)
    failing.metrics.expose(served)
    assert served.get_sample_value("deltasync_downloaded_bytes_total") == 1234
    assert served.get_sample_value("deltasync_update_failures_total") == 0
    sync.metrics.hide()
    assert served.get_sample_value("deltasync_served_version") is None


def test_the_server_reads_its_environment_in_one_config() -> None:
    from deltasync import ConfigError
    from deltasync.server.config import ServerConfig

    assert ServerConfig.from_env({}) == ServerConfig()
    env = {
        "DELTASYNC_BUCKET": "/b", "DELTASYNC_TOKEN": "t", "DELTASYNC_FOLLOW": "yes", "DELTASYNC_FOLLOW_INTERVAL": "0.5",
        "DELTASYNC_UPDATE_MODE": "inflight", "DELTASYNC_PUBLIC_ROUTES": "/x", "DELTASYNC_CPU_PLAIN_GEMM": " 1 ",
        "DELTASYNC_TEST_HOOKS": "1",
    }  # fmt: skip
    assert ServerConfig.from_env(env) == ServerConfig(
        bucket="/b", token="t", follow=True, follow_interval=0.5, update_mode="inflight", public_routes="/x",
        plain_gemm="1", test_hooks=True,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="DELTASYNC_UPDATE_MODE must be one of pause, inflight, got 'fast'"):
        ServerConfig.from_env({"DELTASYNC_UPDATE_MODE": "fast"})
