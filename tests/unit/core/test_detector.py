"""BF16ChangeDetector finds exactly the elements whose bf16 value changed since the last publish."""

from __future__ import annotations

import pytest
import torch
from helpers import small_transformer, train_step

from deltasync import BF16ChangeDetector, ConfigError, bf16_state_dict, checkpoint_name


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
