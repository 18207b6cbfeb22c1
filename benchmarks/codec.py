"""Delta codec benchmark on a simulated RL update trace with Qwen2.5-0.5B-shaped tensors.

Each measured step runs one AdamW step on fp32 master weights with simulated gradients, then
goes through the package's own code paths: ``BF16ChangeDetector`` (with its optimizer hook)
finds the changed bf16 elements, ``deltasync.format.encode_delta`` encodes them with each
codec and ``decode_delta`` decodes them against a receiver-side bf16 copy. The receiver copy
is then compared bit for bit with the trainer's bf16 state; any difference aborts the run.
In the same step the full bf16 state is written with ``safetensors.torch.save_file`` as the
baseline, so every time is read as a ratio against a write measured moments apart.

Simulated gradients (see :class:`SimulatedGradients`): each tensor follows an AR(1) process
in time, ``g_t = rho * g_(t-1) + sqrt(1 - rho^2) * s_T * a_(T,t) * z_t`` with ``z_t`` standard
normal, ``s_T`` a fixed per-tensor scale (log-normal) and ``a_(T,t)`` a per-tensor, per-step
factor (log-normal). Warm-up steps before the first measured step move Adam past its first
steps: the first update is exactly +-lr on every element (the sign of the first gradient), and
the changed fraction keeps falling while the momentum fills in (about 1.4x from step 1 to
step 10, then under 1% per step, relative).

Run from the repository root, e.g. ``python benchmarks/codec.py --scale 0.1``; see
benchmarks/README.md for the reference run and its results.

``--moe`` runs an MoE trace instead (:func:`run_moe`): a transformers Qwen3-MoE with
Qwen3-30B-A3B's layer shape (hidden 2048, 32 query / 4 key-value heads of 128, expert width 768,
128 experts of which 8 route each token; ``--scale`` scales the experts, the routed experts and
the vocabulary), experts fused in memory as transformers holds them and published per expert
as ``save_pretrained`` writes them. Each step only the routed experts of each layer (a random
``--routed`` fraction) get a gradient; Adam's momentum moves the others it routed before.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import deltasync  # noqa: F401
except ImportError:  # a checkout without an install: import the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import load as st_load
from safetensors.torch import save_file

from _machine import machine

from deltasync.trainer.checkpoint_layout import checkpoint_layout
from deltasync.trainer.detector import BF16ChangeDetector, bf16_state_dict, named_parameters
from deltasync.format.fingerprint import fingerprint, fingerprint_update
from deltasync.format import CODECS, Change, decode_delta, encode_delta

DEFAULT_LR = 2.9e-7
"""Calibrated so that about 1% of bf16 elements change per step (see benchmarks/README.md)."""

TARGETS = {
    "zstd_vs_raw_size": ("zstd vs raw size (raw / zstd)", ">=", 4.5),
    "zstd_bytes_per_changed": ("zstd bytes per changed element", "<=", 1.3),
    "zstd_pct_of_full": ("zstd % of full bf16 size", "<=", 1.0),
    "zstd_time_vs_full_write": ("(detect + zstd encode) / full write time", "<", 1.0),
}


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Qwen2.5-0.5B: the tensor shapes of its checkpoint."""

    hidden: int = 896
    """Hidden size."""
    intermediate: int = 4864
    """MLP intermediate size."""
    layers: int = 24
    """Decoder layers."""
    heads: int = 14
    """Attention heads."""
    kv_heads: int = 2
    """Key/value heads."""
    head_dim: int = 64
    """Size of one head."""
    vocab: int = 151936
    """Vocabulary (embedding rows; the LM head is tied to the embedding)."""

    def scaled(self, scale: float) -> ModelShape:
        """Fewer layers and vocabulary rows; every tensor keeps its width."""
        return ModelShape(
            **{
                **asdict(self),
                "layers": max(1, round(self.layers * scale)),
                "vocab": max(256, round(self.vocab * scale)),
            }
        )


