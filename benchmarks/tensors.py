"""How costs grow with the number of tensors: the same elements, cut into more and more tensors.

A mixture-of-experts checkpoint holds tens of thousands of small tensors (one per expert and
projection: DeepSeek-V3 has about 45,000), where a dense model of the same size holds a few
hundred. What deltasync does once per tensor (a compare's set-up, a decode's look-up, a
fingerprint's seed, the calls into NumPy and torch) then weighs more than what it does per
element. This script publishes the same ``--elements`` bf16 elements cut into each count of
``--counts`` tensors, ``--share`` of them changed per version (one bf16 step each), and times:

- the publisher's ``publish()`` of a delta (detect, encode, commit), median of ``--versions``;
- a CPU server's in-place stage of that delta (``InPlaceState.stage_deltas``), with one decode
  thread and with the host's cores (``DELTASYNC_DECODE_THREADS``), median of ``--rounds``. With
  ``--fused K`` the server holds every K consecutive tensors as the rows of one parameter, as
  vLLM's fused MoE layers hold their experts;
- a receiver's stage (``DeltaReceiver.stage``), median of ``--rounds``.

Every version's fingerprint is checked against the bucket's, and the in-place writer's and the
receiver's weights against the trainer's, bit for bit. It reports microseconds per tensor and
nanoseconds per changed element, writes JSON, and with ``--plot`` draws time per tensor against
the count. To compare two commits, run it with each package on ``PYTHONPATH`` (it imports
whichever ``deltasync`` comes first)::

    python benchmarks/tensors.py --out now.json --plot now.png
    PYTHONPATH=/path/to/older/checkout python benchmarks/tensors.py --out before.json
    python benchmarks/tensors.py --plot-from now.json --label now --compare before=before.json --plot both.png

Run it alone: it measures the host's cores.
"""

from __future__ import annotations

import argparse
import gc
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

from deltasync import DeltaPublisher, DeltaReceiver
from deltasync.reader.chain import ChainReader, read_pointer
from deltasync.server.inplace import InPlaceState
from deltasync.server.weight_map import discover
from deltasync.stores import LocalStore

from _machine import machine
from _series import series
from scale import Weights  # bf16 parameters under checkpoint names, loadable as a server's model

VARIABLE = "DELTASYNC_DECODE_THREADS"


class Model(Weights):
    """:class:`scale.Weights` whose loader finds a parameter without listing them all (the
    in-place writer's set-up calls the loader once per checkpoint name)."""

    def load_weights(self, weights: Any) -> set[str]:
        params = self.__dict__.get("_params")
        if params is None:
            params = self.__dict__["_params"] = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            params[name].data.copy_(w)
            loaded.add(name)
        return loaded


class Fused(torch.nn.Module):
    """The server's model with every ``fused`` consecutive checkpoint tensors held as the rows of
    one parameter, as vLLM's fused MoE layers hold their experts (``w13_weight``, ``w2_weight``)."""

    def __init__(self, named: dict[str, torch.Tensor], fused: int) -> None:
        super().__init__()
        self.where: dict[str, tuple[int, int]] = {}
        rows: list[list[torch.Tensor]] = []
        for k, (name, t) in enumerate(named.items()):
            if k % fused == 0:
                rows.append([])
            self.where[name] = (len(rows) - 1, len(rows[-1]))
            rows[-1].append(t)
        self.fused = torch.nn.ParameterList([torch.nn.Parameter(torch.stack(r), requires_grad=False) for r in rows])

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, w in weights:
            j, row = self.where[name]
            self.fused[j].data[row].copy_(w)
            loaded.add(name)
        return loaded

    def served(self) -> dict[str, torch.Tensor]:
        return {name: self.fused[j].detach()[row].view(torch.int16).clone() for name, (j, row) in self.where.items()}


