"""Helpers shared by the tests: small models built offline, and training steps."""

from __future__ import annotations

import torch

def small_transformer(seed: int = 0) -> torch.nn.Module:
    """A 2-layer Qwen2-style causal LM with tied embeddings, fp32, built from a config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(config).float()

def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int, *, step: bool = True) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (4, 16), generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if step:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
