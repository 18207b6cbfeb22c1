"""Shared pieces of the LoRA server tests: a PEFT model, training steps, greedy answers per model name."""

from __future__ import annotations

import requests
import torch
from helpers import tiny_grpo_args
from servers import PROMPTS

TOKEN = "lora-test-secret"
TARGETS = ["q_proj", "v_proj"]

Greedy = list[tuple[tuple[int, ...], tuple[float, ...]]]


def lora_model(model_dir, **config):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    options = {"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "lora_dropout": 0.0, **config}
    return get_peft_model(base, LoraConfig(**options))


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train(model, optimizer, steps: int, seed: int = 0) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed + step)
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def greedy_for(url: str, model: str | None = None, max_tokens: int = 12) -> Greedy:
    """Greedy token ids and logprobs of :data:`PROMPTS` for ``model`` (a served name; None: the base)."""
    results: Greedy = []
    for prompt in PROMPTS:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        if model is not None:
            body["model"] = model
        response = requests.post(f"{url}/v1/completions", json=body, timeout=300)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        results.append((tuple(choice["token_ids"]), tuple(choice["logprobs"]["token_logprobs"])))
    return results


def make_trl_trainer(model_dir, bucket, url, tmp_path, *, steps, peft_config, **delta_options):
    from deltasync.examples.demo import reward_target_letter
    from deltasync.trl import AsyncGRPOTrainer, DeltaSyncConfig

    config, dataset = tiny_grpo_args(tmp_path / "out", url, steps, learning_rate=1e-3)
    return AsyncGRPOTrainer(
        model=str(model_dir),
        reward_funcs=[reward_target_letter],
        args=config,
        train_dataset=dataset,
        peft_config=peft_config,
        delta_sync=DeltaSyncConfig(bucket=str(bucket), server_urls=[url], token=TOKEN, **delta_options),
    )
