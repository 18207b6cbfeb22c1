"""Sharded publishing benchmark: FSDP2 over 1, 2 and 4 gloo ranks on the CPU.

The model is the simulated Qwen2.5-0.5B-shaped trace of ``benchmarks/codec.py`` (same tensor
shapes and names, same gradient process, same calibrated learning rate), sharded with
``fully_shard`` over W ranks. Each measured step runs simulated gradients on every rank's
local shard and an AdamW step, then, with every rank starting together:

1. **publish**: ``DeltaPublisher.publish()``, collective: each rank detects the changes of
   its own shard, encodes and writes its part, rank 0 commits the pointer. Reported per rank
   (the slowest rank's time is what the step waits for), with the detect and write times in it;
2. **gather**: what TRL's own weight sync does before it can send anything: ``full_tensor()``
   of every parameter, one at a time, on every rank (the fp32 training weights).

Also reported: the bytes of each rank's bf16 snapshot (``BF16ChangeDetector.snapshot_bytes``)
and the bytes written per version (all parts). At the end rank 0 syncs a ``DeltaReceiver``
from the bucket and checks it bit for bit against the gathered model; any difference aborts.

Run from the repository root, e.g. ``python benchmarks/sharded.py`` (scale 0.1, ~2 minutes);
see benchmarks/README.md for the reference run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import deltasync  # noqa: F401
except ImportError:  # a checkout without an install: import the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine
from codec import DEFAULT_LR, ModelShape, _normal, build_model

TARGETS = {
    "snapshot_ratio": "per-rank snapshot bytes x W / single-process snapshot bytes == 1",
    "publish_vs_gather": "slowest rank's publish / slowest rank's full_tensor() gather < 1, for W >= 2 (on one "
    "rank full_tensor() returns the local tensor: there is nothing to gather)",
}


class ShardGradients:
    """codec.py's gradient process, on each rank's local shards (its own random stream)."""

    def __init__(self, params: list[torch.nn.Parameter], generator: torch.Generator, *, rho: float = 0.9) -> None:
        self.params = params
        self.generator = generator
        self.rho = rho
        self.scales = [1e-3 * math.exp(_normal(generator)) for _ in params]

    def step(self) -> None:
        for param, scale in zip(self.params, self.scales):
            s = scale * math.exp(0.5 * _normal(self.generator))
            if param.grad is None:
                param.grad = torch.zeros_like(param)
                decay, amount = 0.0, s
            else:
                decay, amount = self.rho, math.sqrt(1.0 - self.rho**2) * s
            local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            if local.numel():
                local.mul_(decay).add_(torch.randn(local.shape, generator=self.generator), alpha=amount)


def worker(rank: int, world: int, args: argparse.Namespace, init_file: str, bucket: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from deltasync import DeltaPublisher, DeltaReceiver, fingerprint
    from deltasync.trainer.detector import named_parameters

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
    )
    try:
        shape = ModelShape().scaled(args.scale)
        model = build_model(shape, torch.Generator().manual_seed(args.seed))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        named = list(named_parameters(model))
        params = [p for _, p in named]
        total = sum(p.numel() for p in params)
        optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
        grads = ShardGradients(params, torch.Generator().manual_seed(args.seed * 1000 + rank))
        for _ in range(args.warmup):
            grads.step()
            optimizer.step()
        pub = DeltaPublisher(bucket, model, optimizer, anchor_every=10**6, anchor_bytes_ratio=0)
        timers = {"detect": 0.0, "write": 0.0}
        changes, write = pub.detector.changes, pub.store.write_stream

        def timed_changes() -> Any:
            t0 = time.perf_counter()
            try:
                return changes()
            finally:
                timers["detect"] += time.perf_counter() - t0

        def timed_write(path: str, chunks: Any) -> None:  # every write of a local bucket (its write_bytes too)
            t0 = time.perf_counter()
            try:
                write(path, chunks)
            finally:
                timers["write"] += time.perf_counter() - t0

        pub.detector.changes = timed_changes  # type: ignore[method-assign]
        pub.store.write_stream = timed_write  # type: ignore[method-assign]
        dist.barrier()
        t0 = time.perf_counter()
        anchor = pub.publish()
        anchor_s = time.perf_counter() - t0
        records = []
        full: dict[str, torch.Tensor] = {}
        for step in range(1, args.steps + 1):
            grads.step()
            optimizer.step()
            timers.update(detect=0.0, write=0.0)
            dist.barrier()
            t0 = time.perf_counter()
            result = pub.publish()
            publish_s = time.perf_counter() - t0
            detect_s, write_s = timers["detect"], timers["write"]
            dist.barrier()
            last = step == args.steps
            t0 = time.perf_counter()
            for name, param in named:  # TRL's _streaming_iter: one full parameter at a time
                tensor = param.full_tensor() if isinstance(param, DTensor) else param.detach()
                if last and rank == 0:
                    full[name] = tensor.to(torch.bfloat16)
                del tensor
            gather_s = time.perf_counter() - t0
            per_rank = pub.detector.layout.all_gather((publish_s, detect_s, write_s, gather_s))  # type: ignore[union-attr]
            rec = {
                "step": step,
                "kind": result.kind,
                "changed_pct": 100 * result.changed / result.total,
                "bytes_written": result.nbytes,
                "publish_s": [r[0] for r in per_rank],
                "detect_s": [r[1] for r in per_rank],
                "write_s": [r[2] for r in per_rank],
                "gather_s": [r[3] for r in per_rank],
            }
            records.append(rec)
            if rank == 0:
                print(
                    f"[{time.strftime('%H:%M:%S')}] W={world} step {step}/{args.steps}: {rec['changed_pct']:.2f}% changed, "
                    f"{result.nbytes / 1e6:.2f} MB, publish {max(rec['publish_s']):.3f}s, "
                    f"gather {max(rec['gather_s']):.3f}s",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
        snapshots = pub.detector.layout.all_gather(pub.detector.snapshot_bytes)  # type: ignore[union-attr]
        if rank == 0:
            receiver = DeltaReceiver(bucket)
            receiver.sync()
            got = receiver.state_dict()
            for name, want in full.items():
                if not torch.equal(got[name].view(torch.int16), want.view(torch.int16)):
                    raise SystemExit(f"FAIL: W={world}: the receiver's {name} is not the gathered model's")
            if receiver.fingerprint != fingerprint(full):
                raise SystemExit(f"FAIL: W={world}: fingerprint mismatch")
            Path(out).write_text(json.dumps({
                "world": world,
                "parameters": total,
                "anchor_bytes": anchor.nbytes,
                "anchor_s": anchor_s,
                "snapshot_bytes": snapshots,
                "records": records,
                "verified_fingerprint": receiver.fingerprint,
            }))  # fmt: skip
        pub.close()
    finally:
        dist.destroy_process_group()


def _median(values: list[float]) -> float:
    return statistics.median(values)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.multiprocessing as mp

    results = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory(prefix="deltasync-sharded-bench-") as tmp:
            out = os.path.join(tmp, "result.json")
            t0 = time.perf_counter()
            mp.spawn(worker, args=(world, args, os.path.join(tmp, "init"), os.path.join(tmp, "bucket"), out), nprocs=world)
            res = json.loads(Path(out).read_text())
            print(f"[{time.strftime('%H:%M:%S')}] W={world}: done in {time.perf_counter() - t0:.0f}s, verified "
                  f"fingerprint {res['verified_fingerprint']}", file=sys.stderr, flush=True)  # fmt: skip
            results.append(res)
    single = 2 * results[0]["parameters"]  # a single process keeps 2 bytes per element
    rows = []
    for res in results:
        recs = res["records"]
        w = res["world"]
        row = {
            "world": w,
            "snapshot_bytes_per_rank": max(res["snapshot_bytes"]),
            "snapshot_ratio": max(res["snapshot_bytes"]) * w / single,
            "publish_s": _median([max(r["publish_s"]) for r in recs]),
            "detect_s": _median([max(r["detect_s"]) for r in recs]),
            "write_s": _median([max(r["write_s"]) for r in recs]),
            "gather_s": _median([max(r["gather_s"]) for r in recs]),
            "bytes_written": _median([r["bytes_written"] for r in recs]),
            "changed_pct": _median([r["changed_pct"] for r in recs]),
            "anchor_bytes": res["anchor_bytes"],
        }
        row["publish_vs_gather"] = row["publish_s"] / row["gather_s"]
        rows.append(row)
    return {
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "machine": machine(),
        "parameters": results[0]["parameters"],
        "rows": rows,
        "runs": results,
        "targets": {
            "snapshot_ratio": all(abs(r["snapshot_ratio"] - 1) < 0.01 for r in rows),
            "publish_vs_gather": all(r["publish_vs_gather"] < 1 for r in rows if r["world"] > 1),
        },
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"Qwen2.5-0.5B shapes at scale {result['config']['scale']} ({result['parameters'] / 1e6:.1f}M parameters), "
        f"medians over {result['config']['steps']} steps:",
        "",
        "| W | per-rank snapshot | x W / single process | publish s (slowest rank) | of which detect / write | "
        "full_tensor() gather s (TRL) | publish / gather | bytes written per version | changed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['world']} | {r['snapshot_bytes_per_rank'] / 1e6:.1f} MB | {r['snapshot_ratio']:.3f} | "
            f"{r['publish_s']:.3f} | {r['detect_s']:.3f} / {r['write_s']:.3f} | {r['gather_s']:.3f} | "
            + (f"**{r['publish_vs_gather']:.2f}**" if r["world"] > 1 else "n/a (nothing to gather)")
            + f" | {r['bytes_written'] / 1e6:.2f} MB | {r['changed_pct']:.2f}% |"
        )
    t = result["targets"]
    lines += [
        "",
        f"Targets: snapshot bytes per rank = 1/W of a single process's: {'met' if t['snapshot_ratio'] else 'NOT met'}; "
        f"sharded publish faster than the gather alone at every W >= 2: {'met' if t['publish_vs_gather'] else 'NOT met'}.",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    worlds = [str(r["world"]) for r in rows]
    x = range(len(rows))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar([i - 0.2 for i in x], [r["publish_s"] for r in rows], 0.4, label="deltasync publish (slowest rank)")
    ax1.bar([i + 0.2 for i in x], [r["gather_s"] for r in rows], 0.4, label="full_tensor() gather (TRL)")
    ax1.set_xticks(list(x), worlds)
    ax1.set_xlabel("ranks (W)")
    ax1.set_ylabel("seconds per sync (median)")
    ax1.legend()
    ax2.bar(list(x), [r["snapshot_bytes_per_rank"] / 1e6 for r in rows], 0.5, color="tab:green")
    ax2.set_xticks(list(x), worlds)
    ax2.set_xlabel("ranks (W)")
    ax2.set_ylabel("bf16 snapshot per rank (MB)")
    fig.suptitle(
        f"deltasync sharded publish: Qwen2.5-0.5B shapes x{result['config']['scale']} "
        f"({result['parameters'] / 1e6:.0f}M params), FSDP2 on gloo/CPU"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per world size (default 6)")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps before the anchor (default 3)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g})")
    parser.add_argument("--scale", type=float, default=0.1, help="fraction of layers and vocabulary (default 0.1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--plot", help="write a plot (PNG) to this file")
    args = parser.parse_args(argv)
    if args.worlds[0] != 1:
        parser.error("the first world size must be 1: it is the single-process reference")
    if args.steps < 1 or args.warmup < 0 or not 0 < args.scale <= 1:
        parser.error("--steps >= 1, --warmup >= 0 and --scale in (0, 1] please")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
