"""Real vLLM-CPU servers following a bucket: updates are exact, refusals are safe.

One server with the extension (``server``) lives through the whole module and follows a
bucket that a trainer-side fp32 model publishes into. It loads the test worker extension (the
production one plus test hooks), for the step delay of the in-flight update test. After each update its greedy tokens
and logprobs must equal those of a server started fresh from the same bf16 weights (started
one at a time, only for the versions that need one). Server starts are the cost here:
six in all (the main server, three references, a late joiner, a restart).
"""

from __future__ import annotations

import copy
import json
import re
import sys
import threading
import time

import pytest
import requests
import torch
from token_boundaries import running
from servers import (
    PROMPTS,
    SERVER_START_TIMEOUT,
    Trainer,
    extension_args,
    greedy,
    requires_vllm,
    running_server,
    server_env,
)

from deltasync import RolloutClient, parse_token_versions
from deltasync.protocol.auth import update_tag
from deltasync.examples.launcher import VLLMServer

pytestmark = [pytest.mark.server, requires_vllm]

TOKEN = "test-token-3f9a"
EXTENSION_ARGS = extension_args(middleware=True)
# Token ids, not text: 297 tokens span three 128-token KV blocks, so a prefix cache that
# kept KV from the old weights would change the answer.
LONG_PROMPT = list(range(3, 300))
TIMINGS: list[dict] = []


class World(Trainer):
    """The trainer side: an fp32 model, a publisher, and reference servers on demand."""

    def __init__(self, model_dir, root) -> None:
        # Deltas only (no size rule), so that small edits and full AdamW steps both travel as deltas.
        super().__init__(model_dir, root)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.steps = 0
        # The anchor is not the checkpoint the servers start from, so loading it shows.
        with torch.no_grad():
            self.model.get_parameter("model.layers.1.self_attn.v_proj.weight")[:16] += 0.05
        self.publisher.publish()
        self.anchor_fingerprint = self.fingerprint  # version 0, what a fresh server serves
        self.anchor_model = copy.deepcopy(self.model)  # for the anchor's reference, whatever ran since

    def adamw_step(self) -> int:
        gen = torch.Generator().manual_seed(self.steps)
        ids = torch.randint(0, self.model.config.vocab_size, (2, 32), generator=gen)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        result = self.publisher.publish()
        assert result.kind == "delta" and result.changed > result.total // 2
        return result.version


@pytest.fixture(scope="module")
def world(tiny_model_factory, tmp_path_factory):
    return World(tiny_model_factory(seed=0), tmp_path_factory.mktemp("delta-server"))


def _server_env(world: World) -> dict[str, str]:
    return {"DELTASYNC_BUCKET": str(world.bucket), "DELTASYNC_TOKEN": TOKEN, "DELTASYNC_TEST_HOOKS": "1"}


@pytest.fixture(scope="module")
def server(world):
    with running_server(
        world.model_dir, env=_server_env(world), extra_args=EXTENSION_ARGS, log_file=world.root / "server.log"
    ) as srv:
        yield srv
    if TIMINGS:
        print("\nupdate timings (s):")
        for row in TIMINGS:
            print("  " + json.dumps(row))


@pytest.fixture
def client(server):
    return RolloutClient(server.url, TOKEN)  # per test: a restarted server may have a new port


# Every test brings the shared servers to the state it needs, so any one runs alone and in any order.


def _fresh(srv) -> None:
    """Restart ``srv`` if it was ever updated: it serves the model directory again."""
    (status,) = RolloutClient(srv.url, TOKEN).status().values()
    if status.version is not None:
        srv.stop()
        srv.start(timeout=SERVER_START_TIMEOUT)


def _current(world: World, *servers) -> None:
    """Update each server that does not serve the newest committed version to it."""
    for srv in servers:
        one = RolloutClient(srv.url, TOKEN)
        (status,) = one.status().values()
        if status.version != world.publisher.version:
            assert one.update(world.publisher.version).ok


def _update(client: RolloutClient, version: int, label: str):
    report = client.update(version)
    assert report.ok, report.failed
    for r in report.results:
        TIMINGS.append({"what": label, "url": r.url, "version": version, "kind": r.kind, "nbytes": r.nbytes,
                        "paused_s": round(r.paused_s, 4), "stage_s": round(r.stage_s, 4),
                        "apply_s": round(r.apply_s, 4)})  # fmt: skip
    return report


