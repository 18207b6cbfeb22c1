"""Quantized views on the codec benchmark's trace: what a view's delta ships and costs per version.

The model and the trace are the codec benchmark's (``benchmarks/codec.py``: Qwen2.5-0.5B tensor
shapes, 494M parameters at ``--scale 1``, its seeded model and simulated gradients), with the
projection modules made ``torch.nn.Linear`` (same parameters) so that a view quantizes what
llm-compressor would: every q/k/v/o/gate/up/down projection; the embedding (tied to the LM head),
the norms and the biases stay bf16 in the view.

Every version goes through the real publisher: a ``DeltaPublisher(bucket, model, optimizer,
views=...)`` on a local temporary bucket, anchors off after version 0, so that the bytes measured
are what ships: ``PublishResult.nbytes`` (the bf16 delta) and ``PublishResult.view_nbytes`` (the
view's delta), both with the publisher's default codec (zstd). The view's time is measured by
wrapping each ``ViewChain.publish_delta`` of the publisher (quantize the changed layers, diff
against the last published codes and scales, encode, write, commit) and, inside it, the
scheme's ``quantize`` and the view's ``delta_pieces``; the wrappers only time and record, they
change nothing. The bf16 detection (shared by the bf16 chain and the views) is the time of
``submit()`` (capture "submit").

Baseline, in the same step: a full quantized write of the view, i.e. every target quantized from
the trainer's bf16 state with the scheme (``deltasync.views.get_scheme(name).quantize``, which is
compressed-tensors' arithmetic) and the view state (codes, scales, and the bf16 parameters)
written with ``safetensors.torch.save_file``. Times are reported as ratios against it.

Exactness, every step: a ``DeltaReceiver(bucket, view=name)`` follows the view's chain, and its
state must equal the baseline's quantization of the trainer's bf16 state bit for bit (codes,
scales and bf16 parameters); the codes and scales that changed between the baseline's
quantizations of two versions must be exactly what the view's delta holds. Any difference aborts.

Traces (``--traces``):

- ``adamw``: the codec benchmark's trace as it is (AdamW on fp32 master weights, AR(1) simulated
  gradients, lr 2.9e-7: about 1% of bf16 elements change per step);
- ``sign-momentum``: the same model, updated by sign-momentum (``w -= lr * sign(m)``, ``m`` an
  exponential average, beta 0.9, of fresh N(0, 1) gradients: every element moves by exactly
  ``lr`` each step), the process of the simulation in the project's issue on views, at a higher
  learning rate (``--sign-lr``, default 9.5e-7: about 4% of bf16 elements change per step). It
  stands in for an RL run with larger steps; it is a simulated gradient process, not an RL run.

Run from the repository root; see benchmarks/README.md for the reference run and its results::

    python benchmarks/views.py --quick                       # seconds
    python benchmarks/views.py --out benchmarks/results/views.json --plot benchmarks/results/views.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the codec benchmark, imported below
try:
    import deltasync  # noqa: F401
except ImportError:  # a checkout without an install: import the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine
from codec import (
    DEFAULT_LR,
    ModelShape,
    SimulatedGradients,
    build_model,
    log,
    save_outputs,
)
from safetensors.torch import save_file

import deltasync.trainer.view_chain as view_chain_module
from deltasync import DeltaPublisher, DeltaReceiver
from deltasync.trainer.detector import bf16_state_dict
from deltasync.format import Change
from deltasync.views import SCHEMES, get_scheme

DEFAULT_SIGN_LR = 9.5e-7
"""Sign-momentum learning rate: about 4% of bf16 elements change per step (std-0.02 weights)."""
TRACES = ("adamw", "sign-momentum")
TARGET_RATIO = 0.25
"""The issue's target: at about 1% bf16 density, a view's delta is at most this fraction of the
bf16 delta's bytes of the same version."""


# --------------------------------------------------------------------------- model and traces


