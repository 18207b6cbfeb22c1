"""BF16ChangeDetector finds exactly the elements whose bf16 value changed since the last publish."""

from __future__ import annotations

import pytest
import torch
from helpers import small_transformer, train_step

from deltasync import (
    BF16ChangeDetector,
    ConfigError,
    DeltaPublisher,
    DeltaReceiver,
    ModelWeights,
    SourceWeight,
    WeightSource,
    bf16_state_dict,
    checkpoint_name,
    fingerprint,
)


def brute_force(before: dict[str, torch.Tensor], model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    now = bf16_state_dict(model)
    out = {}
    for name in names:
        diff = (now[name].view(torch.int16) != before[name].view(torch.int16)).reshape(-1)
        if diff.any():
            out[name] = diff.nonzero().reshape(-1)
    return out


def assert_exact(detector: BF16ChangeDetector, published: dict[str, torch.Tensor], model: torch.nn.Module) -> None:
    got = detector.changes()
    want = brute_force(published, model, detector.tracked)
    assert set(got) == set(want)  # recall and precision over parameters
    now = bf16_state_dict(model)
    for name, change in got.items():
        assert torch.equal(change.index, want[name])  # recall and precision over elements
        assert torch.equal(change.new.view(torch.int16), now[name].view(-1)[change.index].view(torch.int16))
        assert torch.equal(change.old.view(torch.int16), published[name].view(-1)[change.index].view(torch.int16))
    detector.commit(got)


@pytest.mark.parametrize("snapshot_device", ["cpu", None])
def test_exact_against_brute_force_over_many_steps(snapshot_device: str | None) -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    detector = BF16ChangeDetector(model, opt, snapshot_device=snapshot_device)
    published = bf16_state_dict(model)
    for step in range(12):
        train_step(model, opt, seed=step)
        if step % 3 == 2:  # several optimizer steps between publishes
            assert detector.steps_since_publish == 3
            assert_exact(detector, published, model)
            published = bf16_state_dict(model)
            assert detector.steps_since_publish == 0
    assert detector.changes() == {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_weight_of_several_chunks_is_exact_in_each_chunk_and_bit_pattern(dtype: torch.dtype) -> None:
    """Changes at both ends of every chunk of a CPU weight, a zero turned to -0.0, a NaN whose
    payload changed and one that did not: a bf16 weight is compared where it lives, another
    after rounding into the scratch."""
    from deltasync.trainer.scan import CHUNK

    n = 3 * CHUNK + 5
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(n, generator=g).to(dtype))
    model.b = torch.nn.Parameter(torch.randn(7, generator=g).to(dtype))
    lanes = torch.int16 if dtype == torch.bfloat16 else torch.int32
    nan = 0x7FC1 if dtype == torch.bfloat16 else 0x7FC10000
    with torch.no_grad():
        model.w[CHUNK + 3] = 0.0
        model.w.view(lanes)[2 * CHUNK + 1] = nan
        model.w.view(lanes)[2 * CHUNK + 2] = nan  # stays: a float compare would call it changed
    detector = BF16ChangeDetector(model)
    published = bf16_state_dict(model)
    at = torch.tensor([0, 1, CHUNK - 1, CHUNK, 2 * CHUNK + 17, 3 * CHUNK - 1, 3 * CHUNK, n - 1])
    with torch.no_grad():
        model.w[at] = model.w[at] * 1.5 + 0.25
        model.w[CHUNK + 3] = -0.0
        model.w.view(lanes)[2 * CHUNK + 1] = nan + (1 if dtype == torch.bfloat16 else 0x10000)
    want = sorted([*at.tolist(), CHUNK + 3, *([2 * CHUNK + 1] if dtype == torch.bfloat16 else [])])
    assert set(detector.changes()) == {"w"} and detector.changes()["w"].index.tolist() == want  # fp32 NaNs round alike
    assert_exact(detector, published, model)
    assert detector.changes() == {}


def test_gradient_accumulation_and_skipped_steps() -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detector = BF16ChangeDetector(model, opt)
    published = bf16_state_dict(model)
    train_step(model, opt, seed=1, step=False)  # accumulate
    train_step(model, opt, seed=2, step=False)
    assert detector.changes() == {}  # nothing stepped yet
    opt.step()
    opt.zero_grad(set_to_none=True)
    # a skipped step (e.g. inf grads under a scaler): backward but no optimizer step
    train_step(model, opt, seed=3, step=False)
    opt.zero_grad(set_to_none=True)
    assert_exact(detector, published, model)


def test_parameters_without_gradients_or_outside_the_optimizer() -> None:
    model = small_transformer()
    frozen = model.model.layers[0].mlp.down_proj.weight
    outside = model.model.layers[1].mlp.down_proj.weight
    frozen.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad and p is not outside], lr=1e-3)
    detector = BF16ChangeDetector(model, opt)
    assert "model.layers.0.mlp.down_proj.weight" not in detector.tracked
    assert "model.layers.1.mlp.down_proj.weight" not in detector.tracked
    assert "model.embed_tokens.weight" in detector.tracked
    assert "lm_head.weight" not in detector.tracked  # tied: one parameter, one name
    published = bf16_state_dict(model)
    train_step(model, opt, seed=0)
    with torch.no_grad():
        outside.add_(1.0)  # changed, but not by the optimizer: never in a delta
    changes = detector.changes()
    assert "model.layers.1.mlp.down_proj.weight" not in changes
    assert_exact(detector, published, model)
    # a parameter the optimizer holds but that got no gradient this step is not compared
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    train_step(model, opt, seed=5)
    assert "model.layers.0.self_attn.q_proj.weight" not in detector.changes()


