"""What each rank runs in the multi-process MoE tests (imported by spawned processes).

A tiny Qwen3-MoE (transformers fuses its experts in memory) trained by FSDP2 (fused experts
sharded on dim 0: each rank holds whole experts, or none) or DDP; rank 0's receiver must hold,
after every version, what ``save_pretrained`` of the gathered model writes, bit for bit.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from deltasync import DeltaPublisher, DeltaReceiver, fingerprint, merged_publisher
from moe_helpers import assert_saved, moe_model, routed_step, saved_state

from _sharded_workers import (  # this folder is on sys.path (the test puts it there)
    VIEWS,
    assert_view_exact,
    expected_view,
    follow,
    process_group,
)


def gathered_into(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Copy the (sharded or replicated) ``model``'s parameters into the plain ``reference``
    (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    mine = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        with torch.no_grad():
            mine[name.removeprefix("module.")].copy_(full)


def _shard(model: torch.nn.Module, world: int, layers: object) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in layers:  # type: ignore[attr-defined]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, config)


def _run(rank: int, world: int, root: Path, model_dir: Path, parallel: str, steps: int, report: dict[str, object]) -> None:
    merged = parallel.endswith("merged-lora")
    model = moe_model(model_dir)
    reference = moe_model(model_dir)  # the plain model to gather into (gathering is collective)
    if merged:
        model, reference = _lora(model), _lora(reference)
    if parallel.startswith("fsdp2"):
        _shard(model, world, model.get_base_model().model.layers if merged else model.model.layers)
        trained = model
    else:
        trained = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4, weight_decay=0.0)
    bucket = root / parallel
    views = VIEWS if parallel == "fsdp2" else ()
    publisher = (
        merged_publisher(bucket, model, opt, anchor_every=7) if merged
        else DeltaPublisher(bucket, trained, opt, anchor_every=7, views=views)
    )
    receiver = DeltaReceiver(bucket) if rank == 0 else None
    view_receivers = {v: DeltaReceiver(bucket, view=v) for v in views} if rank == 0 else {}
    targets = None
    parts = []
    for i in range(steps + 1):
        if i:
            routed_step(trained, opt, seed=100 * i + rank)  # different tokens per rank: different experts
        result = publisher.publish()
        gathered_into(model, reference)
        if receiver is None:
            continue
        want = saved_state(copy.deepcopy(reference).merge_and_unload() if merged else reference)
        if i:
            follow(receiver, result.version)
        else:
            receiver.sync()
        assert_saved(receiver, want)
        assert result.fingerprint == fingerprint(want)
        if view_receivers:  # per-expert checkpoint tensors, quantized by the rank holding the expert
            from deltasync.trainer.view_targets import quantized_names

            targets = targets or quantized_names(reference, list(want), ("lm_head",))
            assert any(".experts." in name for name in targets), sorted(targets)
            for view, view_receiver in view_receivers.items():
                view_receiver.sync()
                assert_view_exact(view_receiver, expected_view(view, want, targets), f"MoE view {view} step {i}")
                assert view_receiver.fingerprint == publisher.view_fingerprint(view)
        parts.append(len(receiver.pointer().chain[-1].parts) if i else 0)
    publisher.flush()
    if rank == 0:
        late = DeltaReceiver(bucket)  # from a split anchor (FSDP2) or a single file (DDP)
        staged = late.stage()
        assert staged.kind == "anchor", staged.kind
        late.apply(staged)
        assert_saved(late, want)
        report[parallel] = {"parts": parts[1:], "anchor_parts": [len(a.parts) for a in late.pointer().anchors],
                            "changed": result.changed, "snapshot_bytes": publisher.detector.snapshot_bytes}  # fmt: skip
    publisher.close()


def run(rank: int, world: int, init_file: str, root: str, model_dir: str, runs: list[str], steps: int, out: str) -> None:
    with process_group(rank, world, init_file, root):
        report: dict[str, object] = {}
        for parallel in runs:
            _run(rank, world, Path(root), Path(model_dir), parallel, steps, report)
        if rank == 0:
            Path(out).write_text(json.dumps(report))