def build_model(shape: ModelShape, generator: torch.Generator) -> nn.Module:
    """A parameter-only module tree with the Hugging Face names of a Qwen2 checkpoint.

    Weights and biases are drawn from N(0, 0.02^2); RMSNorm weights start at 1. Biases are
    random rather than zero, as in a pretrained checkpoint: zero biases would change on every
    step (any update of 0 is representable) and distort the counts.
    """

    def param(*size: int, ones: bool = False) -> nn.Parameter:
        t = torch.empty(size)
        if ones:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=generator)
        return nn.Parameter(t)

    def linear(out_f: int, in_f: int, bias: bool = False) -> nn.Module:
        m = nn.Module()
        m.weight = param(out_f, in_f)
        if bias:
            m.bias = param(out_f)
        return m

    def norm() -> nn.Module:
        m = nn.Module()
        m.weight = param(shape.hidden, ones=True)
        return m

    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    layers = nn.ModuleList()
    for _ in range(shape.layers):
        layer = nn.Module()
        attn = nn.Module()
        attn.q_proj = linear(q, h, bias=True)
        attn.k_proj = linear(kv, h, bias=True)
        attn.v_proj = linear(kv, h, bias=True)
        attn.o_proj = linear(h, q)
        mlp = nn.Module()
        mlp.gate_proj = linear(shape.intermediate, h)
        mlp.up_proj = linear(shape.intermediate, h)
        mlp.down_proj = linear(h, shape.intermediate)
        layer.self_attn = attn
        layer.mlp = mlp
        layer.input_layernorm = norm()
        layer.post_attention_layernorm = norm()
        layers.append(layer)
    inner = nn.Module()
    embed = nn.Module()
    embed.weight = param(shape.vocab, h)
    inner.embed_tokens = embed
    inner.layers = layers
    inner.norm = norm()
    root = nn.Module()
    root.model = inner
    lm_head = nn.Module()
    lm_head.weight = embed.weight  # tied: named_parameters() lists it once, as the embedding
    root.lm_head = lm_head
    return root


# --------------------------------------------------------------------------- gradients


