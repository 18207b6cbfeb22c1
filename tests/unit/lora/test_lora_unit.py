"""PEFT / LoRA on the trainer side, without a server: what adapter and merged versions hold."""

from __future__ import annotations

import copy
import json

import pytest
import torch

peft = pytest.importorskip("peft")
from lora_helpers import TARGETS, lora_model, train, trainable  # noqa: E402
from peft import get_peft_model_state_dict  # noqa: E402

from deltasync import (  # noqa: E402
    AdapterWeights,
    BF16ChangeDetector,
    DeltaPublisher,
    DeltaReceiver,
    MergedLoraWeights,
    ModelWeights,
    fingerprint,
)
from deltasync.format import read_metadata  # noqa: E402
from deltasync.trainer.lora import (  # noqa: E402
    ADAPTER_CONFIG_KEY,
    BASE_FINGERPRINT_KEY,
    AdapterError,
    MergedChangeDetector,
    adapter_config,
    adapter_publisher,
    adapter_state_dict,
    adapter_modules,
    check_adapter_config,
    check_adapter_modules,
    check_server_lora,
    lora_targets,
    merged_publisher,
    merged_state_dict,
)
from deltasync.control.serve import serve_command  # noqa: E402

@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory(seed=0)


@pytest.fixture
def trained(model_dir):
    model = lora_model(model_dir)
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    train(model, optimizer, 2)
    return model, optimizer


def test_adapter_state_is_what_save_pretrained_writes_in_bf16(trained) -> None:
    model, _ = trained
    saved = get_peft_model_state_dict(model)
    state = adapter_state_dict(model)
    assert sorted(state) == sorted(saved) and len(state) == 8  # 2 layers x q/v x A/B
    for name, tensor in saved.items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name


def test_merged_state_is_merge_then_bf16_bit_for_bit(trained) -> None:
    model, _ = trained
    merged = merged_state_dict(model)
    reference = copy.deepcopy(model).merge_and_unload()
    want = {name: p.detach().to(torch.bfloat16) for name, p in reference.named_parameters()}
    assert sorted(merged) == sorted(want)
    changed = 0
    for name, tensor in want.items():
        assert torch.equal(merged[name], tensor), name
        changed += "q_proj.weight" in name or "v_proj.weight" in name
    assert changed == 4
    # and the adapter is still unmerged: training continues on the base weights + LoRA
    assert not any(layer.merged for layer in model.modules() if hasattr(layer, "merged"))


def test_merged_publisher_replays_exactly_and_snapshots_only_targeted_weights(trained, tmp_path) -> None:
    model, optimizer = trained
    publisher = merged_publisher(tmp_path / "bucket", model, optimizer, anchor_every=100, anchor_bytes_ratio=0)
    snapshot = publisher.detector._snapshot
    assert sorted(snapshot) == sorted(
        f"model.layers.{i}.self_attn.{t}.weight" for i in range(2) for t in TARGETS
    )  # the base model's other weights are never copied
    kinds = []
    for step in range(3):
        result = publisher.publish()
        kinds.append(result.kind)
        want = merged_state_dict(model)
        assert result.fingerprint == fingerprint(want)
        receiver = DeltaReceiver(tmp_path / "bucket")
        receiver.sync()
        got = receiver.state_dict()
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want)
        if step:
            # only LoRA-targeted weights travel in a delta
            assert 0 < result.changed < sum(t.numel() for n, t in want.items() if "q_proj.weight" in n or "v_proj.weight" in n)
        train(model, optimizer, 1, seed=10 + step)
    assert kinds == ["anchor", "delta", "delta"]


def test_plain_merged_and_adapter_are_three_sources_of_one_detector(trained, tmp_path) -> None:
    model, optimizer = trained
    publishers = {
        "plain": DeltaPublisher(tmp_path / "plain", model, optimizer),
        "merged": merged_publisher(tmp_path / "merged", model, optimizer),
        "adapter": adapter_publisher(tmp_path / "adapter", model, optimizer),
    }
    try:
        assert {type(p.detector) for p in publishers.values()} == {BF16ChangeDetector}
        sources = {mode: type(p.detector.source) for mode, p in publishers.items()}
        assert sources == {"plain": ModelWeights, "merged": MergedLoraWeights, "adapter": AdapterWeights}
        # Each tracks what its source says a step changes: the LoRA tensors (under the model's
        # names, or save_pretrained's), or the base weights they are merged into.
        lora = sorted(f"model.layers.{i}.self_attn.{t}.lora_{ab}.weight" for i in range(2) for t in TARGETS for ab in "AB")
        assert sorted(publishers["adapter"].detector.tracked) == ["base_model.model." + n for n in lora]
        assert sorted(publishers["plain"].detector.tracked) == [
            "base_model.model." + n.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
            for n in lora
        ]
        assert sorted(publishers["merged"].detector.tracked) == sorted(
            f"model.layers.{i}.self_attn.{t}.weight" for i in range(2) for t in TARGETS
        )
        for publisher in publishers.values():
            publisher.publish()
        train(model, optimizer, 1, seed=7)
        states = {"plain": None, "merged": merged_state_dict(model), "adapter": adapter_state_dict(model)}
        for mode, publisher in publishers.items():
            result = publisher.publish()
            assert result.kind == "delta" and result.changed > 0, mode
            if states[mode] is not None:
                assert result.fingerprint == fingerprint(states[mode]), mode
    finally:
        for publisher in publishers.values():
            publisher.close()


