"""Share of a quantized view that changes per step, against the share of bf16 elements that change.

A 2048x2048 fp32 master weight (normal, std 0.02) takes sign-momentum updates (``w -= lr *
sign(m)``, ``m`` an exponential average of fresh normal gradients, beta 0.9: each step moves every
element by exactly ``lr``, in the direction its momentum says). Each step the bf16 copy is
quantized with every view scheme (``deltasync.views``: compressed-tensors' arithmetic, as
llm-compressor writes it) and compared with the step before:

- bf16: elements whose bf16 bits changed;
- codes: quantized codes that changed;
- scales: scales that changed (rows for channel schemes, 128x128 blocks for FP8_BLOCK);
- rows/blocks touched: scale rows or blocks with any changed code or scale.

``lr`` is set per target density by bisection on a separate warm-up run, then ``--steps`` steps
are measured after ``--warmup`` steps and averaged. Run from the repository root:

    python benchmarks/view_change_share.py --out benchmarks/results/view_change_share.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

try:
    import deltasync  # noqa: F401
except ImportError:  # a checkout without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine

from deltasync.views import SCHEMES, get_scheme


class Trace:
    """The fp32 master weight and its sign-momentum updates (seeded)."""

    def __init__(self, n: int, lr: float, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.w = torch.randn(n, n, generator=self.gen) * 0.02
        self.m = torch.zeros_like(self.w)
        self.lr = lr

    def step(self) -> torch.Tensor:
        g = torch.randn(self.w.shape, generator=self.gen)
        self.m.mul_(0.9).add_(g, alpha=0.1)
        self.w.sub_(self.lr * torch.sign(self.m))
        return self.w.to(torch.bfloat16)


def bf16_share(lr: float, n: int, warmup: int, seed: int) -> float:
    trace = Trace(n, lr, seed)
    last = trace.w.to(torch.bfloat16)
    for _ in range(warmup):
        last = trace.step()
    now = trace.step()
    return float((now.view(torch.int16) != last.view(torch.int16)).float().mean())


def find_lr(target: float, n: int, warmup: int, seed: int) -> float:
    low, high = 1e-9, 1e-3
    for _ in range(30):  # bisection in log space
        mid = (low * high) ** 0.5
        if bf16_share(mid, n, warmup, seed + 1) < target:
            low = mid
        else:
            high = mid
    return (low * high) ** 0.5


def measure(lr: float, n: int, warmup: int, steps: int, seed: int) -> dict[str, object]:
    trace = Trace(n, lr, seed)
    schemes = [get_scheme(name) for name in SCHEMES]
    now = trace.w.to(torch.bfloat16)
    for _ in range(warmup):
        now = trace.step()
    views = {s.name: s.quantize(now) for s in schemes}
    rows: list[dict[str, float]] = []
    for _ in range(steps):
        new = trace.step()
        row = {"bf16": float((new.view(torch.int16) != now.view(torch.int16)).float().mean())}
        for s in schemes:
            view = s.quantize(new)
            codes = view["weight"].view(torch.uint8) != views[s.name]["weight"].view(torch.uint8)
            scales = view["weight_scale"].view(torch.int16) != views[s.name]["weight_scale"].view(torch.int16)
            if s.block is None:
                touched = codes.any(dim=1, keepdim=True) | scales
            else:
                bh, bw = s.block
                blocks = codes.reshape(n // bh, bh, n // bw, bw).any(dim=3).any(dim=1)
                touched = blocks | scales
            row[f"{s.name}.codes"] = float(codes.float().mean())
            row[f"{s.name}.scales"] = float(scales.float().mean())
            row[f"{s.name}.touched"] = float(touched.float().mean())
            views[s.name] = view
        rows.append(row)
        now = new
    mean = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    return {"lr": lr, "mean": mean, "steps": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.01, 0.04, 0.10])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for target in args.targets:
        lr = find_lr(target, min(args.size, 512), args.warmup, args.seed)
        result = measure(lr, args.size, args.warmup, args.steps, args.seed)
        result["target_bf16"] = target
        results.append(result)
        mean = result["mean"]
        assert isinstance(mean, dict)
        print(f"bf16 {mean['bf16']:7.2%} | " + " | ".join(
            f"{name} codes {mean[f'{name}.codes']:6.2%} scales {mean[f'{name}.scales']:6.2%}" for name in SCHEMES
        ), flush=True)  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
