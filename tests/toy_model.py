"""The toy served model of the weight-map and chain-consumer tests: its loader does what vLLM's
do (rename, fuse, shard by rows and columns, pad, transform)."""

from __future__ import annotations

import torch


class ToyModel(torch.nn.Module):
    """A fused, row-sharded q/k projection, a column-sharded output, a padded embedding and a
    norm that the loader transforms (like a quantized or repacked layer would)."""

    def __init__(self, rank: int, world: int = 2, pad: int = 3) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        self.qk = torch.nn.Parameter(torch.zeros(4 // world + 2 // world, 6, dtype=torch.bfloat16), requires_grad=False)
        self.out = torch.nn.Parameter(torch.zeros(5, 6 // world, dtype=torch.bfloat16), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.zeros(7 // world + 1 + pad, 6, dtype=torch.bfloat16), requires_grad=False)
        self.norm = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            if name in ("q.weight", "k.weight"):
                rows = w.shape[0] // self.world
                shard = w.narrow(0, self.rank * rows, rows)
                start = 0 if name == "q.weight" else 4 // self.world
                self.qk.data.narrow(0, start, rows).copy_(shard)
                loaded.add("qk")
            elif name == "o.weight":
                cols = w.shape[1] // self.world
                self.out.data.copy_(w.narrow(1, self.rank * cols, cols))
                loaded.add("out")
            elif name == "embed.weight":
                per = -(-w.shape[0] // self.world)
                shard = w.narrow(0, self.rank * per, min(per, w.shape[0] - self.rank * per))
                self.emb.data[: shard.shape[0]].copy_(shard)
                self.emb.data[shard.shape[0] :].fill_(0)
                loaded.add("emb")
            elif name == "norm.weight":
                self.norm.data.copy_(w + 1)  # a transform: not patchable element by element
                loaded.add("norm")
            elif name == "lm_head.weight":
                continue  # tied: skipped
        return loaded


SHAPES = {"q.weight": (4, 6), "k.weight": (2, 6), "o.weight": (5, 6), "embed.weight": (7, 6), "norm.weight": (6,)}