def test_steps_after_capture_are_kept_for_the_next_publish() -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detector = BF16ChangeDetector(model, opt)
    published = bf16_state_dict(model)
    train_step(model, opt, seed=0)
    captured = detector.changes()
    train_step(model, opt, seed=1)  # e.g. training went on while the delta was uploaded
    detector.commit(captured)
    for name, change in captured.items():
        published[name].view(-1)[change.index] = change.new
    assert detector.steps_since_publish == 1
    assert_exact(detector, published, model)


def test_without_optimizer_compares_every_trainable_parameter() -> None:
    model = small_transformer()
    detector = BF16ChangeDetector(model)
    published = bf16_state_dict(model)
    with torch.no_grad():
        model.lm_head.weight[3, 5] += 0.5  # the tied embedding, reached through lm_head
    changes = detector.changes()
    assert list(changes) == ["model.embed_tokens.weight"]
    assert changes["model.embed_tokens.weight"].index.tolist() == [3 * 64 + 5]
    assert_exact(detector, published, model)


def test_wrapped_optimizer_and_names() -> None:
    class Wrapper:
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    model = small_transformer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    detector = BF16ChangeDetector(model, Wrapper(opt))
    train_step(model, opt, seed=0)
    assert detector.steps_since_publish == 1
    with pytest.raises(ConfigError, match="not a torch.optim.Optimizer"):
        BF16ChangeDetector(model, object())
    assert checkpoint_name("module._orig_mod.model.layers.0.weight") == "model.layers.0.weight"
    assert checkpoint_name("model.layers.0._checkpoint_wrapped_module.mlp.weight") == "model.layers.0.mlp.weight"


def test_accelerate_wrapped_optimizer() -> None:
    """accelerate's AcceleratedOptimizer subclasses Optimizer: the hook must reach the inner one."""
    from accelerate import Accelerator

    model = small_transformer()
    accelerator = Accelerator(cpu=True)
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    detector = BF16ChangeDetector(model, opt)
    published = bf16_state_dict(model)
    train_step(model, opt, seed=0)
    assert detector.steps_since_publish == 1
    assert_exact(detector, published, model)


# --------------------------------------------------------------------------- weight sources


class _Averaged:
    """A weight computed when read: the mean of two parameters (not a tensor of its own)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b
        self.shape, self.dtype, self.device = a.shape, a.dtype, a.device

    def numel(self) -> int:
        return self.a.numel()

    def detach(self) -> torch.Tensor:
        return (self.a.detach() + self.b.detach()) / 2


class _AveragedGates(WeightSource):
    """A source of one's own: each layer's averaged gate and up projections under a name of its
    own, stepped by both, and a constant that nothing steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.prepared = 0

    def weights(self) -> list[SourceWeight]:
        out = [SourceWeight("constant", torch.arange(6.0).reshape(2, 3))]
        for i, layer in enumerate(self.model.model.layers):
            gate, up = layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight
            out.append(SourceWeight(f"layers.{i}.gate_up_mean", _Averaged(gate, up), (gate, up)))
        return out

    def prepare(self) -> None:
        self.prepared += 1


def _averaged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {"constant": torch.arange(6.0).reshape(2, 3).to(torch.bfloat16)}
    for i, layer in enumerate(model.model.layers):
        mean = (layer.mlp.gate_proj.weight.detach() + layer.mlp.up_proj.weight.detach()) / 2
        state[f"layers.{i}.gate_up_mean"] = mean.to(torch.bfloat16)
    return state


def test_a_source_of_ones_own_feeds_the_same_detector_and_publisher(tmp_path) -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    source = _AveragedGates(model)
    with DeltaPublisher(tmp_path / "bucket", source, opt, anchor_every=100, anchor_bytes_ratio=0) as publisher:
        assert type(publisher.detector) is BF16ChangeDetector and publisher.detector.source is source
        # Tracked: what a parameter in the optimizer steps; the constant is read live for anchors.
        assert publisher.detector.tracked == ["layers.0.gate_up_mean", "layers.1.gate_up_mean"]
        receiver = DeltaReceiver(tmp_path / "bucket")
        for step in range(3):
            result = publisher.publish()
            assert source.prepared >= step + 1  # before every read of the values
            receiver.sync()
            want = _averaged_state(model)
            assert result.fingerprint == fingerprint(want) == receiver.fingerprint
            assert all(torch.equal(receiver.state_dict()[n], t) for n, t in want.items())
            if step:
                assert result.kind == "delta" and 0 < result.changed < want["layers.0.gate_up_mean"].numel() * 2
            train_step(model, opt, seed=step)


def test_a_module_is_read_through_its_model_weights() -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    plain, sourced = BF16ChangeDetector(model, opt), BF16ChangeDetector(ModelWeights(model), opt)
    assert isinstance(plain.source, ModelWeights) and plain.tracked == sourced.tracked
    train_step(model, opt, seed=0)
    got, want = plain.changes(), sourced.changes()
    assert sorted(got) == sorted(want) and all(torch.equal(got[n].index, want[n].index) for n in want)
