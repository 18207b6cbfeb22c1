"""Host memory of a publishing rank, and of a receiver staging an anchor (FSDP2 on gloo, CPU).

For each world size W the script starts W gloo processes. Each builds a stack of
``--layers`` x ``Linear(--width, --width, bias=False)`` on the meta device, shards it with
``fully_shard`` over a 1-D mesh of W ranks (as ``benchmarks/sharded.py`` does), allocates its
local shards and fills them with N(0, 0.02^2). A "training step" moves ``--density`` of each
rank's local elements by a relative 2^-6 (enough to change their bf16 rounding), in place.

After one such step (so that its temporaries are already in the allocator) every rank reads
its resident set size (RSS, ``/proc/self/statm``) as its baseline and starts a thread that
samples it every ``--interval`` seconds. It then builds a :class:`~deltasync.DeltaPublisher`
into a local bucket (``anchor_every=--anchor-every``, ``anchor_bytes_ratio=0``) and publishes
``--deltas`` versions after the first: the first version and version ``--anchor-every`` have
anchors, so the default 10 deltas with ``--anchor-every 6`` write 2 anchors and 10 deltas.
``publish()`` then ``flush()`` (where the publisher has it) per version; ``close()`` at the
end. The peak RSS growth over the baseline is reported against the rank's bf16 bytes
(2 x its local elements), as is what is still resident after ``close()``.

Then a fresh process (a new interpreter: nothing of the publisher's allocator) reads its
baseline RSS after importing torch and deltasync and calls ``DeltaReceiver.stage(V)`` on the
bucket, V the newest anchor's version: the anchor alone. A second fresh process stages the
newest version (that anchor and the deltas after it). Each peak growth is reported against the
model's bf16 bytes. The staged fingerprint must equal the publisher's last one.

``--compare REF ...`` runs the same with the ``deltasync`` package of each git revision REF
(exported with ``git archive`` into a temporary directory; e.g. ``5f2f7dd``, the publisher
before background publishing), or of a directory that holds a ``deltasync`` package (a
patched copy).

Run from the repository root: ``python benchmarks/memory.py``; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")
TARGETS = {
    "publisher": ("publisher peak RSS growth / the rank's bf16 bytes, every W", 1.3),
    "receiver": ("receiver peak RSS growth while staging the anchor alone / the model's bf16 bytes, every W", 1.3),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Sampler:
    """Samples this process's RSS every ``interval`` seconds in a thread; keeps the peak."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.baseline = rss()
        self.peak = self.baseline
        self.peak_at = 0.0
        self.trace: list[tuple[float, int]] = []
        self.samples = 0
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = -1.0
        while not self._stop.is_set():
            value = rss()
            self.samples += 1
            now = time.perf_counter() - self._t0
            if value > self.peak:
                self.peak, self.peak_at = value, now
            if now - last >= 0.05:  # the plot needs far fewer points than the peak does
                self.trace.append((now, value - self.baseline))
                last = now
            time.sleep(self.interval)

    def mark(self) -> float:
        return time.perf_counter() - self._t0

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        value = rss()
        if value > self.peak:
            self.peak, self.peak_at = value, time.perf_counter() - self._t0
        return self.peak - self.baseline


def _use_package(package: str | None) -> None:
    sys.path.insert(0, package or str(ROOT))