def _status(client: RolloutClient):
    (status,) = client.status().values()
    assert status.ok, status.error
    return status


def _get(server, route: str):
    response = requests.get(server.url + route, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    response.raise_for_status()
    return response.json()


# --------------------------------------------------------------------------- exactness


def test_status_before_the_first_update(server, client):
    _fresh(server)
    status = _status(client)
    assert (status.version, status.fingerprint) == (None, None)
    assert status.workers[0]["auth"] is True and status.workers[0]["last_update"] is None


def test_the_anchor_loads_every_parameter_exactly(world, server, client):
    _fresh(server)
    expected = world.reference([PROMPTS, [LONG_PROMPT]], model=world.anchor_model)
    before = [greedy(server.url), greedy(server.url, [LONG_PROMPT])]
    assert before != expected  # the anchor differs from the checkpoint the server started with
    report = _update(client, 0, "anchor (first update)")
    (result,) = report.results
    assert (result.version, result.kind, result.fingerprint) == (0, "anchor", world.anchor_fingerprint)
    assert result.nbytes == (world.bucket / "anchors" / "00000000.safetensors").stat().st_size
    assert [greedy(server.url), greedy(server.url, [LONG_PROMPT])] == expected
    assert _get(server, "/weight_info") == {"weight_version": "0"}


@pytest.mark.parametrize(
    ("name", "rows", "sent"),
    [
        ("model.layers.0.self_attn.q_proj.weight", slice(0, 4), 6),  # q/k/v weights and biases
        ("model.layers.1.mlp.gate_proj.weight", slice(0, 8), 2),  # gate and up
    ],
    ids=["layer0-q_proj", "layer1-gate_proj"],
)
def test_a_delta_touching_one_projection_is_exact(world, server, client, name, rows, sent):
    _current(world, server)
    before = greedy(server.url)
    version = world.edit(name, rows)
    _update(client, version, f"delta: {name.split('.', 2)[2]}")
    if sent == 6:  # one fresh server for the fused q/k/v; the AdamW test's fresh server sees every projection
        expected = world.reference([PROMPTS])[0]
        assert before != expected  # the edit matters
        assert greedy(server.url) == expected
    status = _status(client)
    assert (status.version, status.fingerprint) == (version, world.fingerprint)
    last = status.workers[0]["last_update"]
    assert (last["kind"], last["changed"], last["sent"]) == ("delta", 1, sent)


def test_an_adamw_step_is_exact_and_long_prompts_see_no_stale_cache(world, server, client):
    _current(world, server)
    version = world.adamw_step()
    expected, expected_long = world.reference([PROMPTS, [LONG_PROMPT]])
    stale_long = greedy(server.url, [LONG_PROMPT])  # fills the prefix cache with old-weight KV
    assert stale_long != expected_long
    report = _update(client, version, "delta: AdamW step (all parameters)")
    assert report.results[0].kind == "delta"
    assert greedy(server.url, [LONG_PROMPT]) == expected_long
    assert greedy(server.url) == expected
    assert _status(client).fingerprint == world.fingerprint


# --------------------------------------------------------------------------- refusals


def _assert_refused(client, server, version, expected_outputs, served, error_pattern):
    report = client.update(version)
    assert not report.ok and report.updated == []
    (failed,) = report.failed
    assert re.search(error_pattern, failed.error), failed.error
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    assert _get(server, "/is_paused") == {"is_paused": False}  # resumed after the failure
    assert greedy(server.url) == expected_outputs
    status = RolloutClient(server.url, TOKEN).status()[server.url]
    assert status.version == served


def test_tampered_missing_and_uncommitted_versions_are_refused(world, server, client):
    _current(world, server)  # a version is served (alone, the server would serve its checkpoint)
    served = _status(client).version
    outputs = greedy(server.url)
    version = world.edit("model.norm.weight", slice(0, 32))
    path = world.bucket / "deltas" / f"{version:08d}.safetensors"
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x01
    path.write_bytes(bytes(flipped))
    _assert_refused(client, server, version, outputs, served,
                    rf"POST /deltasync/update: HTTP 500: .*update to version {version} refused \(IntegrityError\): .*"
                    rf"SHA-256 .* \(corrupted or tampered\); still serving version {served}")  # fmt: skip
    path.write_bytes(good[: len(good) // 2])
    _assert_refused(client, server, version, outputs, served, r"bytes, the pointer says \d+ \(truncated or replaced\)")
    path.unlink()
    _assert_refused(client, server, version, outputs, served, r"refused \(NotFoundError\)")
    path.write_bytes(good)
    _assert_refused(client, server, version + 5, outputs, served,
                    rf"refused \(VersionError\): version {version + 5} is not committed in .* \(the newest is {version}\)")


def test_missing_and_wrong_tokens_are_refused(world, server, client):
    served = _status(client).version
    version = world.publisher.version
    outputs = greedy(server.url)
    _assert_refused(RolloutClient(server.url), server, version, outputs, served,
                    r"^POST /deltasync/update: HTTP 401: /deltasync/update needs 'Authorization: Bearer <token>' with this server's "
                    r"DELTASYNC_TOKEN; none was sent \(without it only the public inference and read-only routes answer\)$")  # fmt: skip
    _assert_refused(RolloutClient(server.url, "wrong"), server, version, outputs, served,
                    r"^POST /deltasync/update: HTTP 401: /deltasync/update: the bearer token is wrong")
    # The right bearer token but a tag made with another token: the engine refuses it.
    forger = RolloutClient(server.url, TOKEN)
    forger._tag = lambda v: update_tag("another-token", v)  # type: ignore[method-assign]
    _assert_refused(forger, server, version, outputs, served,
                    rf"refused \(AuthError\): the auth tag of the update to version {version} is wrong")


# --------------------------------------------------------------------------- serving through updates


def _step_delay(server, seconds: float, auth: dict) -> None:
    """Make the server's engine steps wait ``seconds`` each (the test worker extension's hook)."""
    response = requests.post(server.url + "/collective_rpc", json={"method": "deltasync_test_step_delay",
                             "args": [seconds]}, headers=auth, timeout=60)  # fmt: skip
    assert response.status_code == 200, response.text


def test_a_request_in_flight_during_an_update_finishes(world, server, client):
    """A request the update lands in finishes whole, and the server serves the new version
    exactly. That the update did land inside the request is the server's word: its
    ``x-deltasync-token-versions`` says that the old version sampled the first tokens and the
    new one the rest. Each engine step waits 50 ms while the request starts (the test worker
    extension's step delay), so that the 900 tokens take at least 45 s: vLLM's pause holds the
    request inside that however slowly this process gets the CPU. (Should the engine still
    finish it first, the test tries again, three times at most.)"""
    tried = []
    for _attempt in range(3):
        _current(world, server)
        old = world.publisher.version
        version = world.edit("model.norm.weight", slice(0, 32))  # a new version, so the update does something
        # Staged before the request starts, so that the update only writes (staging runs
        # behind serving, at nice 19).
        (prefetch,) = client.prefetch(version).values()
        assert prefetch.ok, prefetch.error
        assert client.wait_prefetched(version, timeout=120) == {server.url: True}
        answer: dict = {}

        def generate(answer: dict = answer) -> None:
            # Not streamed: no thread of this process reads a stream while the update is sent.
            body = {"prompt": "Once upon a time", "max_tokens": 900, "temperature": 0, "ignore_eos": True}
            response = requests.post(server.url + "/v1/completions", json=body, timeout=600)
            answer["status"], answer["body"] = response.status_code, response.text
            if response.status_code == 200:
                answer["tokens"] = response.json()["usage"]["completion_tokens"]
                answer["starts"] = parse_token_versions(response.headers["x-deltasync-token-versions"])

        auth = {"Authorization": f"Bearer {TOKEN}"}
        _step_delay(server, 0.05, auth)
        thread = threading.Thread(target=generate)
        thread.start()
        deadline = time.monotonic() + 120
        while thread.is_alive() and running(server.url) < 1:  # until the engine generates it
            assert time.monotonic() < deadline, "the generation never started"
            time.sleep(0.02)
        # vLLM's own pause (keep mode) holds the request where it is, so that the update lands
        # inside it however slowly this process gets the CPU; the update pauses again, applies
        # and resumes the engine.
        try:
            requests.post(server.url + "/pause", params={"mode": "keep"}, headers=auth, timeout=60).raise_for_status()
            try:
                report = _update(client, version, "delta during a 900-token generation")
            finally:
                requests.post(server.url + "/resume", headers=auth, timeout=60).raise_for_status()
        finally:
            _step_delay(server, 0, auth)  # the rest of the request, and the tests after, at full speed
        thread.join(timeout=600)
        assert answer["status"] == 200 and answer["tokens"] == 900, answer
        assert report.results[0].version == version
        assert _status(client).fingerprint == world.fingerprint
        (starts,) = answer["starts"]
        tried.append(starts)
        if [v for v, _ in starts] == [old, version] and 0 < starts[1][1] < 900:
            break  # the old version sampled tokens 0.., the new one the rest
        assert starts[0] == (old, 0), starts  # else the request finished before the update landed
    else:
        raise AssertionError(f"no update landed inside the request in three tries: {tried}")


def test_prefetch_then_update(world, server, client):
    _current(world, server)
    version = world.adamw_step()
    served = _status(client).version
    (result,) = client.prefetch(version).values()
    assert result.ok, result.error
    assert client.wait_prefetched(version, timeout=120) == {server.url: True}
    prefetch = _status(client).workers[0]["prefetch"]
    assert prefetch["state"] == "ready"
    assert prefetch["nice"] == 19  # staged behind serving (DELTASYNC_STAGING_NICE's default)
    assert _status(client).version == served  # staged, not applied
    report = _update(client, version, "delta: AdamW step, prefetched")
    last = _status(client).workers[0]["last_update"]
    assert last["prefetched"] is True and report.results[0].fingerprint == world.fingerprint
    # The same logic without the weight-update routes (the caller pauses and resets caches).
    response = requests.post(
        server.url + "/collective_rpc",
        json={"method": "deltasync_apply", "args": [version, update_tag(TOKEN, version)]},
        headers={"Authorization": f"Bearer {TOKEN}"},
        timeout=60,
    )
    assert response.status_code == 200
    assert response.json()["results"][0]["kind"] == "none"  # already there


# --------------------------------------------------------------------------- more servers


class ServeCommand(VLLMServer):
    """A server started the way users start one: ``deltasync serve MODEL --bucket ... [vLLM args]``."""

    bucket = ""

    @property
    def command(self) -> list[str]:
        vllm_args = super().command[5:]  # after "python -m module --model DIR"
        return [sys.executable, "-m", "deltasync.cli", "serve", self.model_dir, "--bucket", self.bucket,
                "--token-env", "SHARED_SECRET", *vllm_args]  # fmt: skip


@pytest.fixture(scope="module")
def late_server(world, server):
    late = ServeCommand(world.model_dir, env=server_env(SHARED_SECRET=TOKEN), log_file=world.root / "late.log")
    late.bucket = str(world.bucket)
    late.start(timeout=SERVER_START_TIMEOUT)
    try:
        yield late
    finally:
        late.stop()


def test_a_late_server_catches_up_and_both_update_together(world, server, late_server):
    _fresh(late_server)
    _current(world, server)
    both = RolloutClient([server.url, late_server.url], TOKEN)
    assert both.status()[late_server.url].version is None
    version = world.adamw_step()
    report = _update(both, version, "two servers: one current, one late (catch-up)")
    kinds = {r.url: r.kind for r in report.results}
    assert kinds == {server.url: "delta", late_server.url: "anchor"}
    assert {r.fingerprint for r in report.results} == {world.fingerprint}
    assert {r.version for r in report.results} == {version}
    assert greedy(late_server.url) == greedy(server.url)
    assert greedy(late_server.url, [LONG_PROMPT]) == greedy(server.url, [LONG_PROMPT])


def test_a_restarted_server_catches_up(world, server, late_server):
    _current(world, late_server)
    expected = greedy(late_server.url)
    server.stop()
    server.start(timeout=SERVER_START_TIMEOUT)
    both = RolloutClient([server.url, late_server.url], TOKEN)
    assert both.status()[server.url].version is None
    report = _update(both, world.publisher.version, "restarted server (catch-up) + current server (no-op)")
    kinds = {r.url: r.kind for r in report.results}
    assert kinds == {server.url: "anchor", late_server.url: "none"}
    assert {r.fingerprint for r in report.results} == {world.fingerprint}
    assert greedy(server.url) == expected
