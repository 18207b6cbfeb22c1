"""What bounds an in-place delta's write on this machine: memory or instructions, one core or more.

``benchmarks/server.py`` measures the write floor: one ``scatter_`` of a delta's int16 values
at sorted random positions of a buffer the size of the model, on one thread. This script asks
two questions of that floor, with the same buffer size and count (no vLLM needed, ~1 minute):

- **memory or instructions?** the same scatter into a buffer a thousandth the size, which
  stays in cache;
- **would more cores change the ratio to an anchor?** the scatter and a dense copy of the
  whole buffer (what an anchor's load does), each on one thread and split over two threads.

Usage (from the repository root)::

    .venv/bin/python benchmarks/write_floor.py                   # 0.67 GiB, 1% changed
    .venv/bin/python benchmarks/write_floor.py --density 0.005 --out floor.json
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _machine import machine

# The bf16 bytes of benchmarks/server.py's ~0.36B Qwen2-shaped model.
MODEL_BYTES = 716_745_928


def best(run: Callable[[], object], before: Callable[[], object], repeats: int = 3) -> float:
    """Fastest of ``repeats`` timed calls of ``run``, each after an untimed ``before``."""
    times = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def on_two_threads(work: Callable[[slice], object], n: int) -> Callable[[], None]:
    """``work`` over the halves ``[:n//2]`` and ``[n//2:]`` at once, in two threads (torch
    releases the GIL in its kernels; a 1-D ``scatter_`` is not parallel by itself)."""

    def run() -> None:
        half = n // 2
        other = threading.Thread(target=work, args=(slice(0, half),))
        other.start()
        work(slice(half, n))
        other.join()

    return run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=MODEL_BYTES, help="buffer size (default: the benchmark model's bf16 bytes)")
    parser.add_argument("--density", type=float, default=0.01, help="share of elements written (default 0.01)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.bytes < 2_000_000 or not 0 < args.density <= 0.5:
        parser.error("--bytes must be at least 2000000 and --density in (0, 0.5]")

    torch.set_num_threads(1)
    n = args.bytes // 2
    flat = torch.ones(n, dtype=torch.int16)  # touched: no page faults in the timings
    source = torch.full_like(flat, 2)
    small = torch.ones(n // 1000, dtype=torch.int16)
    gen = torch.Generator().manual_seed(args.seed)
    index = torch.unique(torch.randint(0, n, (int(n * args.density),), generator=gen))
    values = torch.full((index.numel(),), 3, dtype=torch.int16)
    small_index = torch.sort(torch.randint(0, small.numel(), (index.numel(),), generator=gen)).values
    k = index.numel()

    def evict() -> None:  # a pass over the buffers, so that no run finds the last one's lines in cache
        flat.copy_(source)

    print(f"buffer {args.bytes / 2**30:.2f} GiB, {k} values written ({k / n:.2%})", file=sys.stderr)
    figures = {
        "scatter_s": best(lambda: flat.scatter_(0, index, values), evict),
        "scatter_in_cache_s": best(lambda: small.scatter_(0, small_index, values), evict),
        "scatter_two_threads_s": best(
            on_two_threads(lambda part: flat.scatter_(0, index[part], values[part]), k), evict
        ),
        "copy_s": best(lambda: flat.copy_(source), evict),
        "copy_two_threads_s": best(on_two_threads(lambda part: flat[part].copy_(source[part]), n), evict),
    }
    ratios = {
        "in_cache_vs_memory": figures["scatter_in_cache_s"] / figures["scatter_s"],
        "scatter_two_vs_one_thread": figures["scatter_two_threads_s"] / figures["scatter_s"],
        "copy_two_vs_one_thread": figures["copy_two_threads_s"] / figures["copy_s"],
        "scatter_vs_copy_one_thread": figures["scatter_s"] / figures["copy_s"],
        "scatter_vs_copy_two_threads": figures["scatter_two_threads_s"] / figures["copy_two_threads_s"],
    }
    print("| what | one thread | two threads |\n|---|---:|---:|")
    print(f"| scatter_ of {k} values into the buffer | {figures['scatter_s']:.4f} s | {figures['scatter_two_threads_s']:.4f} s |")
    print(f"| the same into a buffer 1/1000 the size (in cache) | {figures['scatter_in_cache_s']:.4f} s | - |")
    print(f"| dense copy of the buffer | {figures['copy_s']:.4f} s | {figures['copy_two_threads_s']:.4f} s |")
    print(f"| scatter / copy | {ratios['scatter_vs_copy_one_thread']:.0%} | {ratios['scatter_vs_copy_two_threads']:.0%} |")
    if args.out:
        args.out.write_text(json.dumps({"machine": machine(), "bytes": args.bytes, "written": k, **figures, **ratios}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
