"""A tiny Qwen3-MoE trained by FSDP2 (2 and 3 gloo processes), DDP and FSDP2 with merged LoRA
publishes in checkpoint layout, exactly.

Fused experts ``(experts, 2 x inter, hidden)`` are sharded on dim 0: at 2 ranks with 8 experts
the ranks hold 4 whole experts each, at 3 ranks with 4 experts 2, 2 and none (the embedding's
512 rows split 171, 171, 170). 30 AdamW steps (the
router and the experts routed on each rank's 2 tokens step), a version after each: rank 0's
receiver (reading deltas only) equals ``save_pretrained`` of the gathered model bit for bit
and the version's fingerprint is that state's single-process fingerprint; a late receiver
from the last anchor (split in one part per rank under FSDP2) equals it too. Under FSDP2 the
publisher also writes FP8_DYNAMIC and FP8_BLOCK views: after every version they hold
compressed-tensors' quantization of that state, per-expert tensors quantized by the rank that
holds the expert.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from deltasync.examples.tiny import build_tiny_moe_model

sys.path.insert(0, str(Path(__file__).parent))
import _moe_workers


@pytest.mark.parametrize(
    "world, experts, tied, runs",
    [(2, 8, True, ["fsdp2", "ddp", "fsdp2-merged-lora"]), (3, 4, False, ["fsdp2"])],
    ids=["2-ranks-8-experts-tied", "3-ranks-4-experts"],
)
def test_moe_publishes_save_pretrained_layout_on_every_rank(tmp_path: Path, world, experts, tied, runs) -> None:
    model_dir = build_tiny_moe_model(tmp_path / "model", num_experts=experts, tie_word_embeddings=tied)
    out = tmp_path / "report.json"
    steps = 30
    mp.spawn(
        _moe_workers.run,
        args=(world, str(tmp_path / "init"), str(tmp_path / "buckets"), str(model_dir), runs, steps, str(out)),
        nprocs=world,
        join=True,
    )
    report = json.loads(out.read_text())
    assert sorted(report) == sorted(runs)
    for parallel, entry in report.items():
        files = 0 if parallel == "ddp" else world
        assert entry["parts"] == [files] * steps, (parallel, entry)
        assert entry["anchor_parts"] == [files], (parallel, entry)
        assert entry["changed"] > 0
