"""Tree attention for TRL's async GRPO trainer without flash-attention: pure PyTorch.

TRL 1.16's ``AsyncGRPOTrainer`` loads the policy with ``attn_implementation="tree_fa3"``: a
training row is a prefix trie of samples laid out in DFS order, and every trie segment
attends to the K/V of its root-to-segment path through flash-attention 3's varlen kernel,
which TRL fetches from the Hub. No such kernel exists on a CPU (or without the Hub), so
:func:`tree_attention_sdpa` computes the same thing with one causal SDPA call per segment.

The layout (``trl.experimental.async_grpo.packing.TreeRow.pack``), for ``N`` packed tokens and
``S`` segments:

- ``tree_cu_seqlens_q`` (``S + 1``): segment ``s`` is packed rows ``[q[s], q[s+1])``.
- ``tree_kv_index`` / ``tree_cu_seqlens_k`` (``S + 1``): the K/V rows segment ``s`` sees are
  ``tree_kv_index[k[s]:k[s+1]]``, its whole root-to-segment path, ending with the segment itself.
- Causality is aligned bottom-right, as flash-attention's ``causal=True`` does when there are
  more keys than queries: query ``i`` of a segment with ``Lq`` queries and ``Lk`` keys sees
  keys ``0 .. i + Lk - Lq``.

The function registered under TRL's name (:func:`register_cpu_tree_attention`) hands CUDA
tensors to TRL's own flash-attention function, so registering it never changes GPU runs.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "TREE_ATTENTION",
    "tree_attention_sdpa",
    "tree_attention",
    "register_cpu_tree_attention",
    "is_cpu_tree_attention_registered",
]

#: The attention name TRL's async GRPO trainer loads its model with
#: (``trl.experimental.async_grpo.packing.TREE_ATTENTION``).
TREE_ATTENTION = "tree_fa3"


def _segment_mask(
    q_len: int, k_len: int, sliding_window: int | None, device: torch.device
) -> torch.Tensor:
    """Boolean ``(q_len, k_len)`` mask, True where a query may attend: causal, aligned bottom-right."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (k_len - q_len)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    allowed = cols <= rows
    if sliding_window:
        # flash-attention's window_size=(sliding_window - 1, 0), which is what TRL passes.
        allowed &= cols > rows - sliding_window
    return allowed


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of ``q`` (H, Lq, D) over ``k``/``v`` (H, Lk, D) under a boolean mask."""
    if not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # SDPA has no logit soft-capping (Gemma 2); this is the flash-attention formula.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def tree_attention_sdpa(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    tree_kv_index: torch.Tensor,
    tree_cu_seqlens_q: torch.Tensor,
    tree_cu_seqlens_k: torch.Tensor,
    tree_max_seqlen_q: int | None = None,
    tree_max_seqlen_k: int | None = None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Tree attention over one packed row, with the signature of a transformers attention function.

    Args:
        module: The attention module calling (unused; part of the interface).
        query: ``(1, H, N, D)``, the packed row's queries.
        key: ``(1, H_kv, N, D)``; ``H`` must be a multiple of ``H_kv`` (grouped-query attention).
        value: ``(1, H_kv, N, D)``.
        attention_mask: Ignored: TRL registers a mask function that returns ``None``, and the
            tree layout alone says what each token sees.
        tree_kv_index: ``(K,)`` packed rows of every segment's root-to-segment path, end to end.
        tree_cu_seqlens_q: ``(S + 1,)`` segment boundaries in the row.
        tree_cu_seqlens_k: ``(S + 1,)`` path boundaries in ``tree_kv_index``.
        tree_max_seqlen_q: Longest segment (unused; the flash kernel's sizing hint).
        tree_max_seqlen_k: Longest path (unused).
        scaling: Softmax scale; ``1 / sqrt(D)`` when ``None``.
        sliding_window: Keys a query sees, itself included, when set.
        softcap: Logit soft cap, when set.

    Returns:
        ``(output, None)`` with ``output`` of shape ``(1, N, H, D)`` in the query's dtype, as
        transformers expects from an attention function.
    """
    if query.shape[0] != 1:
        raise ValueError(
            f"tree attention takes one packed row (batch size 1), got query of shape {tuple(query.shape)}; "
            "TRL's async GRPO trainer packs every rank's samples into a single row."
        )
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(
            f"tree attention needs the query heads ({num_heads}) to be a multiple of the key/value heads "
            f"({num_kv_heads})."
        )
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    # (1, H, N, D) -> (H, N, D); K/V gathered along their paths, then expanded for grouped-query attention.
    q_all = query[0]
    k_all = key[0].index_select(1, tree_kv_index)
    v_all = value[0].index_select(1, tree_kv_index)
    if num_kv_heads != num_heads:
        k_all = k_all.repeat_interleave(num_heads // num_kv_heads, dim=0)
        v_all = v_all.repeat_interleave(num_heads // num_kv_heads, dim=0)

    cu_q = tree_cu_seqlens_q.tolist()
    cu_k = tree_cu_seqlens_k.tolist()
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"tree_cu_seqlens_q has {len(cu_q)} entries but tree_cu_seqlens_k has {len(cu_k)}: both must hold "
            "one boundary per segment plus one."
        )
    if cu_q[-1] != query.shape[2] or cu_k[-1] != tree_kv_index.numel():
        raise ValueError(
            f"the tree layout covers {cu_q[-1]} queries and {cu_k[-1]} key rows, but the row has "
            f"{query.shape[2]} tokens and tree_kv_index has {tree_kv_index.numel()} entries; strip the padding "
            "(entries < 0) the collator adds before the forward, as AsyncGRPOTrainer.compute_loss does."
        )

    outputs = []
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:]):
        if q1 - q0 > k1 - k0:
            raise ValueError(
                f"tree segment [{q0}, {q1}) has {q1 - q0} queries but its path has only {k1 - k0} keys; "
                "a segment's path always ends with the segment itself."
            )
        mask = _segment_mask(q1 - q0, k1 - k0, sliding_window, query.device)
        outputs.append(_attend(q_all[:, q0:q1], k_all[:, k0:k1], v_all[:, k0:k1], mask, scale, softcap))
    out = torch.cat(outputs, dim=1) if outputs else q_all.new_zeros(q_all.shape)
    return out.transpose(0, 1).unsqueeze(0), None