def worker(rank: int, world: int, args: argparse.Namespace, package: str | None, init_file: str, bucket: str, out: str) -> None:
    _use_package(package)
    import gc

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from deltasync import DeltaPublisher

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=30)
    )
    try:
        with torch.device("meta"):
            model = nn.Sequential(*(nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)))
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
        locals_ = [p.to_local() for p in model.parameters()]
        with torch.no_grad():
            for local in locals_:
                local.normal_(0.0, 0.02, generator=generator)
        local_elements = sum(t.numel() for t in locals_)

        def step() -> None:
            with torch.no_grad():
                for local in locals_:
                    flat = local.view(-1)
                    if flat.numel():
                        index = torch.randint(0, flat.numel(), (max(1, int(flat.numel() * args.density)),), generator=generator)
                        flat[index] *= 1 + 2**-6

        step()
        gc.collect()
        dist.barrier()
        sampler = Sampler(args.interval)
        marks: list[tuple[str, float]] = []
        pub = DeltaPublisher(bucket, model, None, anchor_every=args.anchor_every, anchor_bytes_ratio=0)
        flush = getattr(pub, "flush", lambda: None)
        marks.append(("built", sampler.mark()))
        kinds = []
        for version in range(args.deltas + 1):
            if version:
                step()
            result = pub.publish()
            flush()
            kinds.append(result.kind + ("+anchor" if getattr(result, "anchor_scheduled", False) else ""))
            marks.append((f"v{version} {kinds[-1]}", sampler.mark()))
        fp = pub.fingerprint
        peak_before_close = max(sampler.peak, rss()) - sampler.baseline
        pub.close()
        del pub, flush
        gc.collect()
        retained = rss() - sampler.baseline  # what the allocator kept once the publisher is gone
        growth = sampler.stop()
        marks.append(("closed", sampler.mark()))
        # The phase the peak fell in: the first mark at or after it ends that phase.
        phase = next((name for name, t in marks if t >= sampler.peak_at), "closed")
        rec = {
            "rank": rank,
            "local_elements": local_elements,
            "bf16_bytes": 2 * local_elements,
            "baseline_rss": sampler.baseline,
            "peak_growth": growth,
            "peak_growth_before_close": peak_before_close,
            "peak_phase": phase,
            "peak_at": sampler.peak_at,
            "retained_after_close": retained,
            "ratio": growth / (2 * local_elements),
            "samples": sampler.samples,
            "seconds": sampler.mark(),
            "kinds": kinds,
            "marks": marks,
            "trace": sampler.trace,
        }
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, rec)
        if rank == 0:
            Path(out).write_text(json.dumps({"world": world, "ranks": gathered, "fingerprint": fp}))
    finally:
        dist.destroy_process_group()


def receiver_main(package: str | None, bucket: str, interval: float, out: str, anchor_only: bool) -> None:
    """In a fresh interpreter: the peak RSS growth of ``DeltaReceiver.stage()`` on ``bucket``:
    of the newest anchor alone, or (``anchor_only`` false) of the newest version, which replays
    the deltas after that anchor too."""
    _use_package(package)
    import torch

    from deltasync import DeltaReceiver

    torch.set_num_threads(1)
    receiver = DeltaReceiver(bucket)
    pointer = receiver.pointer()
    # Format 3 pointers list the anchors beside the deltas; older ones name one anchor.
    newest_anchor = pointer.anchors[-1].version if hasattr(pointer, "anchors") else pointer.anchor
    target = newest_anchor if anchor_only else None
    sampler = Sampler(interval)
    t0 = time.perf_counter()
    staged = receiver.stage(target)
    seconds = time.perf_counter() - t0
    growth = sampler.stop()
    elements = sum(staged.tensor(n).numel() for n in staged.names) if staged.kind == "anchor" else None
    Path(out).write_text(json.dumps({
        "peak_growth": growth, "kind": staged.kind, "version": staged.version, "fingerprint": staged.fingerprint,
        "nbytes": staged.nbytes, "elements": elements, "seconds": seconds, "samples": sampler.samples,
        "versions": staged.versions, "newest": pointer.version,
        "trace": sampler.trace,
    }))  # fmt: skip


