"""A zstd delta's encode on this host: one thread against the host's cores, per changed element.

The publisher encodes every version's changes (int64 indices, old and new bf16 values) into the
zstd codec's byte streams and compresses each stream (docs/protocol.md). This script times
``ZstdCodec.encode_blobs`` (what a delta file is written from; ``encode`` in a checkout older
than it) on synthetic deltas of ``--changes`` elements spread over ``--tensors``
tensors (1 element in 70 changed, one- and two-ULP steps: what an RL step at ~1.4% writes), with
``DELTASYNC_ENCODE_THREADS=1`` and with the host's cores, in interleaved rounds, and reports the
medians, nanoseconds per changed element, and all cores / one thread.

To compare two commits, run it with each package on ``PYTHONPATH`` in the same session, one
after the other (it imports whichever ``deltasync`` comes first)::

    python benchmarks/encode.py --out benchmarks/results/encode-cpu.json
    PYTHONPATH=/path/to/older/checkout python benchmarks/encode.py --out before.json

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

from deltasync.format import Change
from deltasync.format.codecs.zstd import ZstdCodec, encode_threads

from _machine import machine

VARIABLE = "DELTASYNC_ENCODE_THREADS"


def log(message: str) -> None:
    print(f"[encode.py {time.strftime('%H:%M:%S')}] {message}", flush=True)


def spanning_delta(
    changes: int, tensors: int, *, weights: bool = True
) -> tuple[list[tuple[str, Change]], dict[str, torch.Tensor]]:
    """A delta of ``changes`` one- and two-ULP steps spread over ``tensors`` tensors (1 in 70
    elements changed: gaps drawn from 1 .. 139), and the weights it applies to (``weights=False``:
    none, for the encoder alone, which reads only the changes)."""
    g = torch.Generator().manual_seed(0)
    items, state = [], {}
    n = changes // tensors
    for k in range(tensors):
        index = torch.cumsum(torch.randint(1, 140, (n,), generator=g), 0) - 1
        if weights:
            state[f"w{k}"] = (torch.randn(int(index[-1]) + 1 + int(torch.randint(0, 70, (1,), generator=g)), generator=g) * 0.02).to(torch.bfloat16)
            old = state[f"w{k}"][index]
        else:
            old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        step = torch.randint(1, 3, (n,), dtype=torch.int16, generator=g)
        items.append((f"w{k}", Change(index=index, new=(old.view(torch.int16) + step).view(torch.bfloat16), old=old)))
    return items, state


def encode_once(items: list[tuple[str, Change]], threads: str | None) -> tuple[float, int]:
    if threads is None:
        os.environ.pop(VARIABLE, None)
    else:
        os.environ[VARIABLE] = threads
    codec = ZstdCodec()
    # What a delta file is written from (its streams' frames as zstandard returned them); a
    # checkout older than encode_blobs: encode, whose tensors the file was written from then.
    encode = getattr(codec, "encode_blobs", codec.encode)
    start = time.perf_counter()
    blobs = encode(items, numels=None, level=3)
    seconds = time.perf_counter() - start
    return seconds, sum(len(b) if isinstance(b, bytes) else b.numel() for key, b in blobs.items() if key != "zstd:counts")


def file_once(items: list[tuple[str, Change]], folder: str) -> float:
    """Seconds the publisher's writer takes to make one version's delta file, with the host's
    cores: its own ``write_delta_file`` (encode, a durable write into a local bucket, the file's
    SHA-256), in a fresh bucket under ``folder``, removed after."""
    import deltasync.format as F
    from deltasync.stores import LocalStore
    from deltasync.trainer.committer import ChainCommitter
    from deltasync.trainer.view_chain import _ONE_WRITER

    os.environ.pop(VARIABLE, None)
    changes = dict(items)
    count = sum(c.index.numel() for c in changes.values())
    kw = dict(version=1, anchor=0, codec="zstd", total=2**40, fingerprint="0" * 16, base_fingerprint="0" * 16, level=3)
    # What the writer encodes the file into: its pieces, or (a checkout older than them) its bytes.
    make = getattr(F, "delta_pieces", F.encode_delta)
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="deltasync-encode-", dir=folder) as root:
        writer = ChainCommitter(LocalStore(root), _ONE_WRITER, None)
        start = time.perf_counter()
        writer.write_delta_file(1, "0" * 16, lambda: (make(changes, **kw), count), None, check=False)
        return time.perf_counter() - start


def run(sizes: list[int], tensors: int, rounds: int, file_dir: str | None = None) -> dict[str, Any]:
    saved = os.environ.get(VARIABLE)
    out: dict[str, Any] = {
        "machine": machine(), "package": str(Path(deltasync.__file__).resolve().parent),
        "threads": encode_threads(), "tensors": tensors, "rounds": rounds, "sizes": [],
    }  # fmt: skip
    try:
        for changes in sizes:
            items, _ = spanning_delta(changes, tensors, weights=False)
            encode_once(items, "1")  # warm: first-touch pages, the pool
            times: dict[str, list[float]] = {"one_thread_s": [], "all_cores_s": []}
            files: list[float] = []
            nbytes = set()
            for _ in range(rounds):
                for label, threads in (("one_thread_s", "1"), ("all_cores_s", None)):
                    seconds, size = encode_once(items, threads)
                    times[label].append(seconds)
                    nbytes.add(size)
                if file_dir is not None:
                    files.append(file_once(items, file_dir))
            row = {"changes": changes, "compressed_bytes": sorted(nbytes), "same_bytes": len(nbytes) == 1}
            for label, values in times.items():
                row[label] = statistics.median(values)
                row[label.replace("_s", "_ns_per_change")] = 1e9 * row[label] / changes
            row["all_cores_over_one_thread"] = row["all_cores_s"] / row["one_thread_s"]
            if files:
                row["delta_file_s"] = statistics.median(files)
            out["sizes"].append(row)
            log(
                f"{changes:,} changes: one thread {row['one_thread_s']:.3f} s ({row['one_thread_ns_per_change']:.1f} ns/change), "
                f"all {out['threads']} cores {row['all_cores_s']:.3f} s ({row['all_cores_ns_per_change']:.1f} ns/change), "
                f"ratio {row['all_cores_over_one_thread']:.2f}"
                + (f"; the delta file (encode, durable write, SHA-256) {row['delta_file_s']:.3f} s" if files else "")
            )
    finally:
        if saved is None:
            os.environ.pop(VARIABLE, None)
        else:
            os.environ[VARIABLE] = saved
    return out


def plot(results: dict[str, list[dict[str, Any]]], path: str) -> None:
    """Nanoseconds per changed element against the delta's size, one thread and all cores (and
    the writer's delta file, from runs with ``--file``), for each labelled list of runs (medians
    over the runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, runs), color in zip(results.items(), ("tab:gray", "tab:blue", "tab:green")):
        sizes = [row["changes"] for row in runs[0]["sizes"]]
        cores = f"{runs[0]['threads']} cores"
        for key, style, what in (("one_thread_ns_per_change", "--", "one thread"), ("all_cores_ns_per_change", "-", cores)):
            values = [statistics.median(run["sizes"][k][key] for run in runs) for k in range(len(sizes))]
            ax.plot([n / 1e6 for n in sizes], values, style, marker="o", color=color, label=f"{label}, {what}")
        if all("delta_file_s" in row for run in runs for row in run["sizes"]):  # runs with --file
            values = [1e9 * statistics.median(run["sizes"][k]["delta_file_s"] for run in runs) / n for k, n in enumerate(sizes)]
            ax.plot([n / 1e6 for n in sizes], values, ":", marker="s", color=color, label=f"{label}, the delta file, {cores}")
    ax.set_xscale("log")
    ticks = sorted({row["changes"] for runs in results.values() for row in runs[0]["sizes"]})
    ax.set_xticks([n / 1e6 for n in ticks], [f"{n / 1e6:g}M" for n in ticks])
    ax.minorticks_off()
    ax.set_xlabel("changed elements, spread over tensors")
    ax.set_ylabel("ns per changed element")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("zstd delta: encode, and the writer's delta file (--file); medians")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--changes", type=int, nargs="+", default=[4_000_000, 16_000_000, 45_000_000],
                        help="changed elements per delta (default: 4M, 16M, and 45M: 1.45%% of a 3B model)")  # fmt: skip
    parser.add_argument("--tensors", type=int, default=200, help="tensors the changes spread over (default 200)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians reported (default 5)")
    parser.add_argument("--file", metavar="DIR", help="also time the writer's whole delta file (encode, durable write "
                        "into a local bucket, SHA-256) with the host's cores, in fresh folders under DIR")  # fmt: skip
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="draw ns per changed element here (needs matplotlib)")
    parser.add_argument("--plot-from", nargs="+", metavar="LABEL=JSON",
                        help="only draw --plot from earlier runs: LABEL=a.json,b.json ... (medians over each label's "
                             "runs), or a saved comparison such as results/encode-cpu.json")  # fmt: skip
    args = parser.parse_args()
    if args.plot_from:
        if not args.plot:
            parser.error("--plot-from needs --plot")
        results: dict[str, list[dict[str, Any]]] = {}
        for item in args.plot_from:
            if "=" in item:
                label, files = item.split("=", 1)
                results[label] = [json.loads(Path(f).read_text()) for f in files.split(",")]
            else:  # a comparison saved as one file: {"before_commit", "before": [runs], "after_commit", "after": [runs]}
                saved = json.loads(Path(item).read_text())
                keys = ("before_commit", "before", "after_commit", "after")
                if not isinstance(saved, dict) or any(key not in saved for key in keys):
                    parser.error(f"--plot-from {item}: neither LABEL=JSON nor a saved comparison (keys {', '.join(keys)})")
                results.update({saved[f"{key}_commit"]: saved[key] for key in ("before", "after")})
        plot(results, args.plot)
        log(f"drew {args.plot}")
        return
    log(f"deltasync from {Path(deltasync.__file__).resolve().parent}")
    result = run(args.changes, args.tensors, args.rounds, args.file)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.out}")
    if args.plot:
        plot({"this run": [result]}, args.plot)
        log(f"drew {args.plot}")


if __name__ == "__main__":
    main()