def linearize(model: nn.Module) -> nn.Module:
    """Make every ``*_proj`` module of the codec benchmark's model a ``torch.nn.Linear`` holding the
    same parameters (the codec benchmark builds plain modules), so that the views' target rule
    (llm-compressor's ``targets=["Linear"]``) sees the layers a Qwen2 checkpoint has."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child_name.endswith("_proj") and not isinstance(child, nn.Linear):
                weight: nn.Parameter = getattr(child, "weight")  # noqa: B009 - a plain module's parameter
                bias: nn.Parameter | None = getattr(child, "bias", None)
                layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
                layer.weight = weight
                if bias is not None:
                    layer.bias = bias
                setattr(parent, child_name, layer)
    return model


class SignMomentum(torch.optim.Optimizer):
    """``m = beta * m + (1 - beta) * g``; ``w -= lr * sign(m)`` (every element moves by ``lr``)."""

    def __init__(self, params: list[nn.Parameter], lr: float, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "m" not in state:
                    state["m"] = torch.zeros_like(p)
                m = state["m"]
                m.mul_(group["beta"]).add_(p.grad, alpha=1.0 - group["beta"])
                p.sub_(torch.sign(m), alpha=group["lr"])


def make_trace(kind: str, model: nn.Module, generator: torch.Generator, args: argparse.Namespace) -> tuple[Any, Any, float]:
    """(optimizer, gradients, lr) of a trace."""
    params = [p for _, p in _named(model)]
    if kind == "adamw":
        optimizer: torch.optim.Optimizer = torch.optim.AdamW(
            params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True
        )
        return optimizer, SimulatedGradients(params, generator), args.lr
    # fresh N(0, 1) gradients each step (rho 0, unit scales): the sign only sees their direction
    grads = SimulatedGradients(params, generator, rho=0.0, base=1.0, tensor_sigma=0.0, step_sigma=0.0)
    return SignMomentum(params, args.sign_lr), grads, args.sign_lr


def _named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    from deltasync.trainer.detector import named_parameters

    return list(named_parameters(model))


# --------------------------------------------------------------------------- instrumentation


class ViewProbe:
    """Times a publisher's view chains and records what their deltas hold, changing nothing:
    wraps each chain's ``publish_delta`` and ``_quantize`` (instance attributes) and the view
    module's ``delta_pieces`` (module attribute, restored by :meth:`close`)."""

    def __init__(self, publisher: DeltaPublisher) -> None:
        self.chains = {chain.name: chain for chain in publisher._views}
        self.current: str | None = None
        self.reset()
        for name, chain in self.chains.items():
            chain.publish_delta = self._timed(name, "publish_s", chain.publish_delta)  # type: ignore[method-assign]
            chain._quantize = self._timed(name, "quantize_s", chain._quantize)  # type: ignore[method-assign]
        self._encode = view_chain_module.delta_pieces
        view_chain_module.delta_pieces = self._encode_probe  # type: ignore[assignment]

    def reset(self) -> None:
        self.times: dict[str, dict[str, float]] = {n: {"publish_s": 0.0, "quantize_s": 0.0, "encode_s": 0.0} for n in self.chains}
        self.changes: dict[str, dict[str, Change]] = {}

    def _timed(self, name: str, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            outer = self.current
            self.current = name
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.times[name][key] += time.perf_counter() - t0
                self.current = outer

        return wrapper

    def _encode_probe(self, changes: dict[str, Change], **kwargs: Any) -> list[memoryview]:
        assert self.current is not None
        self.changes[self.current] = dict(changes)
        t0 = time.perf_counter()
        try:
            return self._encode(changes, **kwargs)
        finally:
            self.times[self.current]["encode_s"] += time.perf_counter() - t0

    def close(self) -> None:
        view_chain_module.delta_pieces = self._encode  # type: ignore[assignment]


# --------------------------------------------------------------------------- one trace


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _diff_count(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((_bits(a) != _bits(b)).sum())


def _fail(message: str) -> None:
    raise SystemExit(f"FAIL: {message}")


def run_trace(kind: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(args.seed)
    shape = ModelShape().scaled(args.scale)
    model = linearize(build_model(shape, generator))
    named = _named(model)
    total = sum(p.numel() for _, p in named)
    optimizer, grads, lr = make_trace(kind, model, generator, args)
    log(f"[{kind}] {len(named)} tensors, {total / 1e6:.1f}M parameters, lr {lr:g}; {args.warmup} warm-up steps")
    for _ in range(args.warmup):
        grads.step()
        optimizer.step()
    bucket = os.path.join(tmp, f"bucket-{kind}")
    publisher = DeltaPublisher(
        bucket, model, optimizer, views=tuple(args.views), anchor_every=1 << 30, anchor_bytes_ratio=0.0
    )
    schemes = {name: get_scheme(name) for name in args.views}
    chains = {chain.name: chain for chain in publisher._views}
    targets = sorted(next(iter(chains.values())).targets)
    target_set = set(targets)
    quantized = sum(p.numel() for n, p in named if n in target_set)
    log(f"[{kind}] {len(targets)} quantized weights ({quantized / 1e6:.1f}M parameters, {quantized / total:.1%}); "
        f"the rest ({(total - quantized) / 1e6:.1f}M: embedding, norms, biases) stays bf16 in the views")  # fmt: skip
    t0 = time.perf_counter()
    first = publisher.publish()
    log(f"[{kind}] version {first.version}: anchors (bf16 {first.nbytes / 1e6:.0f} MB, views "
        + ", ".join(f"{v} {b / 1e6:.0f} MB" for v, b in first.view_nbytes.items()) + f") in {time.perf_counter() - t0:.1f}s")  # fmt: skip
    receivers = {name: DeltaReceiver(bucket, view=name) for name in args.views}
    for receiver in receivers.values():
        receiver.sync()
    probe = ViewProbe(publisher)
    captured: dict[str, dict[str, Change]] = {}
    bf16_encode = _capture_bf16_changes(captured)
    previous: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    state0 = bf16_state_dict(model)
    for name, scheme in schemes.items():
        previous[name] = {t: scheme.quantize(state0[t]) for t in targets}
    del state0
    records: list[dict[str, Any]] = []
    full_path = os.path.join(tmp, "full-view.safetensors")
    try:
        for step in range(1, args.steps + 1):
            rec: dict[str, Any] = {"step": step}
            t0 = time.perf_counter()
            grads.step()
            optimizer.step()
            rec["train_s"] = time.perf_counter() - t0
            probe.reset()
            captured.clear()
            t0 = time.perf_counter()
            future = publisher.submit()
            rec["detect_s"] = time.perf_counter() - t0
            result = future.result()
            if result.anchor_scheduled or result.warnings or set(result.view_nbytes) != set(args.views):
                _fail(f"[{kind}] step {step}: unexpected publish result {result}")
            rec["bf16_bytes"] = result.nbytes
            rec["changed"] = result.changed
            rec["changed_pct"] = 100.0 * result.changed / total
            bf16_changes = captured["bf16"]
            on_targets = {n: c for n, c in bf16_changes.items() if n in target_set}
            rest = {n: c for n, c in bf16_changes.items() if n not in target_set}
            rec["bf16_targets_changed_pct"] = 100.0 * sum(c.index.numel() for c in on_targets.values()) / quantized
            rec["bf16_rest_changed_pct"] = 100.0 * sum(c.index.numel() for c in rest.values()) / max(total - quantized, 1)
            rec["bf16_targets_bytes"] = len(bf16_encode(on_targets))
            rec["bf16_rest_bytes"] = len(bf16_encode(rest))

            state = bf16_state_dict(model)  # the trainer's bf16 state at this version
            for name, scheme in schemes.items():
                p = f"{name}."
                times = probe.times[name]
                rec[p + "bytes"] = result.view_nbytes[name]
                rec[p + "ratio"] = result.view_nbytes[name] / result.nbytes
                view_changes = probe.changes[name]
                codes = {k: c for k, c in view_changes.items() if k in target_set}
                scales = {k: c for k, c in view_changes.items() if k.endswith("weight_scale")}
                rec[p + "quantized_bytes"] = len(bf16_encode({**codes, **scales}))
                rec[p + "quantized_ratio"] = rec[p + "quantized_bytes"] / rec["bf16_targets_bytes"]
                rec[p + "publish_s"] = times["publish_s"]
                rec[p + "quantize_s"] = times["quantize_s"]
                rec[p + "encode_s"] = times["encode_s"]
                rec[p + "other_s"] = times["publish_s"] - times["quantize_s"] - times["encode_s"]
                rec[p + "detect_publish_s"] = rec["detect_s"] + times["publish_s"]

                # Baseline: a full quantized write of the view, from the trainer's bf16 state.
                t0 = time.perf_counter()
                full = {t: scheme.quantize(state[t]) for t in targets}
                rec[p + "full_quantize_s"] = time.perf_counter() - t0
                tensors: dict[str, torch.Tensor] = {}
                for n, value in state.items():
                    if n in full:
                        tensors[n] = full[n]["weight"]
                        tensors[n + "_scale"] = full[n]["weight_scale"]
                    else:
                        tensors[n] = value
                t0 = time.perf_counter()
                save_file(tensors, full_path)
                rec[p + "full_write_s"] = time.perf_counter() - t0
                rec[p + "full_bytes"] = os.path.getsize(full_path)
                os.remove(full_path)
                del tensors
                baseline = rec[p + "full_quantize_s"] + rec[p + "full_write_s"]
                rec[p + "time_vs_full"] = rec[p + "detect_publish_s"] / baseline
                rec[p + "time_vs_full_write"] = rec[p + "detect_publish_s"] / rec[p + "full_write_s"]
                rec[p + "pct_of_full"] = 100.0 * rec[p + "bytes"] / rec[p + "full_bytes"]

                # What changed, from the baseline's quantizations, must be what the delta holds.
                before = previous[name]
                code_total = code_changed = rows_total = rows_changed = rows_touched = 0
                for t in targets:
                    moved = _diff_count(before[t]["weight"], full[t]["weight"])
                    scale_bits = _bits(before[t]["weight_scale"]) != _bits(full[t]["weight_scale"])
                    held = codes.get(t)
                    if moved != (0 if held is None else held.index.numel()):
                        _fail(f"[{kind}] step {step}: view {name}: {t!r} has {moved} changed codes, its delta holds "
                              f"{0 if held is None else held.index.numel()}")  # fmt: skip
                    held_scale = scales.get(t + "_scale")
                    if int(scale_bits.sum()) != (0 if held_scale is None else held_scale.index.numel()):
                        _fail(f"[{kind}] step {step}: view {name}: the scales of {t!r} that changed are not the delta's")
                    code_total += full[t]["weight"].numel()
                    code_changed += moved
                    rows_total += scale_bits.numel()
                    rows_changed += int(scale_bits.sum())
                    out = full[t]["weight"].shape[0]
                    row_moved = (full[t]["weight"].view(torch.uint8) != before[t]["weight"].view(torch.uint8)).any(dim=1)
                    rows_touched += int((row_moved | scale_bits.reshape(out, -1).any(dim=1)).sum())
                rec[p + "codes_changed_pct"] = 100.0 * code_changed / code_total
                rec[p + "scale_rows_changed_pct"] = 100.0 * rows_changed / rows_total
                rec[p + "rows_touched_pct"] = 100.0 * rows_touched / rows_total
                rec[p + "bf16_part_bytes"] = rec[p + "bytes"] - rec[p + "quantized_bytes"]

                # Exactness: the receiver, built only from the view's chain, holds the quantization.
                t0 = time.perf_counter()
                receivers[name].sync()
                rec[p + "receiver_sync_s"] = time.perf_counter() - t0
                got = receivers[name].state_dict()
                for n, value in state.items():
                    pairs = [(n, full[n]["weight"]), (n + "_scale", full[n]["weight_scale"])] if n in full else [(n, value)]
                    for key, want in pairs:
                        if key not in got or got[key].dtype != want.dtype or tuple(got[key].shape) != tuple(want.shape):
                            _fail(f"[{kind}] step {step}: view {name}: the receiver's {key!r} is missing or has another "
                                  "dtype or shape than compressed-tensors' quantization")  # fmt: skip
                        bad = _diff_count(got[key], want)
                        if bad:
                            _fail(f"[{kind}] step {step}: view {name}: {bad} elements of {key!r} differ between the "
                                  "receiver and compressed-tensors' quantization of the trainer's bf16 state")  # fmt: skip
                previous[name] = full
                del full
            del state
            records.append(rec)
            log(_progress(kind, rec, args.steps, args.views))
    finally:
        probe.close()
        _restore_bf16_encode()
        publisher.close()
    log(f"[{kind}] verified: every step, each view's receiver equals compressed-tensors' quantization of the "
        "trainer's bf16 state, bit for bit, and each delta holds exactly the codes and scales that changed")  # fmt: skip
    keys = [k for k, v in records[0].items() if isinstance(v, (int, float)) and k != "step"]
    return {
        "trace": kind,
        "lr": lr,
        "description": TRACE_TEXT[kind],
        "parameters": total,
        "quantized_parameters": quantized,
        "quantized_weights": len(targets),
        "steps": records,
        "medians": {k: statistics.median(r[k] for r in records) for k in keys},
    }


TRACE_TEXT = {
    "adamw": "the codec benchmark's trace: AdamW on fp32 masters, AR(1) simulated gradients (~1% bf16 changed)",
    "sign-momentum": (
        "sign-momentum (w -= lr*sign(m), m EMA beta 0.9 of fresh N(0,1) gradients) at a higher lr; "
        "a simulated gradient process standing in for an RL run, not an RL run"
    ),
}

_PUBLISHER_ENCODE: list[Any] = []


def _capture_bf16_changes(captured: dict[str, dict[str, Change]]) -> Callable[[dict[str, Change]], bytes]:
    """Record the bf16 chain's delta changes (the publisher's writer module's ``delta_pieces``, wrapped;
    restored by :func:`_restore_bf16_encode`) and return an encoder with the publisher's settings
    for subsets of changes (the bytes of parts of a delta)."""
    import deltasync.trainer.writer as writer_module

    original = writer_module.delta_pieces
    settings: dict[str, Any] = {}

    def probe(changes: dict[str, Change], **kwargs: Any) -> list[memoryview]:
        captured["bf16"] = dict(changes)
        settings.update(kwargs)
        return original(changes, **kwargs)

    def encode(changes: dict[str, Change]) -> bytes:
        # zstd's encoder needs no element counts (only the raw codec's wide-index choice reads them)
        kw = {k: settings[k] for k in ("version", "anchor", "codec", "total", "fingerprint", "base_fingerprint", "level")}
        return b"".join(original(changes, **kw))

    _PUBLISHER_ENCODE[:] = [writer_module, original]
    writer_module.delta_pieces = probe  # type: ignore[assignment]
    return encode


def _restore_bf16_encode() -> None:
    if _PUBLISHER_ENCODE:
        module, original = _PUBLISHER_ENCODE
        module.delta_pieces = original
        _PUBLISHER_ENCODE.clear()


def _progress(kind: str, rec: dict[str, Any], steps: int, views: list[str]) -> str:
    parts = [f"[{kind}] step {rec['step']}/{steps}: bf16 {rec['changed_pct']:.3f}% changed, delta {rec['bf16_bytes'] / 1e6:.2f} MB"]
    for v in views:
        p = f"{v}."
        parts.append(
            f"{v}: codes {rec[p + 'codes_changed_pct']:.3f}%, scale rows {rec[p + 'scale_rows_changed_pct']:.3f}%, "
            f"delta {rec[p + 'bytes'] / 1e6:.2f} MB ({rec[p + 'ratio']:.3f}x bf16; quantized layers "
            f"{rec[p + 'quantized_ratio']:.3f}x), detect+view {rec[p + 'detect_publish_s']:.2f}s vs full "
            f"{rec[p + 'full_quantize_s'] + rec[p + 'full_write_s']:.2f}s ({rec[p + 'time_vs_full']:.3f}x)"
        )
    return "; ".join(parts)


# --------------------------------------------------------------------------- report


def run(args: argparse.Namespace) -> dict[str, Any]:
    shape = ModelShape().scaled(args.scale)
    log(f"Qwen2.5-0.5B shapes at scale {args.scale}: {shape}; views {', '.join(args.views)}; traces {', '.join(args.traces)}")
    with tempfile.TemporaryDirectory(prefix="deltasync-views-bench-") as tmp:
        traces = [run_trace(kind, args, tmp) for kind in args.traces]
    return {
        "benchmark": "deltasync quantized views",
        "command": " ".join(["python", "benchmarks/views.py", *args.argv]),
        "config": {
            "scale": args.scale, "steps": args.steps, "warmup": args.warmup, "views": args.views, "traces": args.traces,
            "lr": args.lr, "sign_lr": args.sign_lr, "seed": args.seed, "codec": "zstd (the publisher's default, level 3)",
            "target_ratio": TARGET_RATIO,
        },
        "model": asdict(shape),
        "machine": machine(),
        "traces": traces,
    }


def table(result: dict[str, Any]) -> str:
    views = result["config"]["views"]
    lines: list[str] = []
    for trace in result["traces"]:
        m = trace["medians"]
        lines += [
            "",
            (
                f"**{trace['trace']}** ({trace['description']}; lr {trace['lr']:g}): {trace['parameters'] / 1e6:.1f}M "
                f"parameters, {trace['quantized_parameters'] / 1e6:.1f}M "
                f"({trace['quantized_parameters'] / trace['parameters']:.1%}) in {trace['quantized_weights']} quantized "
                f"weights; medians over {len(trace['steps'])} steps"
            ),
            "",
            "| per version (median) | " + " | ".join(views) + " |",
            "|---|" + "---:|" * len(views),
        ]
        rows = [
            ("bf16 elements changed (all / quantized layers / rest)", lambda v, m=m: f"{m['changed_pct']:.3f}% / "
             f"{m['bf16_targets_changed_pct']:.3f}% / {m['bf16_rest_changed_pct']:.3f}%"),
            ("codes changed", lambda v, m=m: f"{m[v + '.codes_changed_pct']:.3f}%"),
            ("channels (rows) whose scale changed", lambda v, m=m: f"{m[v + '.scale_rows_changed_pct']:.3f}%"),
            ("rows touched (a code or the scale)", lambda v, m=m: f"{m[v + '.rows_touched_pct']:.1f}%"),
            ("bf16 delta (zstd)", lambda v, m=m: f"{m['bf16_bytes'] / 1e6:.2f} MB"),
            ("view delta (zstd)", lambda v, m=m: f"{m[v + '.bytes'] / 1e6:.2f} MB"),
            ("**view delta / bf16 delta**", lambda v, m=m: f"**{m[v + '.ratio']:.3f}**"),
            ("view delta: codes and scales", lambda v, m=m: f"{m[v + '.quantized_bytes'] / 1e6:.2f} MB"),
            ("view delta: its bf16 parameters (embedding, norms, biases)", lambda v, m=m: f"{m[v + '.bf16_part_bytes'] / 1e6:.2f} MB"),
            ("quantized layers only: codes+scales / their bf16 delta", lambda v, m=m: f"{m[v + '.quantized_ratio']:.3f}"),
            ("view delta, % of the full view", lambda v, m=m: f"{m[v + '.pct_of_full']:.3f}%"),
            ("detect (bf16, shared)", lambda v, m=m: f"{m['detect_s']:.2f} s"),
            ("view: quantize changed layers", lambda v, m=m: f"{m[v + '.quantize_s']:.2f} s"),
            ("view: encode", lambda v, m=m: f"{m[v + '.encode_s']:.2f} s"),
            ("view: diff, fingerprint, read snapshot, write, commit", lambda v, m=m: f"{m[v + '.other_s']:.2f} s"),
            ("full quantized write: quantize all + save_file", lambda v, m=m: f"{m[v + '.full_quantize_s']:.2f} + "
             f"{m[v + '.full_write_s']:.2f} s"),
            ("**(detect + view delta) / full quantized write**", lambda v, m=m: f"**{m[v + '.time_vs_full']:.3f}**"),
            ("(detect + view delta) / save_file alone", lambda v, m=m: f"{m[v + '.time_vs_full_write']:.3f}"),
        ]  # fmt: skip
        lines += [f"| {label} | " + " | ".join(cell(v) for v in views) + " |" for label, cell in rows]
    return "\n".join(lines).strip()


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    traces, views = result["traces"], result["config"]["views"]
    fig, axes = plt.subplots(2, len(traces), figsize=(6.5 * len(traces), 7), squeeze=False, height_ratios=(3, 2))
    for col, trace in enumerate(traces):
        steps = [r["step"] for r in trace["steps"]]
        ax = axes[0][col]
        ax.plot(steps, [r["bf16_bytes"] / 1e6 for r in trace["steps"]], "k-", marker="s", label="bf16 delta")
        for v, color in zip(views, ("tab:blue", "tab:orange", "tab:green")):
            ax.plot(steps, [r[f"{v}.bytes"] / 1e6 for r in trace["steps"]], "-", marker="o", color=color, label=f"{v} delta")
            ax.plot(steps, [r[f"{v}.quantized_bytes"] / 1e6 for r in trace["steps"]], ":", marker=".", color=color,
                    label=f"{v}: codes + scales part")  # fmt: skip
        ax.plot(steps, [TARGET_RATIO * r["bf16_bytes"] / 1e6 for r in trace["steps"]], "r--", label=f"target {TARGET_RATIO}x bf16")
        ax.set_ylim(bottom=0)
        ax.set_ylabel("MB per version (zstd)")
        ax.set_title(f"{trace['trace']} (lr {trace['lr']:g}), {trace['parameters'] / 1e6:.0f}M params", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax = axes[1][col]
        ax.plot(steps, [r["bf16_targets_changed_pct"] for r in trace["steps"]], "k-", marker="s", label="bf16 elements (quantized layers)")
        for v, color in zip(views, ("tab:blue", "tab:orange", "tab:green")):
            ax.plot(steps, [r[f"{v}.codes_changed_pct"] for r in trace["steps"]], "-", marker="o", color=color, label=f"{v} codes")
            ax.plot(steps, [r[f"{v}.scale_rows_changed_pct"] for r in trace["steps"]], "--", marker="^", color=color,
                    label=f"{v} scale rows")  # fmt: skip
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
        ax.set_ylabel("changed per version (%)")
        ax.set_xlabel("step")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("deltasync quantized views: view delta vs bf16 delta of the same version (Qwen2.5-0.5B shapes)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the layers and vocabulary (default 1: 494M)")
    parser.add_argument("--steps", type=int, default=5, help="measured versions per trace (default 5)")
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps before version 0 (default 10)")
    parser.add_argument("--views", nargs="+", default=["FP8_DYNAMIC", "W8A8"], choices=SCHEMES, help="views to publish")
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=TRACES, help="trace settings to run")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"adamw trace: learning rate (default {DEFAULT_LR:g})")
    parser.add_argument("--sign-lr", type=float, default=DEFAULT_SIGN_LR,
                        help=f"sign-momentum trace: learning rate (default {DEFAULT_SIGN_LR:g}, ~4%% changed)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a tiny run (seconds): --scale 0.01 --steps 2 --warmup 2")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--plot", help="write a plot (PNG) to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.scale, args.steps, args.warmup = min(args.scale, 0.01), min(args.steps, 2), min(args.warmup, 2)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    if not 0 < args.scale <= 1:
        parser.error(f"--scale must be in (0, 1], got {args.scale}")
    if args.lr <= 0 or args.sign_lr <= 0:
        parser.error("learning rates must be > 0")
    args.views = list(dict.fromkeys(args.views))
    args.traces = list(dict.fromkeys(args.traces))
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    save_outputs(result, args.out, args.plot, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