def test_merged_change_detector_only_picks_the_merged_source(trained, tmp_path) -> None:
    model, optimizer = trained
    detector = MergedChangeDetector(model, optimizer)
    assert type(detector.source) is MergedLoraWeights and detector.source.adapter == "default"
    with merged_publisher(tmp_path / "bucket", model, optimizer) as publisher:
        assert detector.tracked == publisher.detector.tracked
        train(model, optimizer, 1, seed=3)
        got, want = detector.changes(), publisher.detector.changes()
        assert sorted(got) == sorted(want) and all(torch.equal(got[n].new, want[n].new) for n in want)
    detector.close()


def test_adapter_publisher_writes_config_and_base_fingerprint(trained, model_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model, optimizer = trained
    publisher = adapter_publisher(tmp_path / "bucket", model, optimizer, anchor_every=100, anchor_bytes_ratio=0)
    first = publisher.publish()
    train(model, optimizer, 1, seed=5)
    second = publisher.publish()
    assert (first.kind, second.kind) == ("anchor", "delta")
    receiver = DeltaReceiver(tmp_path / "bucket")
    receiver.sync()
    want = adapter_state_dict(model)
    assert receiver.fingerprint == fingerprint(want)
    assert all(torch.equal(receiver.state_dict()[n], want[n]) for n in want)
    meta = read_metadata((tmp_path / "bucket" / first.path).read_bytes(), where=first.path)
    config = json.loads(meta[ADAPTER_CONFIG_KEY])
    assert config["r"] == 4 and sorted(config["target_modules"]) == TARGETS and config["peft_type"] == "LORA"
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert meta[BASE_FINGERPRINT_KEY] == fingerprint(dict(base.named_parameters()))


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']"),
        ({"bias": "lora_only"}, "bias='lora_only'"),
    ],
)
def test_adapters_vllm_cannot_serve_are_refused_before_anything_is_written(model_dir, tmp_path, options, words) -> None:
    model = lora_model(model_dir, **options)
    for make in (adapter_publisher, merged_publisher):
        with pytest.raises(AdapterError, match=words.replace("[", r"\[").replace("]", r"\]")):
            make(tmp_path / "bucket", model)
    assert not (tmp_path / "bucket").exists() or not any((tmp_path / "bucket").iterdir())


def test_embedding_targets_are_refused() -> None:
    with pytest.raises(AdapterError, match="embed_tokens"):
        check_adapter_config({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "embed_tokens"]})


def test_server_limits_are_checked_as_trl_does(trained) -> None:
    config = adapter_config(trained[0].peft_config["default"])
    check_server_lora({"max_lora_rank": 8, "max_loras": 6}, config, max_staleness=4)
    with pytest.raises(AdapterError, match="rank 16.*--max-lora-rank 8: restart it with --max-lora-rank 16"):
        check_server_lora({"max_lora_rank": 8, "max_loras": 6}, {**config, "r": 16}, max_staleness=4)
    with pytest.raises(AdapterError, match="rank 12.*--max-lora-rank 16"):
        check_server_lora({"max_lora_rank": 8, "max_loras": 6}, {**config, "rank_pattern": {"q_proj": 12}}, max_staleness=4)
    with pytest.raises(AdapterError, match="--max-loras 3.*max_staleness=4.*--max-loras 6"):
        check_server_lora({"max_lora_rank": 8, "max_loras": 3}, config, max_staleness=4)
    with pytest.raises(AdapterError, match="--enable-lora"):
        check_server_lora(None, config, max_staleness=4)


QWEN2_LORA = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def test_target_modules_are_checked_against_what_the_server_serves(model_dir, trained) -> None:
    # What the adapter really carries LoRA on: a regex that dodges the name check still shows.
    model = lora_model(model_dir, target_modules=r".*\.(q_proj|embed_\w+)")
    assert lora_targets(model) == ["embed_tokens", "q_proj"]
    assert lora_targets(trained[0]) == TARGETS
    assert adapter_modules(adapter_state_dict(trained[0])) == TARGETS
    config = adapter_config(trained[0].peft_config["default"])
    server = {"max_lora_rank": 8, "max_loras": 6, "target_modules": None}
    check_server_lora(server, config, max_staleness=4, modules=TARGETS, accepted=QWEN2_LORA)
    with pytest.raises(
        AdapterError,
        match=r"^the adapter puts LoRA on embed_tokens, but this vLLM server serves LoRA only on down_proj, gate_proj, "
        r"k_proj, o_proj, q_proj, up_proj, v_proj: remove embed_tokens from target_modules, or use peft_sync='merged'$",
    ):
        check_server_lora(server, config, max_staleness=4, modules=lora_targets(model), accepted=QWEN2_LORA)
    # a server whose --lora-target-modules leaves a module out (vLLM would skip its LoRA silently)
    with pytest.raises(AdapterError, match=r"LoRA on v_proj, .* only on o_proj, q_proj \(its --lora-target-modules is "
                       r"\['q_proj', 'o_proj'\]\): remove v_proj .* or restart the server with those modules"):
        check_adapter_modules(TARGETS, ["o_proj", "q_proj"], restricted=["q_proj", "o_proj"])
    with pytest.raises(AdapterError, match="--worker-extension-cls vllm_ext.DeltaWorkerExtension"):
        check_adapter_modules(TARGETS, None)
    with pytest.raises(AdapterError, match="'model.norm.weight' is not a LoRA tensor name"):
        adapter_modules(["model.norm.weight"])


def test_serve_adds_the_adapter_middleware_with_enable_lora(tmp_path) -> None:
    command, _ = serve_command("m", str(tmp_path), vllm_args=["--enable-lora"], environ={})
    assert command[command.index("vllm_ext.LoraSyncMiddleware") - 1] == "--middleware"
    command, _ = serve_command("m", str(tmp_path), vllm_args=[], environ={})
    assert "vllm_ext.LoraSyncMiddleware" not in command
