"""MoE and other models whose in-memory layout differs from their checkpoint: versions are
published as ``save_pretrained`` writes the model, derived from transformers' own conversion."""

from __future__ import annotations

import pytest
import torch
from helpers import small_transformer, train_step
from moe_helpers import assert_saved, moe_model, routed_step, saved_state

from deltasync import ConfigError, DeltaPublisher, DeltaReceiver
from deltasync.trainer.checkpoint_layout import checkpoint_layout
from deltasync.trainer.detector import named_parameters
from deltasync.format import Change
from deltasync.examples.tiny import build_tiny_moe_model


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    built = {}

    def make(**kwargs):
        key = tuple(sorted(kwargs.items()))
        if key not in built:
            built[key] = build_tiny_moe_model(tmp_path_factory.mktemp("moe"), **kwargs)
        return built[key]

    return make


def test_the_layout_is_save_pretrained_s(moe_dirs) -> None:
    """Names and shapes of the pieces are those of the saved checkpoint; experts split exactly."""
    model = moe_model(moe_dirs(num_experts=8))
    layout = checkpoint_layout(model, list(named_parameters(model)))
    want = saved_state(model)
    assert {n: p.shape for n, p in layout.pieces.items()} == {n: tuple(t.shape) for n, t in want.items()}
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    pieces = layout.of(fused)
    assert [p.name for p in pieces[:3]] == [
        "model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight",
        "model.layers.1.mlp.experts.1.gate_proj.weight",
    ]  # fmt: skip
    # Every element of the fused tensor maps to the element save_pretrained writes, and back.
    live = dict(model.named_parameters())[fused].detach().to(torch.bfloat16).reshape(-1)
    index = torch.arange(live.numel())
    change = layout.to_checkpoint({fused: Change(index=index, new=live, old=live)})
    assert len(change) == 16
    for name, part in change.items():
        assert torch.equal(part.index, torch.arange(part.index.numel()))
        assert torch.equal(part.new.view(torch.int16), want[name].reshape(-1).view(torch.int16)), name
    back = layout.to_live(change)[fused]
    assert torch.equal(back.index, index) and torch.equal(back.new.view(torch.int16), live.view(torch.int16))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(architecture="qwen3_moe", num_experts=8, tie_word_embeddings=False),
        dict(architecture="qwen3_moe", num_experts=4, tie_word_embeddings=True),
        dict(architecture="mixtral", num_experts=4),
    ],
    ids=["qwen3-8-experts-untied", "qwen3-4-experts-tied", "mixtral"],
)
def test_receiver_equals_save_pretrained_after_every_sync(tmp_path, moe_dirs, kwargs) -> None:
    """30 AdamW steps on 2 tokens each (the router and the experts it picks step), a version
    after each: the receiver is save_pretrained's state bit for bit, and so is a late joiner."""
    model = moe_model(moe_dirs(**kwargs))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    publisher = DeltaPublisher(tmp_path / "b", model, opt, anchor_every=7)
    receiver = DeltaReceiver(tmp_path / "b")
    publisher.publish()
    receiver.sync()
    assert_saved(receiver, saved_state(model))
    expert_versions = dense_versions = 0
    experts_per_version = []
    for step in range(1, 31):
        routed_step(model, opt, seed=step)
        result = publisher.publish()
        staged = receiver.stage()
        assert staged.kind == "delta"
        changed = staged.names
        receiver.apply(staged)
        want = saved_state(model)
        assert_saved(receiver, want)
        assert result.fingerprint == receiver.fingerprint
        experts = [n for n in changed if ".experts." in n]
        expert_versions += bool(experts)
        dense_versions += any(".experts." not in n for n in changed)
        experts_per_version.append(len(experts))
    # Only the routed experts step at first; Adam's momentum keeps them moving afterwards.
    assert 0 < experts_per_version[0] < sum(1 for n in saved_state(model) if ".experts." in n)
    assert expert_versions == dense_versions == 30
    publisher.flush()
    late = DeltaReceiver(tmp_path / "b")
    assert late.stage().kind == "anchor"
    late.sync()
    assert_saved(late, saved_state(model))
    publisher.close()