def run_world(args: argparse.Namespace, world: int, package: str | None, tmp: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    bucket = os.path.join(tmp, f"bucket-w{world}")
    out = os.path.join(tmp, f"w{world}.json")
    t0 = time.perf_counter()
    mp.spawn(worker, args=(world, args, package, os.path.join(tmp, f"init-w{world}"), bucket, out), nprocs=world)
    res = json.loads(Path(out).read_text())
    ranks = res["ranks"]
    log(f"W={world}: publisher peak growth per rank "
        + ", ".join(f"{r['peak_growth'] / 2**20:.0f} MiB ({r['ratio']:.2f}x)" for r in ranks)
        + f"; {time.perf_counter() - t0:.0f}s")  # fmt: skip
    model_bf16 = 2 * sum(r["local_elements"] for r in ranks)
    received = {}
    for mode in ("anchor", "newest"):
        rec_out = os.path.join(tmp, f"recv-w{world}-{mode}.json")
        subprocess.run(
            [sys.executable, __file__, "--receiver", bucket, rec_out, "--interval", str(args.interval)]
            + (["--anchor-only"] if mode == "anchor" else []) + (["--package", package] if package else []),
            check=True,
        )
        recv = json.loads(Path(rec_out).read_text())
        if mode == "newest" and recv["fingerprint"] != res["fingerprint"]:
            raise SystemExit(f"FAIL: W={world}: the receiver staged {recv['fingerprint']}, the publisher wrote {res['fingerprint']}")
        recv["bf16_bytes"] = model_bf16
        recv["ratio"] = recv["peak_growth"] / model_bf16
        received[mode] = recv
        log(f"W={world}: receiver staging {'the anchor alone' if mode == 'anchor' else 'the newest version'} "
            f"(versions {recv['versions']}): peak growth {recv['peak_growth'] / 2**20:.0f} MiB "
            f"({recv['ratio']:.2f}x the model's bf16)")  # fmt: skip
    return {
        "world": world,
        "ranks": ranks,
        "max_ratio": max(r["ratio"] for r in ranks),
        "receiver": received["anchor"],
        "receiver_newest": received["newest"],
    }


def package_of(ref: str, tmp: str) -> str:
    """A directory holding the ``deltasync`` package of ``ref``: a git revision (exported), or a
    directory that already holds one (a patched copy, say)."""
    if os.path.isdir(os.path.join(ref, "deltasync")):
        return os.path.abspath(ref)
    dest = tempfile.mkdtemp(prefix="pkg-", dir=tmp)
    return export_package(ref, dest)


def export_package(ref: str, dest: str) -> str:
    """The ``deltasync`` package of git revision ``ref``, exported into ``dest``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "deltasync"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="deltasync-memory-bench-", dir=args.workdir) as tmp:
        variants: list[tuple[str, str | None]] = [("current", None)]
        for ref in args.compare:
            variants.append((os.path.basename(ref.rstrip("/")) if os.path.isdir(ref) else ref, package_of(ref, tmp)))
        for name, package in variants:
            log(f"--- {name} deltasync ({package or ROOT})")
            runs[name] = []
            for world in args.worlds:
                with tempfile.TemporaryDirectory(dir=tmp) as sub:
                    runs[name].append(run_world(args, world, package, sub))
    current = runs["current"]
    targets = [
        {"key": "publisher", "label": TARGETS["publisher"][0], "bound": TARGETS["publisher"][1],
         "value": max(w["max_ratio"] for w in current)},
        {"key": "receiver", "label": TARGETS["receiver"][0], "bound": TARGETS["receiver"][1],
         "value": max(w["receiver"]["ratio"] for w in current)},
    ]  # fmt: skip
    for t in targets:
        t["met"] = t["value"] <= t["bound"]
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _machine import machine

    return {
        "benchmark": "deltasync memory",
        "command": " ".join(["python", "benchmarks/memory.py", *args.argv]),
        "head": git,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "argv", "receiver", "package", "workdir", "anchor_only")},
        "model": {"layers": args.layers, "width": args.width, "parameters": args.layers * args.width**2,
                  "bf16_bytes": 2 * args.layers * args.width**2},  # fmt: skip
        "machine": machine(),
        "runs": runs,
        "targets": targets,
    }


def table(result: dict[str, Any]) -> str:
    m = result["model"]
    lines = [
        f"{m['layers']} x Linear({m['width']}, {m['width']}): {m['parameters'] / 1e6:.0f}M parameters, "
        f"{m['bf16_bytes'] / 2**20:.0f} MiB in bf16; peak RSS growth sampled every {result['config']['interval'] * 1e3:g} ms.",
        "",
        "| deltasync | W | rank bf16 | publisher peak growth per rank (max) | / rank bf16 (max) | peak during "
        "| retained after close + del (max) | receiver, the anchor alone: peak growth | / model bf16 "
        "| receiver, anchor + deltas after it | / model bf16 |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, worlds in result["runs"].items():
        for w in worlds:
            ranks = w["ranks"]
            r, n = w["receiver"], w["receiver_newest"]
            worst = max(ranks, key=lambda x: x["ratio"])
            lines.append(
                f"| {name} | {w['world']} | {max(x['bf16_bytes'] for x in ranks) / 2**20:.0f} MiB | "
                f"{max(x['peak_growth'] for x in ranks) / 2**20:.0f} MiB | **{w['max_ratio']:.2f}x** | {worst['peak_phase']} | "
                f"{max(x['retained_after_close'] for x in ranks) / 2**20:.0f} MiB | {r['peak_growth'] / 2**20:.0f} MiB | "
                f"**{r['ratio']:.2f}x** | {n['peak_growth'] / 2**20:.0f} MiB | {n['ratio']:.2f}x |"
            )
    lines += ["", "| target | measured (worst W) | bound | met |", "|---|---:|---:|---|"]
    for t in result["targets"]:
        lines.append(f"| {t['label']} | {t['value']:.2f} | <= {t['bound']} | {'PASS' if t['met'] else 'FAIL'} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["runs"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.5), squeeze=False, sharey=True)
    for ax, name in zip(axes[0], names):
        for w in result["runs"][name]:
            rank0 = w["ranks"][0]
            t = [p[0] for p in rank0["trace"]]
            y = [p[1] / rank0["bf16_bytes"] for p in rank0["trace"]]
            ax.plot(t, y, label=f"W={w['world']} (rank 0, bf16 {rank0['bf16_bytes'] / 2**20:.0f} MiB)")
        ax.axhline(1.3, color="k", linestyle="--", label="target 1.3x")
        ax.set_title(f"deltasync {name}: publisher RSS growth")
        ax.set_xlabel("seconds since the baseline (publisher built, 2 anchors, deltas)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("RSS growth / the rank's bf16 bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="world sizes (default 1 2 4)")
    parser.add_argument("--layers", type=int, default=16, help="Linear layers (default 16)")
    parser.add_argument("--width", type=int, default=4096, help="their width (default 4096: 16 x 4096^2 = 268M, 512 MiB bf16)")
    parser.add_argument("--deltas", type=int, default=10, help="versions after the first (default 10)")
    parser.add_argument("--anchor-every", type=int, default=6, help="anchor_every (default 6: anchors at 0 and 6)")
    parser.add_argument("--density", type=float, default=0.01, help="fraction of elements a step changes (default 0.01)")
    parser.add_argument("--interval", type=float, default=0.002, help="RSS sampling period, seconds (default 0.002)")
    parser.add_argument(
        "--compare", metavar="REF", nargs="*", default=[],
        help="also run the deltasync package of these git revisions (or directories holding a deltasync package)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where the buckets go (default: the system temp directory)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--plot", help="write a plot (PNG) to this file")
    parser.add_argument("--receiver", nargs=2, metavar=("BUCKET", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--package", help=argparse.SUPPRESS)
    parser.add_argument("--anchor-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.receiver:
        receiver_main(args.package, args.receiver[0], args.interval, args.receiver[1], args.anchor_only)
        return 0
    result = run(args)
    print(table(result))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from codec import save_outputs

    save_outputs(result, args.out, args.plot, plot)
    for t in result["targets"]:
        print(f"{'PASS' if t['met'] else 'FAIL'}: {t['label']}: {t['value']:.2f} (bound <= {t['bound']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
