"""The CPU tree attention equals plain causal attention over each sample, on TRL's own layouts.

Every packed input here is built by TRL 1.16 itself (``TreeRow`` and ``DataCollatorForRollout``),
then stripped of padding exactly as ``AsyncGRPOTrainer.compute_loss`` does, so the tests
exercise the layout the trainer really feeds its model.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout  # noqa: E402
from trl.experimental.async_grpo.packing import TREE_ATTENTION as TRL_TREE_ATTENTION  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402
from trl.experimental.async_grpo.packing import register_tree_attention as register_trl_tree_attention  # noqa: E402

from deltasync.trl._cpu_attention import (  # noqa: E402
    TREE_ATTENTION,
    is_cpu_tree_attention_registered,
    register_cpu_tree_attention,
    tree_attention_sdpa,
)

TREE_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


def _sample(input_ids: list[int], prompt_len: int, group_id: int) -> dict:
    """A queued rollout sample as ``RolloutQueueDataset`` yields it (numpy arrays, as the worker sends)."""
    completion_mask = np.zeros(len(input_ids), dtype=np.int64)
    completion_mask[prompt_len:] = 1
    return {
        "input_ids": np.asarray(input_ids, dtype=np.int64),
        "completion_mask": completion_mask,
        "old_log_probs": np.zeros(len(input_ids), dtype=np.float32),
        "advantage": 1.0,
        "group_id": group_id,
        "metrics": {},
    }


def _rollout_groups(seed: int, num_groups: int, num_generations: int) -> list[list[dict]]:
    """Groups of samples sharing a prompt, with completions that share prefixes of their own,
    that stop at different lengths, and that are prefixes of one another."""
    rng = np.random.default_rng(seed)
    groups = []
    for group_id in range(num_groups):
        prompt = rng.integers(1, 50, size=int(rng.integers(3, 9))).tolist()
        trunk = rng.integers(50, 100, size=int(rng.integers(1, 6))).tolist()
        samples = []
        for g in range(num_generations):
            if g % 3 == 2 and samples:
                # A strict prefix of an earlier completion: ends inside another sample's path.
                previous = samples[-1]["input_ids"].tolist()
                cut = max(len(prompt) + 1, len(previous) - int(rng.integers(1, 3)))
                samples.append(_sample(previous[:cut], len(prompt), group_id))
                continue
            head = trunk if g % 2 == 0 else []
            tail = rng.integers(1, 100, size=int(rng.integers(1, 12))).tolist()
            samples.append(_sample(prompt + head + tail, len(prompt), group_id))
        groups.append(samples)
    return groups


def _trl_rows(groups: list[list[dict]], num_rows: int) -> list[dict[str, torch.Tensor]]:
    """Pack the groups into ``num_rows`` rows with TRL's collator; return each rank's stripped inputs."""
    rows = [TreeRow() for _ in range(num_rows)]
    for i, group in enumerate(groups):
        for sample in group:
            rows[i % num_rows].add(sample)
    batch = DataCollatorForRollout(pad_token_id=0, num_processes=num_rows).torch_call([rows])
    stripped = []
    for rank in range(num_rows):
        # What DataLoaderDispatcher hands rank `rank`, then what compute_loss keeps of it.
        inputs = {key: value[rank : rank + 1] for key, value in batch.items()}
        mask_bool = inputs["attention_mask"].bool()
        row = {
            "input_ids": inputs["input_ids"][mask_bool],
            "position_ids": inputs["position_ids"][mask_bool],
            **{key: inputs[key][inputs[key] >= 0] for key in TREE_KEYS},
        }
        row["tree_max_seqlen_q"], row["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
        row["samples"] = rows[rank].samples
        stripped.append(row)
    return stripped


def _leaf_paths(row: dict) -> list[list[int]]:
    """Root-to-leaf paths of packed positions, read off the layout alone.

    ``tree_kv_index`` holds every segment's root-to-segment path; a segment is a leaf when no other
    path continues through its last position. Every sample ends on a leaf, so these are the samples.
    """
    kv, cu_k = row["tree_kv_index"].tolist(), row["tree_cu_seqlens_k"].tolist()
    paths = [kv[a:b] for a, b in zip(cu_k[:-1], cu_k[1:])]
    return [
        path
        for path in paths
        if not any(other is not path and len(other) > len(path) and other[len(path) - 1] == path[-1] for other in paths)
    ]


def _reference_attention(q, k, v, *, scale, sliding_window=None, softcap=None):
    """Plain causal attention over one sample: (H, L, D) each, K/V heads repeated for GQA."""
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    length = q.shape[1]
    i = torch.arange(length).unsqueeze(1)
    j = torch.arange(length).unsqueeze(0)
    allowed = j <= i
    if sliding_window:
        allowed &= j > i - sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def test_layout_paths_are_the_samples():
    """The reading of the layout the other tests rely on: leaf paths spell exactly the samples."""
    for row in _trl_rows(_rollout_groups(seed=0, num_groups=3, num_generations=6), num_rows=2):
        ids = row["input_ids"].tolist()
        from_layout = {tuple(ids[p] for p in path) for path in _leaf_paths(row)}
        packed_samples = {tuple(sample["input_ids"].tolist()) for sample in row["samples"]}
        assert from_layout == packed_samples
        # Tokens are shared: fewer packed positions than raw tokens, and every position is on a path.
        assert len(ids) < sum(len(sample["input_ids"]) for sample in row["samples"])
        assert {p for path in _leaf_paths(row) for p in path} == set(range(len(ids)))
        for path in _leaf_paths(row):
            assert row["position_ids"][path].tolist() == list(range(len(path)))


CASES = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa-2": dict(heads=4, kv_heads=2),
    "gqa-4": dict(heads=8, kv_heads=2),
    "mqa": dict(heads=3, kv_heads=1),
    "sliding-window": dict(heads=4, kv_heads=2, sliding_window=5),
    "softcap": dict(heads=4, kv_heads=2, softcap=3.0),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_per_sample_attention_outputs_and_gradients(case, seed):
    heads, kv_heads = case["heads"], case["kv_heads"]
    sliding_window, softcap = case.get("sliding_window"), case.get("softcap")
    head_dim = 16
    scale = 1.0 / math.sqrt(head_dim)
    rows = _trl_rows(_rollout_groups(seed=seed, num_groups=3, num_generations=5), num_rows=2)
    generator = torch.Generator().manual_seed(seed)
    for row in rows:
        n = row["input_ids"].numel()
        assert len(row["tree_cu_seqlens_q"]) > 4  # several segments
        q = torch.randn(1, heads, n, head_dim, generator=generator, requires_grad=True)
        k = torch.randn(1, kv_heads, n, head_dim, generator=generator, requires_grad=True)
        v = torch.randn(1, kv_heads, n, head_dim, generator=generator, requires_grad=True)
        tree_kwargs = {key: row[key] for key in (*TREE_KEYS, "tree_max_seqlen_q", "tree_max_seqlen_k")}

        out, weights = tree_attention_sdpa(
            None, q, k, v, None, scaling=scale, sliding_window=sliding_window, softcap=softcap, **tree_kwargs
        )
        assert weights is None
        assert out.shape == (1, n, heads, head_dim) and out.dtype == q.dtype

        paths = _leaf_paths(row)
        cotangents = [torch.randn(len(path), heads, head_dim, generator=generator) for path in paths]
        references = []
        for path in paths:
            index = torch.tensor(path)
            ref = _reference_attention(
                q[0][:, index],
                k[0][:, index],
                v[0][:, index],
                scale=scale,
                sliding_window=sliding_window,
                softcap=softcap,
            )
            references.append(ref.transpose(0, 1))
            torch.testing.assert_close(out[0][index], references[-1], rtol=1e-5, atol=2e-6)

        tree_grads = torch.autograd.grad(
            sum((out[0][torch.tensor(p)] * c).sum() for p, c in zip(paths, cotangents)), (q, k, v)
        )
        ref_grads = torch.autograd.grad(sum((r * c).sum() for r, c in zip(references, cotangents)), (q, k, v))
        for name, tree_grad, ref_grad in zip("qkv", tree_grads, ref_grads):
            assert tree_grad.abs().sum() > 0, name
            # Gradients sum over every query that sees a key, in another order than the reference.
            torch.testing.assert_close(tree_grad, ref_grad, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


def test_rejects_layout_that_still_holds_padding():
    row = _trl_rows(_rollout_groups(seed=0, num_groups=2, num_generations=3), num_rows=1)[0]
    n = row["input_ids"].numel()
    q = torch.randn(1, 2, n + 1, 16)  # one padded position left in
    k = v = torch.randn(1, 2, n + 1, 16)
    with pytest.raises(ValueError, match="strip the padding"):
        tree_attention_sdpa(None, q, k, v, None, **{key: row[key] for key in TREE_KEYS})


def _tiny_qwen2(attn_implementation: str) -> transformers.PreTrainedModel:
    config = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM._from_config(
        config, attn_implementation=attn_implementation, dtype=torch.float32
    )


def test_qwen2_tree_forward_matches_per_sample_forward():
    """Through a real model: the trainer's packed forward (tree kwargs routed down to attention)
    gives each sample's logits, and the same parameter gradients, as one eager forward per sample."""
    register_cpu_tree_attention()
    tree_model = _tiny_qwen2(TREE_ATTENTION)
    ref_model = _tiny_qwen2("eager")
    ref_model.load_state_dict(tree_model.state_dict())
    row = _trl_rows(_rollout_groups(seed=3, num_groups=3, num_generations=5), num_rows=1)[0]
    tree_kwargs = {key: row[key] for key in (*TREE_KEYS, "tree_max_seqlen_q", "tree_max_seqlen_k")}

    logits = tree_model(
        input_ids=row["input_ids"].unsqueeze(0), position_ids=row["position_ids"].unsqueeze(0), **tree_kwargs
    ).logits[0]
    generator = torch.Generator().manual_seed(0)
    tree_loss = ref_loss = 0.0
    for path in _leaf_paths(row):
        index = torch.tensor(path)
        ref_logits = ref_model(input_ids=row["input_ids"][index].unsqueeze(0)).logits[0]
        torch.testing.assert_close(logits[index], ref_logits, rtol=1e-5, atol=1e-5)
        weight = torch.randn(ref_logits.shape, generator=generator)
        tree_loss = tree_loss + (logits[index] * weight).sum()
        ref_loss = ref_loss + (ref_logits * weight).sum()
    tree_loss.backward()
    ref_loss.backward()
    ref_params = dict(ref_model.named_parameters())
    for name, param in tree_model.named_parameters():
        ref_grad = ref_params[name].grad
        # Sums over every logit in another order: compare at fp32 rounding of the gradient's own scale.
        scale = ref_grad.abs().max().item()
        torch.testing.assert_close(param.grad, ref_grad, rtol=0, atol=1e-5 * scale, msg=lambda m, name=name: f"{name}: {m}")


