"""Helpers for the MoE tests: a tiny MoE in training, routed-expert steps, save_pretrained's state."""

from __future__ import annotations

import pathlib
import tempfile

import torch

from deltasync import DeltaReceiver, fingerprint


def moe_model(model_dir: pathlib.Path) -> torch.nn.Module:
    """The model in ``model_dir`` loaded as a trainer does (fp32; transformers fuses the experts)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def routed_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int, tokens: int = 2) -> None:
    """One AdamW step on ``tokens`` random tokens: only the experts the router picks get gradients."""
    gen = torch.Generator().manual_seed(seed)
    vocab = getattr(model, "module", model).config.vocab_size  # DDP wraps the model
    ids = torch.randint(0, vocab, (1, tokens), generator=gen)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def saved_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes, rounded to bf16: the reference a receiver must equal."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        state: dict[str, torch.Tensor] = {}
        for path in sorted(pathlib.Path(tmp).glob("*.safetensors")):
            state.update({k: v.to(torch.bfloat16) for k, v in load_file(path).items()})
    return state


def assert_saved(receiver: DeltaReceiver, want: dict[str, torch.Tensor]) -> None:
    """``receiver`` holds ``want`` bit for bit, and its fingerprint is ``want``'s."""
    got = receiver.state_dict()
    assert sorted(got) == sorted(want)
    bad = [k for k, v in want.items() if got[k].shape != v.shape or not torch.equal(got[k].view(torch.int16), v.view(torch.int16))]
    assert not bad, bad
    assert receiver.fingerprint == fingerprint(want)