class SimulatedGradients:
    """Temporally correlated random gradients with per-tensor scales that vary over steps.

    ``g_t = rho * g_(t-1) + sqrt(1 - rho^2) * s_T * a_(T,t) * z_t``, kept in ``param.grad``
    (no extra copy). ``s_T = base * exp(tensor_sigma * N(0,1))`` is drawn once per tensor,
    ``a_(T,t) = exp(step_sigma * N(0,1))`` per tensor and step, ``z_t`` is N(0,1) per element.
    Adam divides by the running RMS of each element, so the scales matter through how they
    change over time (a loud step after quiet ones moves weights further), and the correlation
    through how consistent each element's sign is (consistent signs build momentum).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        generator: torch.Generator,
        *,
        rho: float = 0.9,
        base: float = 1e-3,
        tensor_sigma: float = 1.0,
        step_sigma: float = 0.5,
    ) -> None:
        self.params = params
        self.generator = generator
        self.rho = rho
        self.step_sigma = step_sigma
        self.scales = [base * math.exp(tensor_sigma * _normal(generator)) for _ in params]
        self._noise = torch.empty(min(1 << 24, max(p.numel() for p in params)))

    def step(self) -> None:
        innovation = math.sqrt(1.0 - self.rho**2)
        for param, scale in zip(self.params, self.scales):
            s = scale * math.exp(self.step_sigma * _normal(self.generator))
            if param.grad is None:
                param.grad = torch.zeros_like(param)
                decay, amount = 0.0, s  # the stationary distribution from the first step
            else:
                decay, amount = self.rho, innovation * s
            flat = param.grad.view(-1)
            for start in range(0, flat.numel(), self._noise.numel()):
                chunk = flat[start : start + self._noise.numel()]
                noise = self._noise[: chunk.numel()].normal_(generator=self.generator)
                chunk.mul_(decay).add_(noise, alpha=amount)


def _normal(generator: torch.Generator) -> float:
    return float(torch.randn((), generator=generator))


# --------------------------------------------------------------------------- one step


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _check_decoded(codec: str, decoded: dict[str, Change], changes: dict[str, Change]) -> None:
    if set(decoded) != set(changes):
        raise SystemExit(
            f"FAIL: {codec} round trip: decoded parameters differ from the detected ones "
            f"(missing {sorted(set(changes) - set(decoded))[:5]}, extra {sorted(set(decoded) - set(changes))[:5]})"
        )
    for name, change in changes.items():
        got = decoded[name]
        if not torch.equal(got.index.to(torch.int64), change.index) or not _same(got.new, change.new):
            raise SystemExit(f"FAIL: {codec} round trip: parameter {name!r} decodes to other indices or values")


def _verify(receiver: dict[str, torch.Tensor], trainer: dict[str, torch.Tensor], step: int) -> None:
    """The receiver's state, built only from decoded deltas, must equal the trainer's bf16."""
    for name, value in trainer.items():
        mine = receiver[name].view(-1)
        theirs = value.reshape(-1)
        if not _same(mine, theirs):
            bad = int((mine.view(torch.int16) != theirs.view(torch.int16)).sum())
            raise SystemExit(
                f"FAIL: step {step}: after applying the decoded deltas, {bad} elements of {name!r} differ "
                "from the trainer's bf16 state"
            )


def _stream_bytes(data: bytes) -> dict[str, int]:
    """Compressed bytes of each stream of a zstd delta; the rest is the safetensors header."""
    tensors = st_load(data)
    sizes = {key.split(":", 1)[1]: t.numel() * t.element_size() for key, t in tensors.items()}
    sizes["header"] = len(data) - sum(sizes.values())
    return sizes


def run(args: argparse.Namespace) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(args.seed)
    shape = ModelShape().scaled(args.scale)
    log(f"building a Qwen2.5-0.5B-shaped model at scale {args.scale}: {shape}")
    model = build_model(shape, generator)
    named = list(named_parameters(model))
    params = [p for _, p in named]
    total = sum(p.numel() for p in params)
    numels = {name: p.numel() for name, p in named}
    log(f"{len(named)} tensors, {total / 1e6:.1f}M parameters ({2 * total / 2**30:.2f} GiB in bf16)")
    optimizer = torch.optim.AdamW(
        params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True
    )
    grads = SimulatedGradients(params, generator)
    for w in range(args.warmup):
        t0 = time.perf_counter()
        grads.step()
        optimizer.step()
        log(f"warm-up {w + 1}/{args.warmup}: {time.perf_counter() - t0:.1f}s")

    # The anchor: what publisher and receivers hold before the first measured step.
    detector = BF16ChangeDetector(model, optimizer)
    receiver = bf16_state_dict(model)
    t0 = time.perf_counter()
    fp = fingerprint(receiver)
    log(f"anchor fingerprint {fp} in {time.perf_counter() - t0:.1f}s")

    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="deltasync-codec-bench-") as tmp:
        full_path = os.path.join(tmp, "full.safetensors")
        for step in range(1, args.steps + 1):
            rec: dict[str, Any] = {"step": step}
            t0 = time.perf_counter()
            grads.step()
            optimizer.step()
            rec["train_s"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            changes = detector.changes()
            rec["detect_changes_s"] = time.perf_counter() - t0
            changed = sum(c.index.numel() for c in changes.values())
            rec["changed"] = changed
            rec["changed_pct"] = 100.0 * changed / total
            rec["changed_params"] = len(changes)

            t0 = time.perf_counter()
            new_fp = fp
            for name, change in changes.items():
                new_fp = fingerprint_update(new_fp, name, change.index, change.old, change.new)
            rec["fingerprint_s"] = time.perf_counter() - t0

            decoded_any: dict[str, Change] | None = None
            for codec in args.codecs:
                t0 = time.perf_counter()
                data = encode_delta(
                    changes,
                    version=step,
                    anchor=0,
                    codec=codec,
                    total=total,
                    fingerprint=new_fp,
                    base_fingerprint=fp,
                    level=args.zstd_level,
                    numels=numels,
                )
                rec[f"{codec}_encode_s"] = time.perf_counter() - t0
                rec[f"{codec}_bytes"] = len(data)
                rec[f"{codec}_bytes_per_changed"] = len(data) / max(changed, 1)
                if codec == "zstd":
                    rec["zstd_streams"] = _stream_bytes(data)
                t0 = time.perf_counter()
                header, decoded = decode_delta(
                    data,
                    where=f"step {step} ({codec})",
                    numels=numels,
                    base_values=lambda n, i: receiver[n].view(-1)[i],
                )
                rec[f"{codec}_decode_s"] = time.perf_counter() - t0
                if header.fingerprint != new_fp or header.changed != changed:
                    raise SystemExit(f"FAIL: step {step} ({codec}): the decoded header disagrees with the encoder")
                _check_decoded(codec, decoded, changes)
                decoded_any = decoded
                del data

            t0 = time.perf_counter()
            detector.commit(changes)
            rec["detect_commit_s"] = time.perf_counter() - t0
            rec["detect_s"] = rec["detect_changes_s"] + rec["detect_commit_s"]
            for name, change in (decoded_any or {}).items():
                receiver[name].view(-1)[change.index] = change.new
            fp = new_fp
            del changes, decoded_any

            # Baseline: the full bf16 state, converted and written in the same step.
            t0 = time.perf_counter()
            state = bf16_state_dict(model)
            rec["full_convert_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            save_file(state, full_path)
            rec["full_write_s"] = time.perf_counter() - t0
            rec["full_bytes"] = os.path.getsize(full_path)
            os.remove(full_path)
            _verify(receiver, state, step)
            del state
            for codec in args.codecs:
                rec[f"{codec}_pct_of_full"] = 100.0 * rec[f"{codec}_bytes"] / rec["full_bytes"]
                publish_s = rec["detect_s"] + rec[f"{codec}_encode_s"]
                rec[f"{codec}_detect_encode_s"] = publish_s
                rec[f"{codec}_time_vs_full_write"] = publish_s / rec["full_write_s"]
                rec[f"{codec}_time_vs_full_convert_write"] = publish_s / (rec["full_convert_s"] + rec["full_write_s"])
            if "raw" in args.codecs and "zstd" in args.codecs:
                rec["zstd_vs_raw_size"] = rec["raw_bytes"] / rec["zstd_bytes"]
            records.append(rec)
            log(_progress(rec, args.steps, args.codecs))

    detector.close()
    final = fingerprint(receiver)
    if final != fp:
        raise SystemExit(f"FAIL: the receiver's fingerprint {final} is not the trainer's {fp}")
    log(f"verified: every step's decoded deltas reproduce the trainer's bf16 state (fingerprint {fp})")
    return _summary(args, shape, total, len(named), records)


def _progress(rec: dict[str, Any], steps: int, codecs: list[str]) -> str:
    parts = [f"step {rec['step']}/{steps}: changed {rec['changed_pct']:.3f}% ({rec['changed'] / 1e6:.2f}M)"]
    for codec in codecs:
        parts.append(
            f"{codec} {rec[f'{codec}_bytes'] / 1e6:.2f} MB ({rec[f'{codec}_bytes_per_changed']:.3f} B/el, "
            f"{rec[f'{codec}_pct_of_full']:.3f}% of full) enc {rec[f'{codec}_encode_s']:.2f}s "
            f"dec {rec[f'{codec}_decode_s']:.2f}s"
        )
    parts.append(f"detect {rec['detect_s']:.2f}s, full write {rec['full_write_s']:.2f}s, train {rec['train_s']:.1f}s")
    return " | ".join(parts)


# --------------------------------------------------------------------------- results


def _median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if key in r]
    return statistics.median(values) if values else None


def _meets(value: float, op: str, bound: float) -> bool:
    return value >= bound if op == ">=" else value <= bound if op == "<=" else value < bound


def _summary(
    args: argparse.Namespace, shape: ModelShape, total: int, tensors: int, records: list[dict[str, Any]]
) -> dict[str, Any]:
    keys = [k for k, v in records[0].items() if isinstance(v, (int, float)) and k != "step"]
    medians = {key: _median(records, key) for key in keys}
    if "zstd" in args.codecs:
        for stream in records[0]["zstd_streams"]:
            medians[f"zstd_stream_{stream}_bytes_per_changed"] = statistics.median(
                r["zstd_streams"][stream] / max(r["changed"], 1) for r in records
            )
    targets = []
    for key, (label, op, bound) in TARGETS.items():
        value = medians.get(key)
        if value is None:
            continue
        steps_met = sum(_meets(r[key], op, bound) for r in records if key in r)
        targets.append({"key": key, "label": label, "value": value, "op": op, "bound": bound,
                        "met": _meets(value, op, bound), "steps_met": steps_met, "steps": len(records)})
    return {
        "benchmark": "deltasync codec",
        "command": " ".join(["python", "benchmarks/codec.py", *args.argv]),
        "config": {
            "scale": args.scale,
            "steps": args.steps,
            "warmup": args.warmup,
            "lr": args.lr,
            "codecs": args.codecs,
            "zstd_level": args.zstd_level,
            "seed": args.seed,
            "optimizer": "torch.optim.AdamW(fused=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)",
            "gradients": "AR(1) per element, rho=0.9; per-tensor scale 1e-3*exp(N(0,1)); "
            "per-tensor per-step factor exp(0.5*N(0,1)); dense (every element, every step)",
        },
        "model": {**asdict(shape), "tensors": tensors, "parameters": total},
        "machine": machine(),
        "steps": records,
        "medians": medians,
        "targets": targets,
    }


def table(result: dict[str, Any]) -> str:
    """The summary as markdown: medians over the measured steps and the targets."""
    m = result["medians"]
    codecs = result["config"]["codecs"]
    mb = 1e6
    rows = [
        ("changed elements (% of all)", [f"{m['changed_pct']:.3f}%"] * len(codecs), f"{m['changed_pct']:.3f}%"),
        ("bytes per step", [f"{m[f'{c}_bytes'] / mb:.2f} MB" for c in codecs], f"{m['full_bytes'] / mb:.1f} MB"),
        ("bytes per changed element", [f"{m[f'{c}_bytes_per_changed']:.3f}" for c in codecs], "-"),
        ("% of full bf16 size", [f"{m[f'{c}_pct_of_full']:.3f}%" for c in codecs], "100%"),
        ("detect (changes + commit)", [f"{m['detect_s']:.2f} s"] * len(codecs), "-"),
        ("encode", [f"{m[f'{c}_encode_s']:.2f} s" for c in codecs], f"{m['full_write_s']:.2f} s (save_file)"),
        # the median of each step's own sum, not the sum of the two medians
        ("detect + encode", [f"{m[f'{c}_detect_encode_s']:.2f} s" for c in codecs], f"{m['full_write_s']:.2f} s"),
        ("decode", [f"{m[f'{c}_decode_s']:.2f} s" for c in codecs], "-"),
        (
            "(detect + encode) / full write",
            [f"{m[f'{c}_time_vs_full_write']:.3f}" for c in codecs],
            "1",
        ),
        (
            "(detect + encode) / (bf16 conversion + full write)",
            [f"{m[f'{c}_time_vs_full_convert_write']:.3f}" for c in codecs],
            "1",
        ),
    ]
    lines = [
        "| median over steps | " + " | ".join(codecs) + " | full bf16 |",
        "|---|" + "---:|" * (len(codecs) + 1),
    ]
    lines += [f"| {label} | " + " | ".join(cells) + f" | {full} |" for label, cells, full in rows]
    lines += ["", "| target | measured (median) | bound | met by the median | steps that met it |",
              "|---|---:|---:|---|---:|"]
    for t in result["targets"]:
        lines.append(f"| {t['label']} | {t['value']:.3f} | {t['op']} {t['bound']} | {'yes' if t['met'] else 'NO'} "
                     f"| {t['steps_met']} of {t['steps']} |")
    if "zstd" in codecs:
        streams = sorted((k for k in m if k.startswith("zstd_stream_")), key=lambda k: -m[k])
        lines += ["", "| zstd stream | bytes per changed element (median) |", "|---|---:|"]
        for key in streams:
            name = key[len("zstd_stream_") : -len("_bytes_per_changed")]
            lines.append(f"| {name} | {m[key]:.4f} |")
    lines += [
        "",
        f"Also per step (medians): fingerprint update {m['fingerprint_s']:.2f} s, bf16 conversion for the "
        f"full write {m['full_convert_s']:.2f} s, simulated gradient + AdamW step {m['train_s']:.1f} s.",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in result["steps"]]
    fig, (ax_bytes, ax_pct) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    ax_bytes.plot(steps, [r["full_bytes"] for r in result["steps"]], "k--", marker="s", label="full bf16 (safetensors)")
    for codec, style in (("raw", "o-"), ("zstd", "^-")):
        if codec in result["config"]["codecs"]:
            ax_bytes.plot(steps, [r[f"{codec}_bytes"] for r in result["steps"]], style, label=f"delta, {codec}")
    ax_bytes.set_yscale("log")
    ax_bytes.set_ylabel("bytes per step")
    ax_bytes.grid(True, which="both", alpha=0.3)
    ax_bytes.legend()
    model = result["model"]
    ax_bytes.set_title(
        f"deltasync codecs: Qwen2.5-0.5B shapes, {model['parameters'] / 1e6:.0f}M params, "
        f"lr {result['config']['lr']:g}, zstd level {result['config']['zstd_level']}"
    )
    ax_pct.plot(steps, [r["changed_pct"] for r in result["steps"]], "o-", color="tab:red")
    ax_pct.set_ylabel("changed bf16 elements (%)")
    ax_pct.set_xlabel("step")
    ax_pct.set_ylim(bottom=0)
    ax_pct.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- the MoE trace


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """Qwen3-30B-A3B's layer shape (its checkpoint: 48 layers, untied head)."""

    hidden: int = 2048
    moe_intermediate: int = 768
    experts: int = 128
    routed: int = 8
    """Experts each token routes to (the model's top-k)."""
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 151936
    layers: int = 2
    """Decoder layers built (the real model has 48: every layer has this shape)."""

    def scaled(self, scale: float) -> MoEShape:
        """Fewer experts (and routed experts) and vocabulary rows; every tensor keeps its width."""
        return MoEShape(**{**asdict(self), "experts": max(2, round(self.experts * scale)),
                           "routed": max(1, round(self.routed * scale)), "vocab": max(256, round(self.vocab * scale))})  # fmt: skip


