"""Worker of test_view_shards_gloo.py: one rank quantizes its Shard(0) rows of a weight."""

from __future__ import annotations

import torch
import torch.distributed as dist


def run(rank: int, world: int, init: str, name: str, shape: tuple[int, int], out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from deltasync.views import get_scheme

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same full weight on every rank
        full = (torch.randn(shape) * 0.02).to(torch.bfloat16)
        full[5] *= 300
        mesh = init_device_mesh("cpu", (world,))
        local = distribute_tensor(full, mesh, [Shard(0)]).to_local()  # FSDP2's row split
        sizes: list[int] = [0] * world
        dist.all_gather_object(sizes, local.shape[0])
        row0 = sum(sizes[:rank])
        scheme = get_scheme(name)
        amax = None
        if scheme.strategy == "block":
            amax = scheme.block_absmax_rows(local, row0, shape)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
        view = scheme.quantize_rows(local, row0, shape, block_amax=amax)
        torch.save({"row0": row0, "rows": local.shape[0], **view}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