def test_a_transposed_checkpoint_tensor_maps_exactly(tmp_path) -> None:
    """A conversion that transposes (as qwen3_vl_moe's does) gives strided pieces: still exact."""
    from transformers.core_model_loading import Transpose, WeightConverter

    model = small_transformer()
    model._weight_conversions = [
        WeightConverter(source_patterns="mlp.down_proj.weight", target_patterns="mlp.down_proj.weight", operations=[Transpose(0, 1)])
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    layout = checkpoint_layout(model, list(named_parameters(model)))
    piece = layout.pieces["model.layers.0.mlp.down_proj.weight"]
    assert not piece.contiguous and piece.shape == (128, 64)
    publisher = DeltaPublisher(tmp_path / "b", model, opt, anchor_every=2)
    receiver = DeltaReceiver(tmp_path / "b")
    publisher.publish()
    for step in range(1, 5):
        train_step(model, opt, seed=step)
        publisher.publish()
        receiver.sync()
        assert_saved(receiver, saved_state(model))
    publisher.close()


def test_a_checkpoint_tensor_from_several_parameters_is_refused(tmp_path) -> None:
    from transformers.core_model_loading import Chunk, WeightConverter

    model = small_transformer()
    # In memory q and k, on disk one qk tensor: the reverse conversion concatenates two parameters.
    model._weight_conversions = [
        WeightConverter(
            source_patterns="self_attn.qk_proj.weight",
            target_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight"],
            operations=[Chunk(dim=0)],
        )
    ]
    with pytest.raises(ConfigError, match=r"checkpoint tensor 'model.layers.0.self_attn.qk_proj.weight' is assembled "
                       r"from several in-memory parameters \('model.layers.0.self_attn.q_proj.weight' and "
                       r"'model.layers.0.self_attn.k_proj.weight'\)"):  # fmt: skip
        DeltaPublisher(tmp_path / "b", model)


def test_a_dense_model_keeps_its_names_without_an_index_run() -> None:
    model = small_transformer()
    layout = checkpoint_layout(model, list(named_parameters(model)))
    assert layout.identity and sorted(layout.pieces) == sorted(n for n, _ in named_parameters(model))


def test_merged_lora_on_a_moe_model_is_save_pretrained_of_the_merge(tmp_path, moe_dirs) -> None:
    """LoRA on attention of a Qwen3-MoE, merged mode: every version is PEFT's merge, saved."""
    from peft import LoraConfig, get_peft_model

    from deltasync import merged_publisher

    model = get_peft_model(moe_model(moe_dirs(num_experts=4)), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False))  # fmt: skip
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    publisher = merged_publisher(tmp_path / "b", model, opt, anchor_every=3)
    receiver = DeltaReceiver(tmp_path / "b")

    def merged_saved() -> dict[str, torch.Tensor]:
        import copy

        return saved_state(copy.deepcopy(model).merge_and_unload())

    publisher.publish()
    receiver.sync()
    assert_saved(receiver, merged_saved())
    for step in range(1, 5):
        routed_step(model, opt, seed=step, tokens=4)
        publisher.publish()
        staged = receiver.stage()
        assert staged.names and all("self_attn" in n for n in staged.names)
        receiver.apply(staged)
        assert_saved(receiver, merged_saved())
    publisher.flush()
    late = DeltaReceiver(tmp_path / "b")
    late.sync()
    assert_saved(late, merged_saved())
    publisher.close()


