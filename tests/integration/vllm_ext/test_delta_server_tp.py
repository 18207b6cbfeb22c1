"""Two tensor-parallel workers on CPU: both apply, both refuse, and a refusal leaves vLLM usable.

vLLM's multiprocess executor stops reading workers' answers at the first error; a
refusal raised by every worker would leave the others' answers queued for the next call.
This module checks that updates, refusals and later calls all work with two workers, and
that the result equals a fresh two-worker server on the same weights. The server runs without
``vllm_ext.UpdateMiddleware``, so the client drives vLLM's own five weight-update routes here
(every other server test goes through the one-request route).
"""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch
from servers import greedy, requires_vllm, running_server

from deltasync import DeltaPublisher, RolloutClient, bf16_state_dict, fingerprint
from deltasync.control.serve import extension_args

pytestmark = [
    pytest.mark.server,
    requires_vllm,
    pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU workers need two cores"),
]

# One core per worker: vLLM's CPU backend cannot bind two workers to one NUMA node itself.
TP_ARGS = ["--tensor-parallel-size", "2"]
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def test_two_workers_update_refuse_and_stay_exact(tiny_model_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory(seed=0)
    bucket = tmp_path / "bucket"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    publisher = DeltaPublisher(bucket, model, None, anchor_bytes_ratio=0)
    publisher.publish()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[:8] += 0.05
        model.model.layers[1].mlp.up_proj.weight[:8] += 0.05
        model.model.embed_tokens.weight[:8] += 0.05  # tied with lm_head, sharded by vocabulary
    assert publisher.publish().kind == "delta"
    want = fingerprint(bf16_state_dict(model))

    extension = extension_args(update_route=False)
    env = {**TP_ENV, "DELTASYNC_BUCKET": str(bucket)}
    with running_server(model_dir, env=env, extra_args=[*TP_ARGS, *extension], log_file=tmp_path / "tp.log") as server:
        client = RolloutClient(server.url)
        assert client.update(0).results[0].kind == "anchor"
        log = (tmp_path / "tp.log").read_text()
        assert '"POST /deltasync/update HTTP/1.1" 404' in log and '"POST /update_weights HTTP/1.1" 200' in log
        assert client.update(1).results[0].kind == "delta"
        status = client.status()[server.url]
        assert status.ok and (status.version, status.fingerprint) == (1, want)
        assert [w["rank"] for w in status.workers] == [0, 1]
        # q/k/v weights and biases, gate and up, the embedding: each worker loads its shards.
        assert [w["last_update"]["sent"] for w in status.workers] == [9, 9]
        updated = greedy(server.url)

        (refused,) = client.update(5).failed
        assert "version 5 is not committed" in refused.error and refused.version == 1
        assert refused.error.startswith("POST /update_weights: HTTP 500: ")
        (refused,) = client.prefetch(9).values()
        assert not refused.ok and "prefetch of version 9 refused" in refused.error
        # Every later call still gets its own answers.
        status = client.status()[server.url]
        assert status.ok and status.version == 1
        assert all(w["last_error"]["version"] == 9 for w in status.workers)
        assert client.update(1).results[0].kind == "none"
        assert greedy(server.url) == updated

    reference = tmp_path / "reference"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(reference)
    for item in model_dir.iterdir():
        if not (reference / item.name).exists():
            shutil.copy(item, reference / item.name)
    with running_server(reference, env=TP_ENV, extra_args=TP_ARGS, log_file=tmp_path / "reference.log") as fresh:
        assert greedy(fresh.url) == updated
