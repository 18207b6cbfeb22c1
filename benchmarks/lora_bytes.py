"""Bytes per sync for a LoRA policy: adapter mode, merged mode, and a full-model delta.

Builds a random Qwen2 with Qwen2.5-0.5B's widths (``--scale`` of its layers and vocabulary),
then, from the same starting weights, trains three ways with AdamW on random-token language
modelling and publishes after every optimizer step into a local bucket with the publisher's
default options (zstd deltas, the adaptive anchor rule):

- **full**: every parameter trained (lr ``--lr-full``), full-model deltas;
- **merged**: a LoRA adapter (rank ``--rank`` on all linear layers, lr ``--lr-lora``), merged
  weights published as full-model deltas;
- **adapter**: the same LoRA training, the adapter alone published.

Prints a markdown table; ``--out`` writes the numbers as JSON. Run from the repository root:

    .venv/bin/python benchmarks/lora_bytes.py --out benchmarks/results/lora_bytes.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from _machine import machine
from deltasync import DeltaPublisher, adapter_publisher, merged_publisher

LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(scale: float, seed: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=round(151936 * scale),
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=max(1, round(24 * scale)),
        num_attention_heads=14,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def run(mode: str, args: argparse.Namespace, root: pathlib.Path) -> dict:
    model = build(args.scale, args.seed)
    if mode == "full":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr_full)
        publisher = DeltaPublisher(root / mode, model, optimizer)
    else:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=LINEAR, lora_dropout=0.0))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr_lora)
        make = adapter_publisher if mode == "adapter" else merged_publisher
        publisher = make(root / mode, model, optimizer)
    syncs = []
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps + 1):
        if step:
            ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=gen)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        start = time.perf_counter()
        result = publisher.publish()
        syncs.append(
            {"kind": result.kind, "nbytes": result.nbytes, "changed_fraction": result.changed_fraction,
             "publish_s": time.perf_counter() - start}  # fmt: skip
        )
        print(f"{mode:8s} sync {step}: {result.kind:6s} {result.nbytes:>12,d} B "
              f"({result.changed_fraction:.2%} changed)", file=sys.stderr)  # fmt: skip
    publisher.close()
    after = syncs[1:]
    return {
        "mode": mode,
        "first_sync_bytes": syncs[0]["nbytes"],
        "mean_bytes_per_sync": sum(s["nbytes"] for s in after) / len(after),
        "anchors_after_first": sum(s["kind"] == "anchor" for s in after),
        "mean_changed_fraction": sum(s["changed_fraction"] for s in after) / len(after),
        "full_bf16_bytes": 2 * sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n),
        "syncs": syncs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=0.1, help="fraction of Qwen2.5-0.5B's layers and vocabulary")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (one sync after each)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr-full", type=float, default=3e-7)
    parser.add_argument("--lr-lora", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(mode, args, pathlib.Path(tmp)) for mode in ("full", "merged", "adapter")]
    full = rows[0]["full_bf16_bytes"]
    print(f"\nQwen2.5-0.5B widths, scale {args.scale}: {full / 2 / 1e6:.1f}M parameters, {full / 1e6:.1f} MB in bf16; "
          f"LoRA rank {args.rank} on {', '.join(LINEAR)}; {args.steps} syncs after the first\n")  # fmt: skip
    print("| sync | first sync (anchor) | bytes per later sync | anchors among them | changed per sync |")
    print("|---|---:|---:|---:|---:|")
    names = {"full": f"full-model delta (lr {args.lr_full:g})", "merged": f"LoRA, merged mode (lr {args.lr_lora:g})",
             "adapter": f"LoRA, adapter mode (lr {args.lr_lora:g})"}  # fmt: skip
    for row in rows:
        print(f"| {names[row['mode']]} | {row['first_sync_bytes'] / 1e6:.2f} MB | {row['mean_bytes_per_sync'] / 1e6:.3f} MB "
              f"({row['mean_bytes_per_sync'] / full:.2%} of bf16) | {row['anchors_after_first']} | "
              f"{row['mean_changed_fraction']:.2%} |")  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