def build_moe_model(shape: MoEShape, seed: int) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, moe_intermediate_size=shape.moe_intermediate,
        num_experts=shape.experts, num_experts_per_tok=shape.routed, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate_size=shape.moe_intermediate, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(config)


def run_moe(args: argparse.Namespace) -> dict[str, Any]:
    """The MoE trace: detect on the fused live tensors, map to checkpoint tensors, encode (zstd)."""
    generator = torch.Generator().manual_seed(args.seed)
    shape = MoEShape().scaled(args.scale)
    log(f"building a Qwen3-30B-A3B-shaped MoE at scale {args.scale}: {shape}")
    model = build_moe_model(shape, args.seed)
    named = list(named_parameters(model))
    layout = checkpoint_layout(model, named)
    params = [p for _, p in named]
    fused = {id(p): p for n, p in named if ".experts." in n}
    total = sum(p.numel() for p in params)
    expert_total = sum(p.numel() for p in fused.values())
    log(f"{len(named)} live tensors, {len(layout.pieces)} checkpoint tensors, {total / 1e6:.1f}M parameters "
        f"({expert_total / total:.0%} in experts)")  # fmt: skip
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    grads = SimulatedGradients(params, generator)
    routed_count = max(1, round(args.routed * shape.experts))

    def step() -> None:
        grads.step()
        for param in fused.values():  # (experts, ...): only the routed experts get a gradient
            idle = torch.randperm(shape.experts, generator=generator)[routed_count:]
            param.grad[idle] = 0.0
        optimizer.step()

    for _ in range(args.warmup):
        step()
    detector = BF16ChangeDetector(model, optimizer)
    receiver = {name: t.clone() for name, t in _checkpoint_state(model).items()}
    numels = layout.numels
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="deltasync-moe-bench-") as tmp:
        full_path = os.path.join(tmp, "full.safetensors")
        for number in range(1, args.steps + 1):
            rec: dict[str, Any] = {"step": number}
            step()
            t0 = time.perf_counter()
            live = detector.changes()
            rec["detect_changes_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            changes = layout.to_checkpoint(live)
            rec["remap_s"] = time.perf_counter() - t0
            changed = sum(c.index.numel() for c in changes.values())
            expert_changed = sum(c.index.numel() for n, c in changes.items() if ".experts." in n)
            rec["changed"], rec["changed_pct"] = changed, 100.0 * changed / total
            rec["expert_changed_pct"] = 100.0 * expert_changed / expert_total
            rec["dense_changed_pct"] = 100.0 * (changed - expert_changed) / (total - expert_total)
            experts_hit = {n.rsplit(".", 2)[0] for n in changes if ".experts." in n}
            rec["experts_changed_pct"] = 100.0 * len(experts_hit) / (shape.experts * shape.layers)
            t0 = time.perf_counter()
            data = encode_delta(changes, version=number, anchor=0, codec="zstd", total=total, fingerprint="0" * 16,
                                base_fingerprint="0" * 16, level=args.zstd_level, numels=numels)  # fmt: skip
            rec["zstd_encode_s"] = time.perf_counter() - t0
            rec["zstd_bytes"], rec["zstd_bytes_per_changed"] = len(data), len(data) / max(changed, 1)
            _, decoded = decode_delta(data, where=f"step {number}", numels=numels,
                                      base_values=lambda n, i: receiver[n].view(-1)[i])  # fmt: skip
            _check_decoded("zstd", decoded, changes)
            t0 = time.perf_counter()
            detector.commit(live)
            rec["detect_s"] = rec["detect_changes_s"] + time.perf_counter() - t0
            for name, change in decoded.items():
                receiver[name].view(-1)[change.index] = change.new
            t0 = time.perf_counter()
            state = _checkpoint_state(model)  # what save_pretrained writes, in bf16
            rec["full_convert_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            save_file(state, full_path)
            rec["full_write_s"] = time.perf_counter() - t0
            rec["full_bytes"] = os.path.getsize(full_path)
            os.remove(full_path)
            _verify(receiver, state, number)
            rec["detect_encode_s"] = rec["detect_s"] + rec["remap_s"] + rec["zstd_encode_s"]
            rec["time_vs_full_write"] = rec["detect_encode_s"] / rec["full_write_s"]
            rec["pct_of_full"] = 100.0 * len(data) / rec["full_bytes"]
            records.append(rec)
            log(f"step {number}/{args.steps}: {rec['changed_pct']:.3f}% changed (experts {rec['expert_changed_pct']:.3f}%, "
                f"dense {rec['dense_changed_pct']:.3f}%), {rec['zstd_bytes_per_changed']:.3f} B/changed, "
                f"detect+remap+encode {rec['detect_encode_s']:.2f} s vs full write {rec['full_write_s']:.2f} s")  # fmt: skip
    detector.close()
    log("verified: every step's decoded deltas reproduce save_pretrained's bf16 state")
    keys = [k for k, v in records[0].items() if isinstance(v, (int, float)) and k != "step"]
    return {
        "benchmark": "deltasync codec, MoE trace",
        "command": " ".join(["python", "benchmarks/codec.py", *args.argv]),
        "config": {"scale": args.scale, "steps": args.steps, "warmup": args.warmup, "lr": args.lr,
                   "routed_fraction": args.routed, "routed_experts_per_layer": routed_count, "zstd_level": args.zstd_level,
                   "seed": args.seed},  # fmt: skip
        "model": {**asdict(shape), "parameters": total, "expert_parameters": expert_total,
                  "checkpoint_tensors": len(layout.pieces)},  # fmt: skip
        "machine": machine(),
        "steps": records,
        "medians": {key: _median(records, key) for key in keys},
    }


def _checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's bf16 state as ``save_pretrained`` writes it (transformers' own reverse conversion)."""
    from transformers.core_model_loading import revert_weight_conversion

    return {k: v.contiguous() for k, v in revert_weight_conversion(model, bf16_state_dict(model)).items()}


def moe_table(result: dict[str, Any]) -> str:
    m, model = result["medians"], result["model"]
    rows = [
        ("changed elements, all", f"{m['changed_pct']:.3f}%"),
        ("changed elements, in experts", f"{m['expert_changed_pct']:.3f}%"),
        ("changed elements, dense parts (attention, router, norms, embeddings)", f"{m['dense_changed_pct']:.3f}%"),
        ("experts with any change", f"{m['experts_changed_pct']:.1f}%"),
        ("zstd bytes per changed element", f"{m['zstd_bytes_per_changed']:.3f}"),
        ("delta size, % of the full bf16 state", f"{m['pct_of_full']:.3f}%"),
        ("detect (changes + commit), on the fused tensors", f"{m['detect_s']:.2f} s"),
        ("map to checkpoint tensors", f"{m['remap_s']:.3f} s"),
        ("zstd encode", f"{m['zstd_encode_s']:.2f} s"),
        ("detect + map + encode", f"{m['detect_encode_s']:.2f} s"),
        ("full bf16 write (save_file of save_pretrained's layout)", f"{m['full_write_s']:.2f} s"),
        ("(detect + map + encode) / full write", f"{m['time_vs_full_write']:.3f}"),
    ]
    head = (f"{model['parameters'] / 1e6:.0f}M parameters ({model['expert_parameters'] / model['parameters']:.0%} in "
            f"{model['experts']} experts x {model['layers']} layers, {result['config']['routed_experts_per_layer']} "
            f"routed per step), {model['checkpoint_tensors']} checkpoint tensors")  # fmt: skip
    return "\n".join([head, "", "| median over steps | |", "|---|---:|", *(f"| {a} | {b} |" for a, b in rows)])


# --------------------------------------------------------------------------- CLI


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--steps", type=int, default=8, help="measured optimizer steps (default 8)")
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps before the anchor (default 10)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g}, ~1%% changed)")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="fraction of the layers and vocabulary to build (default 1: full shape)"
    )
    parser.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS, help="codecs to measure")
    parser.add_argument("--zstd-level", type=int, default=3, help="zstd level (default 3, the publisher's)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--plot", help="write a plot (PNG) of bytes and changed %% per step to this file")
    parser.add_argument("--moe", action="store_true", help="run the MoE trace (Qwen3-30B-A3B layer shape) instead")
    parser.add_argument("--routed", type=float, default=0.25,
                        help="MoE trace: fraction of each layer's experts that get a gradient per step (default 0.25)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if not 0 < args.scale <= 1:
        parser.error(f"--scale must be in (0, 1], got {args.scale}")
    if args.lr <= 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if not 1 <= args.zstd_level <= 22:
        parser.error(f"--zstd-level must be in 1..22, got {args.zstd_level}")
    args.codecs = list(dict.fromkeys(args.codecs))
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def save_outputs(result: dict[str, Any], out: str | None, plot_to: str | None, plot_fn: Any) -> None:
    """Write the results as JSON to ``out`` and ``plot_fn(result, plot_to)``'s plot, where asked
    (shared by the benchmarks that import this module)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
        log(f"results written to {out}")
    if plot_to:
        Path(plot_to).parent.mkdir(parents=True, exist_ok=True)
        plot_fn(result, plot_to)
        log(f"plot written to {plot_to}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.moe:
        if args.plot:
            raise SystemExit("--plot is not available with --moe")
        result = run_moe(args)
        print(moe_table(result))
        save_outputs(result, args.out, None, plot)
        return 0
    result = run(args)
    print(table(result))
    save_outputs(result, args.out, args.plot, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