def log(message: str) -> None:
    print(f"[tensors.py {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().view(torch.int16).clone() for n, p in model.named_parameters()}


def one_count(count: int, elements: int, share: float, versions: int, rounds: int, folder: str | None,
              fused: int = 0) -> dict[str, Any]:  # fmt: skip
    per = elements // count
    g = torch.Generator().manual_seed(count)
    start = {f"model.layers.{k // 64}.mlp.experts.{k % 64}.proj.weight": torch.randn(per, generator=g).to(torch.bfloat16)
             for k in range(count)}  # fmt: skip
    out: dict[str, Any] = {"tensors": count, "elements_per_tensor": per, "fused": fused}
    with tempfile.TemporaryDirectory(prefix="deltasync-tensors-", dir=folder) as root:
        trainer = Model({n: t.clone() for n, t in start.items()}, trainable=True)
        publish_s, changed = [], []
        with DeltaPublisher(root, trainer, None, anchor_every=10_000, anchor_bytes_ratio=0) as publisher:
            publisher.publish()
            gc.collect()
            gc.freeze()  # what a long-running trainer's collector no longer walks
            for _ in range(versions):
                with torch.no_grad():
                    for p in trainer.parameters():
                        bits = p.view(-1).view(torch.int16)
                        bits[torch.randperm(per, generator=g)[: max(1, int(per * share))]] += 1
                t = time.perf_counter()
                result = publisher.publish()
                publish_s.append(time.perf_counter() - t)
                changed.append(result.changed)
        gc.unfreeze()
        want = _bits(trainer)
        store = LocalStore(root)
        pointer = read_pointer(store)
        last = pointer.version
        # The in-place stage of the last delta, on live weights at the version before it.
        receiver = DeltaReceiver(store)
        receiver.sync(last - 1)
        now = {n: t.clone() for n, t in receiver.state_dict().items()}
        live_model: Model | Fused = Fused(now, fused) if fused else Model(now)
        live = InPlaceState(live_model, discover(live_model, {n: tuple(t.shape) for n, t in start.items()}),
                            lambda obj: [obj], 0, live_model.load_weights)  # fmt: skip
        live.commit(last - 1, live.full_fingerprint())
        times: dict[str, list[float]] = {"stage_one_thread_s": [], "stage_all_cores_s": [], "receiver_stage_s": []}
        saved = os.environ.get(VARIABLE)
        exact = True
        gc.collect()
        gc.freeze()
        try:
            for _ in range(rounds + 1):
                for label, threads in (("stage_one_thread_s", "1"), ("stage_all_cores_s", None)):
                    if threads is None:
                        os.environ.pop(VARIABLE, None)
                    else:
                        os.environ[VARIABLE] = threads
                    t = time.perf_counter()
                    staged = live.stage_deltas(ChainReader(store, pointer), last)
                    times[label].append(time.perf_counter() - t)
                    exact &= live.check_chain(staged, [staged.shares]) == result.fingerprint
                os.environ.pop(VARIABLE, None)
                t = time.perf_counter()
                rstaged = receiver.stage(last)
                times["receiver_stage_s"].append(time.perf_counter() - t)
                exact &= rstaged.fingerprint == result.fingerprint
        finally:
            gc.unfreeze()
            if saved is None:
                os.environ.pop(VARIABLE, None)
            else:
                os.environ[VARIABLE] = saved
        live.write(staged)
        receiver.apply(rstaged)
        served = live_model.served() if isinstance(live_model, Fused) else _bits(live_model)
        exact &= all(torch.equal(served[n], want[n]) for n in want)
        exact &= all(torch.equal(t.view(torch.int16), want[n]) for n, t in receiver.state_dict().items())
    out["changed"] = int(statistics.median(changed))
    out["publish_s"] = statistics.median(publish_s)
    out["publish_s_all"] = publish_s
    for label, values in times.items():
        out[label] = statistics.median(values[1:])  # the first round warms up
        out[label + "_all"] = values
    for label in ("publish_s", "stage_one_thread_s", "stage_all_cores_s", "receiver_stage_s"):
        key = label.removesuffix("_s")
        out[key + "_us_per_tensor"] = out[label] / count * 1e6
        out[key + "_ns_per_changed"] = out[label] / out["changed"] * 1e9
    out["exact"] = exact
    log(f"{count:>6} tensors of {per:,}: {out['changed']:,} changed; publish {out['publish_s']:.3f} s "
        f"({out['publish_us_per_tensor']:.0f} us/tensor), in-place stage {out['stage_one_thread_s']:.3f} s one thread, "
        f"{out['stage_all_cores_s']:.3f} s all cores, receiver stage {out['receiver_stage_s']:.3f} s; exact: {exact}")  # fmt: skip
    return out


def run(counts: list[int], elements: int, share: float, versions: int, rounds: int, folder: str | None,
        fused: int = 0) -> dict[str, Any]:  # fmt: skip
    rows = []
    for k, count in enumerate(counts):
        log(f"[{k + 1}/{len(counts)}] {count} tensors" + (f", {fused} to a served parameter" if fused else ""))
        rows.append(one_count(count, elements, share, versions, rounds, folder, fused))
    return {
        "machine": machine(), "package": str(Path(deltasync.__file__).resolve().parent), "elements": elements,
        "share": share, "versions": versions, "rounds": rounds, "fused": fused, "rows": rows,
        "exact": all(r["exact"] for r in rows),
    }  # fmt: skip


SERIES = [
    ("publish_us_per_tensor", "publish()"),
    ("stage_one_thread_us_per_tensor", "in-place stage, one thread"),
    ("stage_all_cores_us_per_tensor", "in-place stage, all cores"),
    ("receiver_stage_us_per_tensor", "receiver stage"),
]


def plot(results: list[tuple[str, dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SERIES), figsize=(4 * len(SERIES), 3.6), sharey=True)
    for ax, (key, title) in zip(axes, SERIES):
        for (label, r), style in zip(results, ("o-", "s--", "^:")):
            counts = [row["tensors"] for row in r["rows"]]
            ax.plot(counts, [row[key] for row in r["rows"]], style, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("tensors (same elements)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("microseconds per tensor")
    axes[0].legend(fontsize=8)
    first = results[0][1]
    fig.suptitle(f"{first['elements']:,} bf16 elements, {first['share']:.0%} changed per version", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[64, 512, 4096, 16384], help="tensor counts")
    parser.add_argument("--elements", type=int, default=1 << 25, help="bf16 elements in all (default 32M)")
    parser.add_argument("--share", type=float, default=0.02, help="share of each tensor changed per version")
    parser.add_argument("--versions", type=int, default=3, help="delta versions published (median)")
    parser.add_argument("--rounds", type=int, default=3, help="stages timed after a warm-up one (median)")
    parser.add_argument("--fused", type=int, default=0,
                        help="the server holds this many consecutive tensors as one parameter (a fused MoE layer); 0: none")
    parser.add_argument("--bucket", default=None, help="folder for the temporary buckets (default: the system's)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="draw microseconds per tensor here (needs matplotlib)")
    parser.add_argument("--plot-from", help="plot these results instead of running")
    parser.add_argument("--compare", nargs="*", default=[], help="more results to draw beside them (label=path or path)")
    parser.add_argument("--label", help="the results' label in the plot (default: the package's folder)")
    args = parser.parse_args()
    if args.fused < 0:
        parser.error(f"--fused must be 0 (none) or more, not {args.fused}")
    bad = [c for c in args.counts if not 1 <= c <= args.elements]
    if bad:
        parser.error(f"--counts {bad}: each count must be 1 to --elements ({args.elements})")
    if not 0 < args.share <= 1:
        parser.error(f"--share must be in (0, 1], not {args.share}")
    if args.plot_from:
        result = json.loads(Path(args.plot_from).read_text())
    else:
        log(f"deltasync from {Path(deltasync.__file__).resolve().parent}")
        result = run(args.counts, args.elements, args.share, args.versions, args.rounds, args.bucket, args.fused)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            log(f"wrote {args.out}")
    if args.plot:
        plot(series(result, args.label, args.compare), args.plot)
    if not result["exact"]:
        raise SystemExit("a version or a stage did not match the trainer's weights")


if __name__ == "__main__":
    main()
