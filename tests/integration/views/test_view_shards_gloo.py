"""Row shards quantized by separate gloo processes (FSDP2's Shard(0) split, an all-reduce MAX of
the block abs-max) concatenate to the full weight's view, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import _view_shard_workers

pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("world", [3, 4])
def test_ranks_concatenate_to_the_full_view(tmp_path: Path, world: int) -> None:
    # Channel scales are rank-local (tests/unit/views/test_view_schemes.py); blocks need the collective.
    from deltasync.views import get_scheme

    name = "FP8_BLOCK"

    shape = (300, 200)  # 100 or 75 rows a rank: 128-row blocks straddle ranks
    out = str(tmp_path / "view")
    mp.spawn(_view_shard_workers.run, args=(world, str(tmp_path / "init"), name, shape, out), nprocs=world, join=True)
    parts = [torch.load(f"{out}.{rank}") for rank in range(world)]
    assert [p["rows"] for p in parts] == [-(-300 // world)] * (world - 1) + [300 - (world - 1) * -(-300 // world)]
    torch.manual_seed(0)
    full = (torch.randn(shape) * 0.02).to(torch.bfloat16)
    full[5] *= 300
    want = get_scheme(name).quantize(full)
    codes = torch.cat([p["weight"] for p in parts])
    scales = torch.cat([p["weight_scale"] for p in parts])
    assert torch.equal(codes.view(torch.uint8), want["weight"].view(torch.uint8))
    assert torch.equal(scales.view(torch.int16), want["weight_scale"].view(torch.int16))
