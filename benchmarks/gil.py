"""Background work beside a busy Python thread: what sharing the interpreter costs each side.

A publisher's version (its capture, encode and commit) and a rollout server's stage run in
threads of the process they serve: the trainer's, or vLLM's worker. Those threads take turns
holding CPython's global interpreter lock (the GIL) with the process's own. Each NumPy, torch,
zstd or file call of deltasync's releases it while it runs, and must take it back after. A
thread that runs Python bytecode all the time gives it up only when asked, once per *switch
interval* (``sys.getswitchinterval()``, 5 ms by default), so every one of those calls can wait
that long to come back.

This script runs each of them, on one core, beside a *neighbor* thread on another core:

- ``none``: no neighbor (the baseline);
- ``python``: a loop of pure Python bytecode (a reward function, a tokenizer written in Python,
  data collation);
- ``torch``: a loop of small torch operations (a training loop launching GPU kernels: every
  call releases the GIL for a few microseconds).

For each switch interval it reports the work's time against the same interval's baseline, and
what the work took from the neighbor: its steps per second during the work against the same
neighbor's just before it, alone, and its longest wait. Rounds are interleaved and the medians reported; every version is checked
against its fingerprint, every stage against the bucket's.

    python benchmarks/gil.py --out gil.json --plot gil.png

Run it alone: it measures two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
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

NEIGHBORS = ("none", "python", "torch")
WORKS = ("publish", "stage")


def log(message: str) -> None:
    print(f"[gil.py {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Neighbor(threading.Thread):
    """A thread on core ``cpu`` that counts steps of ``kind`` until stopped, and keeps the
    longest time between two of its steps."""

    def __init__(self, kind: str, cpu: int) -> None:
        super().__init__(daemon=True, name=f"neighbor-{kind}")
        self.kind, self.cpu = kind, cpu
        self.steps = 0
        self.longest = 0.0
        self.halt = threading.Event()
        self.started_at = threading.Event()

    def run(self) -> None:
        os.sched_setaffinity(0, {self.cpu})  # this thread only
        a = torch.zeros(16)
        python = self.kind == "python"
        last = time.perf_counter()
        self.started_at.set()
        while not self.halt.is_set():
            if python:
                x = 0
                for i in range(64):  # about 2 microseconds of bytecode
                    x += i
            else:
                a.add_(1)
            self.steps += 1
            now = time.perf_counter()
            if now - last > self.longest:
                self.longest = now - last
            last = now

    def __enter__(self) -> Neighbor:
        self.start()
        self.started_at.wait()
        time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.join()


def beside(work: Callable[[], None], kind: str, cpu: int, alone_s: float = 0.2) -> dict[str, float]:
    """``work`` timed with a ``kind`` neighbor on ``cpu`` (none: alone). The neighbor's steps per
    second are counted over ``alone_s`` with this thread asleep, then over the work."""
    if kind == "none":
        t = time.perf_counter()
        work()
        return {"seconds": time.perf_counter() - t}
    with Neighbor(kind, cpu) as n:
        s0, t0 = n.steps, time.perf_counter()
        time.sleep(alone_s)
        s1, t1 = n.steps, time.perf_counter()
        n.longest = 0.0
        work()
        s2, t2 = n.steps, time.perf_counter()
        longest = n.longest
    return {"seconds": t2 - t1, "neighbor_rate": (s2 - s1) / (t2 - t1), "neighbor_alone_rate": (s1 - s0) / (t1 - t0),
            "neighbor_longest_s": longest}  # fmt: skip


def run(tensors: int, elements: int, share: float, rounds: int, intervals: list[float], folder: str | None,
        sliced: bool = False) -> dict[str, Any]:  # fmt: skip
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("gil.py needs two CPUs: one for the work, one for its neighbor")
    work_cpu, neighbor_cpu = cpus[0], cpus[1]
    saved_interval = sys.getswitchinterval()
    saved_affinity = set(cpus)
    saved_threads = torch.get_num_threads()
    saved_env = {k: os.environ.get(k) for k in ("DELTASYNC_ENCODE_THREADS", "DELTASYNC_DECODE_THREADS")}
    os.sched_setaffinity(0, {work_cpu})  # the work's threads (this one and those it starts) share one core
    torch.set_num_threads(1)
    for k in saved_env:
        os.environ[k] = "1"
    step = max(1, round(1 / share))
    torch.manual_seed(0)
    start = {f"layers.{k}.weight": torch.randn(elements).to(torch.bfloat16).reshape(256, -1) for k in range(tensors)}
    results: dict[str, Any] = {w: {} for w in WORKS}
    exact = True
    try:
        with tempfile.TemporaryDirectory(prefix="deltasync-gil-", dir=folder) as root:
            trainer = Weights({n: t.clone() for n, t in start.items()}, trainable=True)
            version = [0]

            def bump() -> None:  # one ULP on every ``step``-th element, a different one each version
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.view(-1).view(torch.int16)[version[0] % step :: step] += 1

            with DeltaPublisher(root, trainer, None, anchor_every=1000, anchor_bytes_ratio=0) as publisher:
                publisher.detector.sliced = sliced  # the compare a GPU's weights get, on the CPU
                publisher.publish()
                bump()
                first = publisher.publish()
                version[0] = first.version
                store = LocalStore(root)
                pointer = read_pointer(store)
                live_model = Weights({n: t.clone() for n, t in start.items()})
                shapes = {n: tuple(t.shape) for n, t in start.items()}
                live = InPlaceState(live_model, discover(live_model, shapes), lambda obj: [obj], 0,
                                    live_model.load_weights)  # fmt: skip
                live.commit(0, live.full_fingerprint())
                changed = {"publish": first.changed, "stage": 0}

                def publish() -> None:
                    nonlocal exact
                    result = publisher.publish()
                    version[0] = result.version
                    exact &= result.fingerprint == publisher.fingerprint and result.changed > 0

                def stage() -> None:
                    nonlocal exact
                    staged = live.stage_deltas(ChainReader(store, pointer), 1)
                    changed["stage"] = staged.changed
                    exact &= live.check_chain(staged, [staged.shares]) == first.fingerprint

                works = {"publish": publish, "stage": stage}
                for interval in intervals:
                    sys.setswitchinterval(interval)
                    runs: dict[str, dict[str, list[dict[str, float]]]] = {w: {k: [] for k in NEIGHBORS} for w in WORKS}
                    for r in range(rounds + 1):  # the first round warms up
                        for kind in NEIGHBORS:
                            for name, work in works.items():
                                if name == "publish":
                                    bump()
                                got = beside(work, kind, neighbor_cpu)
                                if r:
                                    runs[name][kind].append(got)
                    for name in WORKS:
                        base = statistics.median(g["seconds"] for g in runs[name]["none"])
                        row: dict[str, Any] = {}
                        for kind in NEIGHBORS:
                            got = runs[name][kind]
                            entry: dict[str, Any] = {
                                "seconds": statistics.median(g["seconds"] for g in got),
                                "seconds_all": [g["seconds"] for g in got],
                            }
                            entry["over_alone"] = entry["seconds"] / base
                            if kind != "none":
                                rate = statistics.median(g["neighbor_rate"] for g in got)
                                alone = statistics.median(g["neighbor_alone_rate"] for g in got)
                                entry.update(
                                    neighbor_rate=rate, neighbor_alone_rate=alone, neighbor_lost=1 - rate / alone,
                                    neighbor_longest_s=max(g["neighbor_longest_s"] for g in got),
                                )  # fmt: skip
                            row[kind] = entry
                        results[name][f"{interval:g}"] = row
                        log(f"switch interval {interval * 1e3:g} ms, {name} ({changed[name]:,} changes): alone "
                            f"{row['none']['seconds']:.3f} s; " + "; ".join(
                                f"beside {k}: {row[k]['seconds']:.3f} s ({row[k]['over_alone']:.1f}x), the neighbor "
                                f"lost {row[k]['neighbor_lost']:.0%}, waited at most {row[k]['neighbor_longest_s'] * 1e3:.1f} ms"
                                for k in NEIGHBORS if k != "none"))  # fmt: skip
    finally:
        sys.setswitchinterval(saved_interval)
        os.sched_setaffinity(0, saved_affinity)
        torch.set_num_threads(saved_threads)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return {
        "machine": machine(), "package": str(Path(deltasync.__file__).resolve().parent), "tensors": tensors,
        "elements": elements, "changed": changed, "rounds": rounds, "intervals": intervals, "sliced": sliced, "exact": exact,
        "results": results,
    }  # fmt: skip


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    intervals = [f"{i:g}" for i in r["intervals"]]
    width = 0.35
    for ax, name in zip(axes, WORKS):
        rows = r["results"][name]
        for j, kind in enumerate(k for k in NEIGHBORS if k != "none"):
            xs = [i + (j - 0.5) * width for i in range(len(intervals))]
            ys = [rows[i][kind]["over_alone"] for i in intervals]
            bars = ax.bar(xs, ys, width, label=f"beside {kind}")
            for b, row in zip(bars, (rows[i][kind] for i in intervals)):
                ax.annotate(f"{b.get_height():.1f}x\nlost {row['neighbor_lost']:.0%}", (b.get_x() + width / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.set_xticks(range(len(intervals)), [f"{float(i) * 1e3:g} ms" for i in intervals])
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("sys.setswitchinterval")
        ax.set_ylabel("time / the same work alone")
        ax.set_title(f"{name} ({r['changed'][name]:,} changes)")
        ax.legend(fontsize=8)
    fig.suptitle("deltasync's background work beside a busy thread (the neighbor's loss under each bar)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=24, help="bf16 tensors (default 24)")
    parser.add_argument("--elements", type=int, default=1 << 20, help="elements per tensor (default 1M)")
    parser.add_argument("--share", type=float, default=0.02, help="share of the elements changed per version (default 0.02)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds after a warm-up one (default 2)")
    parser.add_argument("--intervals", default="0.005,0.001,0.0002", help="switch intervals in seconds (default 5, 1, 0.2 ms)")
    parser.add_argument("--sliced", action="store_true", help="publish with the compare a GPU's weights get (slices)")
    parser.add_argument("--bucket", default=None, help="folder for the temporary bucket (default: the system's)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="draw the slowdowns here (needs matplotlib)")
    parser.add_argument("--plot-from", help="only draw --plot from this JSON")
    args = parser.parse_args()
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text()), args.plot)
        return
    log(f"deltasync from {Path(deltasync.__file__).resolve().parent}")
    intervals = [float(x) for x in args.intervals.split(",")]
    result = run(args.tensors, args.elements, args.share, args.rounds, intervals, args.bucket, args.sliced)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)
    if not result["exact"]:
        raise SystemExit("a version or a stage did not reach its fingerprint")


if __name__ == "__main__":
    main()
