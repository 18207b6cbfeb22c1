"""Background publishing with FSDP2 on 1, 2 and 3 gloo processes: capture is collective, each
rank writes its part in its own background thread, rank 0 commits; failures reach every rank;
anchors are written beside deltas and followers never read them; ``capture="overlap"``, also
with FP8_DYNAMIC and FP8_BLOCK views (see ``_background_workers.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import _background_workers


@pytest.mark.parametrize("world", [1, 2, 3])
def test_background_publishing_is_exact_on_every_rank(tmp_path: Path, world: int) -> None:
    out = tmp_path / "ok"
    mp.spawn(
        _background_workers.run,
        args=(world, str(tmp_path / "init"), str(tmp_path / "buckets"), str(out)),
        nprocs=world,
        join=True,
    )
    assert out.read_text() == "ok"