def test_registration_replaces_trl_flash_function_and_is_idempotent():
    from transformers import AttentionInterface

    assert TREE_ATTENTION == TRL_TREE_ATTENTION
    register_trl_tree_attention()  # what AsyncGRPOTrainer.__init__ does
    assert not is_cpu_tree_attention_registered()
    register_cpu_tree_attention()
    register_cpu_tree_attention()
    assert is_cpu_tree_attention_registered()
    assert AttentionInterface._global_mapping[TREE_ATTENTION].__module__ == "deltasync.trl._cpu_attention"


def test_cpu_patches_make_the_trainer_constructible(tmp_path):
    """Built offline: the constructor never contacts the vLLM server."""
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer as trainer_module

    from deltasync.examples.tiny import build_tiny_model
    from deltasync.trl._cpu_compat import async_grpo_cpu_patches, cpu_config_overrides

    if torch.cuda.is_available():
        pytest.skip("checks the CPU path")
    model_dir = build_tiny_model(tmp_path / "model")
    original = trainer_module.get_peak_flops_per_device
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"),
        report_to=[],
        max_steps=1,
        **cpu_config_overrides(),
    )
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hello"}]]})
    with async_grpo_cpu_patches():
        trainer = AsyncGRPOTrainer(model=str(model_dir), reward_funcs=_reward, args=args, train_dataset=dataset)
    assert trainer._peak_flops_per_device is None
    assert trainer.model.config._attn_implementation == TREE_ATTENTION
    assert is_cpu_tree_attention_registered()
    assert trainer_module.get_peak_flops_per_device is original


def _reward(completions, **kwargs):
    return [0.0] * len(completions)
