"""PEFT LoRA models trained by 2 gloo processes publish exactly, in adapter and merged mode.

One process group (see ``_lora_workers.py``) runs: a refusal (merged mode with a LoRA layer
sharded only in part), then FSDP2 (``fully_shard``) and DDP, each in adapter mode and merged
mode: 5 optimizer steps with different data per rank, a publish after each, an anchor beside
version 3. After every version rank 0's receiver (reading deltas only) and at the end a late
receiver (from the anchor beside version 3) must hold, bit for bit, what the gathered
model gives: its adapter tensors in bf16 (adapter mode), or PEFT's ``merge_and_unload`` then
``.to(bfloat16)`` (merged mode); adapter anchors carry the PEFT config and the base
fingerprint of the gathered base weights.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

pytest.importorskip("peft")
sys.path.insert(0, str(Path(__file__).parent))
import _lora_workers


def test_peft_fsdp2_and_ddp_publish_exactly_in_both_modes(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    mp.spawn(
        _lora_workers.run,
        args=(2, str(tmp_path / "init"), str(tmp_path / "buckets"), str(out)),
        nprocs=2,
        join=True,
    )
    report = json.loads(out.read_text())
    # FSDP2: every version in 2 part files (one per shard rank); DDP: rank 0 alone, single files.
    # The pointer keeps anchor 3 and the deltas back to anchor 0: deltas 1..5.
    assert report["fsdp2-adapter"]["parts"] == report["fsdp2-merged"]["parts"] == [2] * 5
    assert report["fsdp2-adapter"]["anchor_parts"] == report["fsdp2-merged"]["anchor_parts"] == [2]
    assert report["ddp-adapter"]["parts"] == report["ddp-merged"]["parts"] == [0] * 5
    assert report["ddp-adapter"]["anchor_parts"] == report["ddp-merged"]["anchor_parts"] == [0]
    assert all(entry["changed"] > 0 for entry in report.values())