def test_a_rank_holding_part_of_a_transposed_checkpoint_tensor_is_refused() -> None:
    """Split anchors hold one range of each checkpoint tensor per rank: rows of a transposed
    tensor are not one, so such a sharding is refused naming the parameter; whole is fine."""
    from deltasync.trainer.checkpoint_layout import CheckpointLayout, Piece
    from deltasync.trainer.sharded import OwnedSlice, ShardLayout

    layout = CheckpointLayout([Piece("w.t", "w", (3, 4), 0, (1, 3))])  # w is (4, 3) in memory
    assert not layout.identity

    def rank(begin: int, end: int) -> ShardLayout:
        return ShardLayout(rank=1, world=2, writer=True, part=1, parts=2, description="FSDP2, 2 shards",
                           slices={"w": OwnedSlice((4, 3), begin, end, True)})  # fmt: skip

    assert layout.owned(rank(0, 12)).slices["w.t"] == OwnedSlice((3, 4), 0, 12, True)
    assert layout.owned(rank(12, 12)).slices["w.t"] == OwnedSlice((3, 4), 0, 0, True)
    with pytest.raises(ConfigError, match=r"^'w': rank 1 \(FSDP2, 2 shards\) holds part of its checkpoint tensor 'w.t'"):
        layout.owned(rank(6, 12))
    index = torch.tensor([1, 5, 6])  # w[0, 1], w[1, 2], w[2, 0] -> w.t[1, 0], w.t[2, 1], w.t[0, 2]
    values = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    change = layout.to_checkpoint({"w": Change(index=index, new=values, old=values)})["w.t"]
    assert change.index.tolist() == [2, 4, 9] and change.new.tolist() == [3.0, 1.0, 2.0]
    back = layout.to_live({"w.t": change})["w"]
    assert back.index.tolist() == [1, 5, 6] and back.new.tolist() == [1.0, 2.0, 3.0]


def test_the_fingerprint_move_of_live_changes_is_that_of_their_checkpoint_changes(moe_dirs) -> None:
    """``fingerprint_move`` hashes a fused parameter's changes in one round, keyed by checkpoint
    name and index, without making the checkpoint changes: the same sum as hashing what
    ``to_checkpoint`` makes, for fused experts (changes in some experts and none in others), a
    transposed piece, a parameter as it is, and no change at all."""
    from transformers.core_model_loading import Transpose, WeightConverter

    from deltasync.format.fingerprint import fingerprint_moves

    def moves(layout, live) -> int:  # type: ignore[no-untyped-def]
        return fingerprint_moves((n, c.index, c.old, c.new) for n, c in layout.to_checkpoint(live).items())

    def random_changes(model, g, share):  # type: ignore[no-untyped-def]
        out = {}
        for name, param in named_parameters(model):
            n = param.numel()
            index = torch.sort(torch.randperm(n, generator=g)[: int(n * share)]).values
            old = torch.randint(-(1 << 15), 1 << 15, (index.numel(),), generator=g, dtype=torch.int16).view(torch.bfloat16)
            new = (old.view(torch.int16) + 1).view(torch.bfloat16)
            out[name] = Change(index=index, new=new, old=old)
        return out

    g = torch.Generator().manual_seed(4)
    model = moe_model(moe_dirs(num_experts=8))
    layout = checkpoint_layout(model, list(named_parameters(model)))
    assert not layout.identity
    for share in (0.02, 0.5):
        live = random_changes(model, g, share)
        assert layout.fingerprint_move(live) == moves(layout, live) != 0
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    n = dict(named_parameters(model))[fused].numel()
    one_expert = {fused: Change(index=torch.tensor([n - 5, n - 1]), new=torch.ones(2, dtype=torch.bfloat16),
                                old=torch.zeros(2, dtype=torch.bfloat16))}  # fmt: skip
    assert layout.fingerprint_move(one_expert) == moves(layout, one_expert) != 0
    assert layout.fingerprint_move({}) == 0

    dense = small_transformer()
    dense._weight_conversions = [
        WeightConverter(source_patterns="mlp.down_proj.weight", target_patterns="mlp.down_proj.weight", operations=[Transpose(0, 1)])
    ]
    layout = checkpoint_layout(dense, list(named_parameters(dense)))
    live = random_changes(dense, g, 0.1)
    assert layout.fingerprint_move(live) == moves(layout, live) != 0

