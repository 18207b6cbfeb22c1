"""Which weights a view quantizes: llm-compressor's targets=["Linear"] with ignore entries."""

from __future__ import annotations

import pytest
import torch
from helpers import small_transformer

from deltasync.trainer.view_targets import ignore_list, quantized_names

pytest.importorskip("compressed_tensors")


def test_dense_model_every_linear_but_lm_head() -> None:
    model = small_transformer()  # tied embeddings: lm_head.weight is not a parameter of its own
    names = [n for n, _ in model.named_parameters()]
    linear = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    assert len(linear) == 14
    assert quantized_names(model, names) == linear
    assert ignore_list(model) == ["lm_head"]
    # an exact name, a re: pattern (re.match: anchored at the start), and names not given
    ignore = ["lm_head", "model.layers.0.mlp.down_proj", "re:.*self_attn\\.(q|k)_proj$"]
    got = quantized_names(model, names, ignore)
    assert linear - got == {"model.layers.0.mlp.down_proj.weight"} | {
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qk"
    }
    # re: is re.match, anchored at the start: "re:self_attn" matches nothing; lm_head not ignored
    # is quantized too (here by its module's name, tied to the embedding)
    assert quantized_names(model, [*names, "lm_head.weight"], ["re:self_attn"]) == linear | {"lm_head.weight"}
    assert quantized_names(model, ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]) == {
        "model.layers.0.mlp.up_proj.weight"
    }
    assert ignore_list(model, ignore)[:2] == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    assert ignore_list(model, []) == []


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, list[str]]:
    from moe_helpers import moe_model, saved_state

    from deltasync.examples.tiny import build_tiny_moe_model

    model = moe_model(build_tiny_moe_model(tmp_path_factory.mktemp("moe"), num_experts=4))
    return model, list(saved_state(model))


def test_moe_per_expert_weights_are_targets_and_the_router_is_not(moe) -> None:
    model, names = moe
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())  # fused in memory
    experts = {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in range(2) for e in range(4)
               for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    attention = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"}
    assert quantized_names(model, names) == experts | attention
    # the router (Qwen3MoeTopKRouter, no nn.Linear) stays bf16 but is listed for vLLM's GateLinear
    assert ignore_list(model) == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]


def test_moe_experts_are_ignored_by_their_checkpoint_names(moe) -> None:
    model, names = moe
    everything = quantized_names(model, names)
    got = quantized_names(model, names, ["lm_head", "re:.*experts\\.[01]\\.", "model.layers.1.mlp.experts.3.down_proj"])
    assert everything - got == {f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for i in range(2) for e in range(2)
                                for p in ("gate_proj", "up_proj", "down_proj")} | {
        "model.layers.1.mlp.experts.3.down_proj.weight"}  # fmt: skip
    listed = ignore_list(model, ["lm_head", "model.layers.1.mlp.experts.3.down_proj"])
    assert listed == ["model.layers.0.mlp.gate", "model.layers.1.mlp.experts.3.down_proj", "model.layers.1.mlp.gate",
                      "lm_head"]  # fmt: skip


def test_mixtral_experts_and_router_by_checkpoint_names(tmp_path) -> None:
    from moe_helpers import moe_model, saved_state

    from deltasync.examples.tiny import build_tiny_moe_model

    model = moe_model(build_tiny_moe_model(tmp_path, architecture="mixtral", num_experts=2))
    names = list(saved_state(model))
    got = quantized_names(model, names, ["lm_head", "model.layers.1.block_sparse_moe.experts.0.w2"])
    experts = {f"model.layers.{i}.block_sparse_moe.experts.{e}.w{k}.weight" for i in range(2) for e in range(2)
               for k in (1, 2, 3)}  # fmt: skip
    attention = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qkvo"}
    assert got == (experts | attention) - {"model.layers.1.block_sparse_moe.experts.0.w2.weight"}
    assert ignore_list(model, ["lm_head", "model.layers.1.block_sparse_moe.experts.0.w2"]) == [
        "model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate",  # module order: the
        "model.layers.1.block_sparse_moe.experts.0.w2", "lm_head"]  # fmt: skip  (router is built first)