def tree_attention(
    module: torch.nn.Module | None,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """What :func:`register_cpu_tree_attention` registers: TRL's flash-attention kernel for CUDA
    tensors, :func:`tree_attention_sdpa` for anything else."""
    if query.device.type == "cuda":
        from trl.experimental.async_grpo.packing import tree_attention as flash_tree_attention

        return flash_tree_attention(module, query, key, value, attention_mask, **kwargs)
    return tree_attention_sdpa(module, query, key, value, attention_mask, **kwargs)


def _no_mask(**kwargs: Any) -> None:
    # The tree layout is the mask; transformers must not build a dense one.
    return None


def register_cpu_tree_attention() -> None:
    """Register :func:`tree_attention` under ``"tree_fa3"``, replacing TRL's flash-only function.

    ``AsyncGRPOTrainer.__init__`` registers TRL's own function under that name every time it
    runs, so call this after constructing the trainer (or construct it inside
    :func:`deltasync.trl._cpu_compat.async_grpo_cpu_patches`). transformers looks the function up
    at every forward, so the model needs no reloading. Idempotent.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, _no_mask)


def is_cpu_tree_attention_registered() -> bool:
    """Whether ``"tree_fa3"`` currently resolves to this module's function."""
    from transformers import AttentionInterface

    return AttentionInterface._global_mapping.get(TREE_ATTENTION) is tree_attention
