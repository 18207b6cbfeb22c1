"""A CPU server's in-place stage of one delta: one decode thread against the host's cores.

A rollout server with weights in host memory stages each version in place: it decodes the delta,
reads the live values at its elements, and sums the fingerprint's move, before the write. This
script publishes a delta of ``--share`` of ``--tensors`` bf16 tensors of ``--elements`` elements
each into a local bucket, then times ``InPlaceState.stage_deltas`` on live CPU tensors with
``DELTASYNC_DECODE_THREADS=1`` and with the host's cores, in interleaved rounds (the first
dropped), and reports the medians; every stage is checked against the bucket's fingerprint.

To compare two commits, run it with each package on ``PYTHONPATH`` (it imports whichever
``deltasync`` comes first)::

    python benchmarks/stage.py --out now.json
    PYTHONPATH=/path/to/older/checkout python benchmarks/stage.py --out before.json

Run it alone: it measures the host's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

try:
    import deltasync
except ImportError:  # a checkout without an install: import the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import deltasync

from deltasync import DeltaPublisher
from deltasync.reader.chain import ChainReader, read_pointer
from deltasync.server.inplace import InPlaceState
from deltasync.server.weight_map import discover
from deltasync.stores import LocalStore

from _machine import machine
from scale import Weights  # bf16 parameters under checkpoint names, loadable as a server's model

VARIABLE = "DELTASYNC_DECODE_THREADS"


def log(message: str) -> None:
    print(f"[stage.py {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(tensors: int, elements: int, share: float, rounds: int, folder: str | None) -> dict[str, Any]:
    torch.manual_seed(0)
    start = {f"layers.{k}.weight": torch.randn(elements).to(torch.bfloat16).reshape(256, -1) for k in range(tensors)}
    saved = os.environ.get(VARIABLE)
    with tempfile.TemporaryDirectory(prefix="deltasync-stage-", dir=folder) as root:
        trainer = Weights({n: t.clone() for n, t in start.items()}, trainable=True)
        with DeltaPublisher(root, trainer, None, anchor_every=1000, anchor_bytes_ratio=0) as publisher:
            publisher.publish()
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for p in trainer.parameters():
                    bits = p.view(-1).view(torch.int16)
                    bits[torch.randperm(bits.numel(), generator=g)[: int(bits.numel() * share)]] += 1
            result = publisher.publish()
        store = LocalStore(root)
        pointer = read_pointer(store)
        live_model = Weights({n: t.clone() for n, t in start.items()})
        shapes = {n: tuple(t.shape) for n, t in start.items()}
        live = InPlaceState(live_model, discover(live_model, shapes), lambda obj: [obj], 0, live_model.load_weights)
        live.commit(0, live.full_fingerprint())
        times: dict[str, list[float]] = {"one_thread_s": [], "all_cores_s": []}
        exact = True
        try:
            for _ in range(rounds + 1):
                for label, threads in (("one_thread_s", "1"), ("all_cores_s", None)):
                    if threads is None:
                        os.environ.pop(VARIABLE, None)
                    else:
                        os.environ[VARIABLE] = threads
                    t = time.perf_counter()
                    staged = live.stage_deltas(ChainReader(store, pointer), 1)
                    times[label].append(time.perf_counter() - t)
                    exact &= live.check_chain(staged, [staged.shares]) == result.fingerprint
        finally:
            if saved is None:
                os.environ.pop(VARIABLE, None)
            else:
                os.environ[VARIABLE] = saved
    out: dict[str, Any] = {
        "machine": machine(), "package": str(Path(deltasync.__file__).resolve().parent), "tensors": tensors,
        "elements": elements, "changed": staged.changed, "rounds": rounds, "exact": exact,
    }  # fmt: skip
    for label, values in times.items():
        out[label] = statistics.median(values[1:])  # the first round warms up
        out[label + "_all"] = values
    out["all_cores_over_one_thread"] = out["all_cores_s"] / out["one_thread_s"]
    log(f"{staged.changed:,} changed: stage with one decode thread {out['one_thread_s']:.3f} s, with all cores "
        f"{out['all_cores_s']:.3f} s (ratio {out['all_cores_over_one_thread']:.2f}); exact: {exact}")  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=48, help="bf16 tensors (default 48)")
    parser.add_argument("--elements", type=int, default=1 << 21, help="elements per tensor (default 2M)")
    parser.add_argument("--share", type=float, default=1 / 6, help="share of the elements changed (default 1/6: 16.8M)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds after a warm-up one (default 5)")
    parser.add_argument("--bucket", default=None, help="folder for the temporary bucket (default: the system's)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    log(f"deltasync from {Path(deltasync.__file__).resolve().parent}")
    result = run(args.tensors, args.elements, args.share, args.rounds, args.bucket)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.out}")
    if not result["exact"]:
        raise SystemExit("a stage did not reach the bucket's fingerprint")


if __name__ == "__main__":
    main()
