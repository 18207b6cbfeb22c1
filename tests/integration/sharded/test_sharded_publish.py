"""FSDP2, DDP and HSDP trainers on 2 and 3 gloo processes publish exactly, collectively.

One process group per world size runs every check (see ``_sharded_workers.py``): construction
refusals, 32 steps publishing after each (zstd, a split anchor beside every 10th version, a
failure injected on a delta part and on the pointer, which commit nothing, and on an anchor
part, which loses only that anchor), 30 steps publishing every 3rd (raw codec, anchors by
size), followers reading deltas only, late receivers catching up from split anchors, DDP (rank 0
alone writes, deltas and anchors identical to a single process's) and HSDP with 2 replica groups;
quantized views (FP8_DYNAMIC, FP8_BLOCK) written as one part per rank, equal to compressed-tensors'
quantization of the gathered weights and to a single process's views of them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import _sharded_workers


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_publish_is_exact(tmp_path: Path, world: int) -> None:
    out = tmp_path / "report.json"
    mp.spawn(
        _sharded_workers.run,
        args=(world, str(tmp_path / "init"), str(tmp_path / "buckets"), str(out)),
        nprocs=world,
        join=True,
    )
    report = json.loads(out.read_text())
    total = report["total"]
    # Each rank keeps 2 bytes per element of its own shard: about 1/W of a single process's.
    assert sum(report["snapshot_bytes"]) == 2 * total
    assert max(report["snapshot_bytes"]) <= 2 * total / world * 1.1
    assert report["versions_a"] == 32 - 2  # two publishes failed and committed nothing
    # Anchors beside 10 (lost: a part failed), 11 (due at once) and 21; one kept, and the deltas
    # back to the anchor before it.
    assert (report["anchors_a"], report["base_a"]) == ([21], 11)
    assert report["chain_a"] == report["versions_a"] - 11
    assert report["versions_b"] == 10
    _same_views_as_one_process(tmp_path)


def _same_views_as_one_process(tmp_path: Path) -> None:
    """A single process publishing the gathered weights of each version writes views whose
    fingerprints are the sharded publisher's."""
    import torch

    from deltasync import DeltaPublisher

    saved = torch.load(tmp_path / "views.pt")
    net = _sharded_workers.view_model()
    params = dict(net.named_parameters())
    with DeltaPublisher(tmp_path / "solo", net, views=_sharded_workers.VIEWS) as solo:
        for state, fingerprints in zip(saved["states"], saved["fingerprints"], strict=True):
            with torch.no_grad():
                for name, value in state.items():
                    params[name].copy_(value)
            solo.publish()
            got = {v: solo.view_fingerprint(v) for v in _sharded_workers.VIEWS}
            # (None: the sharded view failed that version on purpose.)
            assert {v: f for v, f in got.items() if fingerprints[v] is not None} == {
                v: f for v, f in fingerprints.items() if f is not None
            }


def test_hsdp_two_replica_groups_of_two_shards(tmp_path: Path) -> None:
    out = tmp_path / "ok"
    mp.spawn(
        _sharded_workers.run_hsdp,
        args=(4, str(tmp_path / "init"), str(tmp_path / "buckets"), str(out)),
        nprocs=4,
        join=True,
    )
    assert out.read_text() == "ok"
