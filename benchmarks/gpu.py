"""deltasync on an accelerator, against the device's own floors, measured in one run.

Every figure is a ratio to a floor measured in the same run on the same weights:

- floors: device copy bandwidth, a plain torch change scan (per tensor: ``ne``, ``nonzero``,
  gather, indices and values to the host), a fused AdamW step of the weights, full pinned
  device-to-host and host-to-device copies, and ``safetensors.torch.save_file`` of the weights
  into the bucket's folder (and the same made durable with ``fsync``, as every bucket file is);
- a training loop ("backward": bf16 matmuls for a fixed time, then an AdamW step whose learning
  rate is set so that about ``--densities`` of the bf16 elements change per step), without
  deltasync and with a publisher (default options, ``capture="overlap"``, ``submit()`` after
  every step), in time per iteration;
- the trainer's hold per version with ``submit()`` (``capture="submit"``), capture-to-commit of
  a delta, an anchor (and one written as a single file against one written as parts at once),
  the FP8_DYNAMIC view's extra time per version (where compressed-tensors is installed), and
  the extra accelerator memory the publisher holds;
- the in-place writer on the accelerator's tensors (vLLM's server path without vLLM): the full
  fingerprint of the live weights, the stage of a delta and its write (against a full
  host-to-device load), exact after every version.

Run it on a GPU (Qwen2.5-3B shapes by default, at most about 6 minutes on one H200)::

    python benchmarks/gpu.py --out gpu.json --plot gpu.png

or on a CPU in its quick form (small shapes; what CI runs)::

    python benchmarks/gpu.py --quick --out gpu.json

It needs torch, deltasync and its core dependencies only (no vLLM). A plot of time per phase
against the floors is drawn where matplotlib is installed (``--plot-from gpu.json`` draws it
later from the JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import deltasync  # noqa: F401
except ImportError:  # a checkout without an install: import the package next to this file
    sys.path.insert(0, str(REPO))

from codec import ModelShape  # noqa: E402
from encode import spanning_delta as _spanning_delta  # noqa: E402
from scale import Weights, tensors  # noqa: E402  (Qwen2 checkpoint shapes; parameters under their names)

from deltasync import DeltaPublisher  # noqa: E402
from deltasync.trainer.publisher import PublishOptions  # noqa: E402

QWEN_3B = ModelShape(hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2, head_dim=128, vocab=151936)
QUICK = ModelShape(hidden=256, intermediate=1024, layers=4, heads=4, kv_heads=2, head_dim=64, vocab=8192)


def log(message: str) -> None:
    print(f"[gpu.py {time.strftime('%H:%M:%S')}] {message}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeat: int = 3) -> float:
    """The median seconds of ``fn`` (after one warm-up run), the device drained around each."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def build(shape: ModelShape, device: torch.device, seed: int) -> Weights:
    g = torch.Generator(device=device).manual_seed(seed)
    named = {}
    for name, size in tensors(shape):
        t = torch.empty(size, dtype=torch.bfloat16, device=device)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        named[name] = t
    return Weights(named, trainable=True)


def learning_rate(params: list[torch.Tensor], density: float) -> float:
    """The AdamW learning rate at which about ``density`` of the bf16 elements change in a step.

    With constant gradients Adam's step is ``lr`` per element; a bf16 element changes when that
    is at least half its unit in the last place, so the rate is that quantile of half-ULPs."""
    sample = torch.cat([p.detach().reshape(-1)[:: max(1, p.numel() // 20000)].float() for p in params])
    sample = sample[sample != 0].abs()
    half_ulp = torch.exp2(torch.floor(torch.log2(sample)) - 8)
    return float(torch.quantile(half_ulp.cpu(), density))


class Burn:
    """The loop's "backward": bf16 matmuls for about ``seconds`` (calibrated once)."""

    def __init__(self, device: torch.device, seconds: float) -> None:
        n = 8192 if device.type == "cuda" else 512
        self.a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        self.b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        self.device = device
        one = timed(lambda: self.a @ self.b, device, repeat=5)
        self.count = max(1, round(seconds / one))

    def __call__(self) -> None:
        for _ in range(self.count):
            self.a @ self.b


def set_grads(params: list[torch.Tensor], seed: int) -> None:
    """Constant random gradients (Adam's step is then ``lr`` on every element)."""
    g = torch.Generator(device=params[0].device).manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, dtype=p.dtype, device=p.device, generator=g)


def optimizer_for(params: list[torch.Tensor], lr: float, device: torch.device) -> torch.optim.AdamW:
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), weight_decay=0.0, fused=fused, foreach=not fused)


class Phases:
    """Seconds spent in the publisher's parts (any thread), by wrapping them where they are looked up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._lock = threading.Lock()
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        real = getattr(owner, attr)
        phases = self

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                with phases._lock:
                    phases.seconds[label] = phases.seconds.get(label, 0.0) + time.perf_counter() - start

        self._undo.append((owner, attr, real))
        setattr(owner, attr, timed_call)

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self.seconds = self.seconds, {}
        return out

    def close(self) -> None:
        for owner, attr, real in reversed(self._undo):
            setattr(owner, attr, real)


def publisher_phases() -> Phases:
    import deltasync.trainer.capture as capture
    import deltasync.trainer.publisher as publisher
    import deltasync.trainer.writer as writer
    from deltasync.stores import LocalStore
    from deltasync.trainer.detector import BF16ChangeDetector

    phases = Phases()
    phases.wrap(BF16ChangeDetector, "changes", "capture: detect")
    phases.wrap(capture.ChangeCapture, "_local_changes", "capture: all")
    phases.wrap(writer, "delta_pieces", "delta: encode")
    phases.wrap(LocalStore, "write_stream", "store: write")
    phases.wrap(writer.ChainWriter, "_commit", "commit: history + pointer")
    phases.wrap(BF16ChangeDetector, "commit", "commit: snapshot")
    phases.wrap(publisher, "release_free_memory", "release freed memory")
    phases.wrap(writer.ChainWriter, "write_anchor", "anchor: write")
    return phases


# --------------------------------------------------------------------------- floors


def floors(model: Weights, device: torch.device, bucket: Path) -> dict[str, float]:
    params = [p.detach() for p in model.parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    out: dict[str, float] = {"weights_bytes": nbytes}
    copies = [torch.empty_like(p) for p in params]

    def copy_all() -> None:
        for c, p in zip(copies, params):
            c.copy_(p)

    t = timed(copy_all, device)
    out["copy_bandwidth_gbs"] = 2 * nbytes / t / 1e9
    out["read_twice_s"] = 2 * nbytes / (out["copy_bandwidth_gbs"] * 1e9)
    # the plain scan: against a copy with ~1% of the elements one ULP away
    for c in copies:
        flat = c.view(-1).view(torch.int16)
        flat[:: 100] += 1

    def scan() -> None:
        for c, p in zip(copies, params):
            a, b = c.view(-1), p.view(-1)
            idx = torch.ne(a.view(torch.int16), b.view(torch.int16)).nonzero().reshape(-1)
            idx.cpu(), a[idx].cpu(), b[idx].cpu()

    out["scan_s"] = timed(scan, device)
    copies.clear()
    gc.collect()
    pin = device.type == "cuda"
    host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in params]

    def d2h() -> None:
        for h, p in zip(host, params):
            h.copy_(p, non_blocking=True)

    def h2d() -> None:
        for h, p in zip(host, params):
            p.copy_(h, non_blocking=True)

    out["d2h_s"] = timed(d2h, device, repeat=2)
    out["h2d_s"] = timed(h2d, device, repeat=2)
    from safetensors.torch import save_file

    state = dict(zip([n for n, _ in model.named_parameters()], host))

    def save() -> None:
        save_file(state, str(bucket / "save_file.safetensors"))

    start = time.perf_counter()
    save()
    out["save_file_s"] = time.perf_counter() - start
    # and made durable, as every bucket file is (an anchor fsyncs before its rename)
    fd = os.open(bucket / "save_file.safetensors", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    out["save_file_fsync_s"] = time.perf_counter() - start
    (bucket / "save_file.safetensors").unlink()
    host.clear()
    state.clear()
    gc.collect()
    return out


def adamw_step_s(model: Weights, device: torch.device, lr: float) -> float:
    params = list(model.parameters())
    saved = [p.detach().clone() for p in params]
    opt = optimizer_for(params, lr, device)
    t = timed(opt.step, device, repeat=3)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    del opt, saved
    return t


# --------------------------------------------------------------------------- the loop


def changed_share(before: list[torch.Tensor], params: list[torch.Tensor]) -> float:
    changed = sum(int(torch.ne(a.view(torch.int16), b.detach().view(torch.int16)).sum()) for a, b in zip(before, params))
    return changed / sum(p.numel() for p in params)


def training_loop(model: Weights, device: torch.device, burn: Burn, lr: float, iters: int, bucket: Path | None,
                  options: PublishOptions | None) -> dict[str, Any]:  # fmt: skip
    """Time per iteration of burn + AdamW step (+ ``submit()`` after every step with a publisher)."""
    params = list(model.parameters())
    opt = optimizer_for(params, lr, device)
    publisher = None
    out: dict[str, Any] = {}
    if device.type == "cuda":  # the optimizer's state first: the publisher's memory is what comes after
        opt.step()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        out["memory_before"] = torch.cuda.memory_allocated(device)
    if bucket is not None:
        assert options is not None
        start = time.perf_counter()
        publisher = DeltaPublisher(str(bucket), model, opt, options=options)
        publisher.publish()  # version 0: the anchor of the starting weights
        out["first_anchor_s"] = time.perf_counter() - start
    before = [p.detach().clone() for p in params[:8]]
    futures, times, holds = [], [], []
    phases = publisher_phases() if publisher is not None else None
    for i in range(iters + 1):
        sync(device)
        start = time.perf_counter()
        burn()
        opt.step()
        if publisher is not None:
            t = time.perf_counter()
            futures.append(publisher.submit())
            holds.append(time.perf_counter() - t)
        sync(device)
        if i:  # the first iteration warms up
            times.append(time.perf_counter() - start)
        if i == 0:
            out["changed_share"] = changed_share(before, params[:8])
            del before
    if publisher is not None:
        results = [f.result() for f in futures]
        assert phases is not None
        out["phases_per_version_s"] = {k: v / len(results) for k, v in phases.take().items()}
        phases.close()
        log("  per version: " + ", ".join(f"{k} {v:.3f} s" for k, v in out["phases_per_version_s"].items()))
        out["blocked_s"] = [r.blocked_s for r in results[1:]]
        out["commit_s"] = [r.seconds for r in results[1:]]
        out["submit_call_s"] = holds[1:]
        out["changed"] = [r.changed for r in results[1:]]
        out["delta_nbytes"] = [r.nbytes for r in results[1:]]
        out["fingerprint_ok"] = results[-1].fingerprint == publisher.fingerprint
        publisher.close()
    out["iteration_s"] = times
    if device.type == "cuda":
        out["memory_peak"] = torch.cuda.max_memory_allocated(device) - out["memory_before"]
    del opt
    for p in params:
        p.grad = p.grad  # kept: the next loop reuses them
    return out


def submit_mode(model: Weights, device: torch.device, lr: float, iters: int, bucket: Path, views: tuple[str, ...] = (),
                before_anchor: Callable[[], Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """``capture="submit"``: the trainer's hold per version, capture-to-commit, an anchor
    (``before_anchor`` runs on the bucket of anchor 0 and the deltas first)."""
    params = list(model.parameters())
    opt = optimizer_for(params, lr, device)
    options = PublishOptions(capture="submit", anchor_every=1000, anchor_bytes_ratio=0.0, views=views)
    start = time.perf_counter()
    publisher = DeltaPublisher(str(bucket), model, opt, options=options)
    publisher.publish()
    out: dict[str, Any] = {"first_anchor_s": time.perf_counter() - start}
    holds, commits, changed, detect = [], [], [], []
    phases = publisher_phases()
    try:
        for _ in range(iters):
            opt.step()
            sync(device)
            t = time.perf_counter()
            future = publisher.submit()
            holds.append(time.perf_counter() - t)
            detect.append(dict(publisher.detector.last_timing))
            result = future.result()
            commits.append(result.seconds)
            changed.append(result.changed)
        out["phases_per_version_s"] = {k: v / iters for k, v in phases.take().items()}
    finally:
        phases.close()
    out.update(hold_s=holds, commit_s=commits, changed=changed, detect_timing=detect)
    log("  per version: " + ", ".join(f"{k} {v:.3f} s" for k, v in out["phases_per_version_s"].items()))
    log(f"  detect: {detect[-1]}")
    if before_anchor is not None:
        out["before_anchor"] = before_anchor()
    # an anchor of the newest version, written beside its delta and waited for
    opt.step()
    t = time.perf_counter()
    publisher.publish(anchor=True)
    publisher.flush()
    out["anchor_s"] = time.perf_counter() - t
    out["fingerprint"] = publisher.fingerprint
    out["snapshot_devices"] = sorted(set(publisher.detector.snapshot_devices.values()))
    publisher.close()
    del opt
    return out


def _one_thread_and_all(variable: str, run: Callable[[], object], count: int) -> dict[str, float]:
    """``run`` timed with ``variable`` set to one thread and unset (the host's cores)."""
    out: dict[str, float] = {"threads": count}
    saved = os.environ.get(variable)
    try:
        for label, value in (("one_thread_s", "1"), ("all_cores_s", None)):
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
            out[label] = timed(run, torch.device("cpu"), repeat=3)
    finally:
        if saved is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved
    out["ratio"] = out["all_cores_s"] / out["one_thread_s"]
    return out


def anchor_split(model: Weights, device: torch.device, lr: float, root: Path, part_bytes: int) -> dict[str, Any]:
    """An anchor beside a delta, waited for, written as one file and as parts of ``part_bytes``
    (each publisher's first anchor is timed too); the two buckets' newest states must agree."""
    from deltasync import DeltaReceiver
    from deltasync.format import ANCHOR_PART_BYTES

    out: dict[str, Any] = {"part_bytes": part_bytes, "default_part_bytes": ANCHOR_PART_BYTES}
    fingerprints = []
    params = list(model.parameters())
    for label, size in (("one_file", 1 << 62), ("parts", part_bytes)):
        bucket = root / f"anchor-{label}"
        opt = optimizer_for(params, lr, device)
        options = PublishOptions(capture="submit", anchor_every=1000, anchor_bytes_ratio=0.0, anchor_part_bytes=size)
        start = time.perf_counter()
        publisher = DeltaPublisher(str(bucket), model, opt, options=options)
        publisher.publish()
        out[f"{label}_first_s"] = time.perf_counter() - start
        opt.step()
        sync(device)
        start = time.perf_counter()
        publisher.publish(anchor=True)
        publisher.flush()
        out[f"{label}_s"] = time.perf_counter() - start
        pointer = publisher.pointer
        assert pointer is not None
        out[f"{label}_files"] = len(pointer.anchors[-1].files)
        fingerprints.append(publisher.fingerprint)
        publisher.close()
        late = DeltaReceiver(str(bucket))
        late.sync()
        out[f"{label}_read_back"] = late.fingerprint == publisher.fingerprint
        del late, opt
        shutil.rmtree(bucket, ignore_errors=True)
    out["ratio"] = out["parts_s"] / out["one_file_s"]
    return out


def hash_threads(elements: int) -> dict[str, float]:
    """The fingerprint of ``elements`` host bf16 values (what a CPU server's full fingerprint and
    a host move hash), with one thread and with the host's cores; the sums must agree."""
    from deltasync.format.fingerprint import fingerprint_slice_share, hash_threads

    values = torch.randn(elements).to(torch.bfloat16)
    sums = set()

    def run() -> None:
        sums.add(fingerprint_slice_share("model.layers.0.mlp.up_proj.weight", values, 0))

    out = _one_thread_and_all("DELTASYNC_HASH_THREADS", run, hash_threads())
    return {"elements": elements, "exact": len(sums) == 1, **out}


def encode_threads(changes: int, tensors: int = 64) -> dict[str, float]:
    """A zstd delta spanning ``tensors`` tensors, encoded with one thread and with the host's cores."""
    from deltasync.format.codecs.zstd import ZstdCodec, encode_threads

    items, _ = _spanning_delta(changes, tensors)
    out = _one_thread_and_all(
        "DELTASYNC_ENCODE_THREADS", lambda: ZstdCodec().encode(items, numels=None, level=3), encode_threads()
    )
    return {"changes": changes, **out}


def decode_threads(changes: int, tensors: int = 64) -> dict[str, float]:
    """The same delta decoded (what a server's staging does first), with one thread and with
    the host's cores; checked against what was encoded."""
    from deltasync.format.codecs.base import DeltaContext
    from deltasync.format.codecs.zstd import ZstdCodec, decode_threads

    items, state = _spanning_delta(changes, tensors)
    codec = ZstdCodec()
    encoded = codec.encode(items, numels=None, level=3)
    context = DeltaContext(
        where="benchmark", names=tuple(name for name, _ in items), changed=sum(c.index.numel() for _, c in items),
        numels={name: t.numel() for name, t in state.items()}, base_values=lambda name, index: state[name][index],
    )  # fmt: skip
    decoded = codec.decode(encoded, context)
    exact = all(
        torch.equal(decoded[name].index, c.index) and torch.equal(decoded[name].new.view(torch.int16), c.new.view(torch.int16))
        for name, c in items
    )
    out = _one_thread_and_all("DELTASYNC_DECODE_THREADS", lambda: codec.decode(encoded, context), decode_threads())
    return {"changes": changes, "exact": exact, **out}


# --------------------------------------------------------------------------- in-place writer


def inplace(bucket: Path, device: torch.device, h2d_s: float) -> dict[str, Any]:
    from deltasync import DeltaReceiver
    from deltasync.reader.chain import ChainReader, read_pointer
    from deltasync.stores import LocalStore
    from deltasync.server.inplace import InPlaceState
    from deltasync.server.weight_map import discover

    store = LocalStore(str(bucket))
    pointer = read_pointer(store)
    first = pointer.anchors[0].version  # the bucket holds anchor 0 and the deltas after it
    receiver = DeltaReceiver(str(bucket))
    receiver.sync(first)
    state = receiver.state_dict()
    model = Weights({n: t.to(device) for n, t in state.items()}, trainable=False)
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    fingerprint = receiver.fingerprint
    del receiver, state
    gc.collect()
    sync(device)
    import deltasync.format.codecs.zstd as zstd_codec

    phases = Phases()
    phases.wrap(zstd_codec, "_decode", "stage: decode")
    phases.wrap(InPlaceState, "read", "stage: read live values")
    phases.wrap(InPlaceState, "_share_move", "stage: fingerprint move")
    start = time.perf_counter()
    wmap = discover(model, shapes)
    live = InPlaceState(model, wmap, lambda obj: [obj], 0, model.load_weights)
    sync(device)
    setup = time.perf_counter() - start
    t = time.perf_counter()
    full = live.full_fingerprint()
    full_s = time.perf_counter() - t
    out: dict[str, Any] = {"setup_s": setup, "full_fingerprint_s": full_s, "exact_at_start": full == fingerprint}
    live.commit(first, fingerprint or "")
    steps = []
    for v in range(first + 1, pointer.version + 1):
        reader = ChainReader(store, pointer)
        t = time.perf_counter()
        staged = live.stage_deltas(reader, v)
        stage = time.perf_counter() - t
        t = time.perf_counter()
        fp = live.check_chain(staged, [staged.shares])
        live.write(staged)
        sync(device)
        write = time.perf_counter() - t
        live.commit(v, fp)
        steps.append({"version": v, "changed": staged.changed, "stage_s": stage, "write_s": write,
                      "write_vs_h2d": write / h2d_s, "exact": fp == pointer.fingerprint_at(v)})  # fmt: skip
        steps[-1]["phases"] = phases.take()
        log(f"  in place v{v}: {staged.changed:,} changed, stage {stage:.3f} s, write {write * 1e3:.1f} ms; "
            + ", ".join(f"{k} {t:.3f} s" for k, t in steps[-1]["phases"].items()))  # fmt: skip
    phases.close()
    out["steps"] = steps
    out["exact"] = live.verify()["ok"] and all(s["exact"] for s in steps)
    return out


# --------------------------------------------------------------------------- report


def ratios(r: dict[str, Any]) -> dict[str, float]:
    f = r["floors"]
    out: dict[str, float] = {}
    for key, loop in r["loops"].items():
        if key.startswith("publishing"):
            plain = statistics.median(r["loops"][key.replace("publishing", "plain")]["iteration_s"])
            out[f"loop {key} / plain"] = statistics.median(loop["iteration_s"]) / plain
    s = r["submit"]
    out["submit hold / scan"] = statistics.median(s["hold_s"]) / f["scan_s"]
    out["capture-to-commit / scan"] = statistics.median(s["commit_s"]) / f["scan_s"]
    out["anchor / save_file"] = s["anchor_s"] / f["save_file_s"]
    if "save_file_fsync_s" in f:
        out["anchor / (save_file + fsync)"] = s["anchor_s"] / f["save_file_fsync_s"]
    if "anchor_split" in r:
        out["anchor: parts / one file"] = r["anchor_split"]["ratio"]
    if "phases_per_version_s" in s:
        out["capture: detect / scan"] = s["phases_per_version_s"]["capture: detect"] / f["scan_s"]
    if "encode_threads" in r:
        out["encode: all cores / one thread"] = r["encode_threads"]["ratio"]
    if "decode_threads" in r:
        out["decode: all cores / one thread"] = r["decode_threads"]["ratio"]
    if "hash_threads" in r:
        out["host fingerprint: all cores / one thread"] = r["hash_threads"]["ratio"]
    if "view" in r:
        out["FP8_DYNAMIC extra / bf16 publish"] = (statistics.median(r["view"]["commit_s"]) - statistics.median(s["commit_s"])) / statistics.median(s["commit_s"])
    if "inplace" in r:
        ip = r["inplace"]
        out["in place full fingerprint (s)"] = ip["full_fingerprint_s"]
        out["in place stage (s)"] = statistics.median(x["stage_s"] for x in ip["steps"])
        out["in place write / h2d"] = statistics.median(x["write_vs_h2d"] for x in ip["steps"])
    if "memory" in r:
        out["extra device memory - snapshot (MiB)"] = r["memory"]["extra_minus_snapshot_mib"]
    return out


def plot(r: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f = r["floors"]
    s = r["submit"]
    bars = [
        ("floor: plain scan", f["scan_s"], "tab:gray"),
        ("floor: AdamW step", f["adamw_step_s"], "tab:gray"),
        ("floor: D2H copy", f["d2h_s"], "tab:gray"),
        ("floor: save_file", f["save_file_s"], "tab:gray"),
        *([("floor: save_file + fsync", f["save_file_fsync_s"], "tab:gray")] if "save_file_fsync_s" in f else []),
        ("submit() hold", statistics.median(s["hold_s"]), "tab:blue"),
        ("capture to commit", statistics.median(s["commit_s"]), "tab:blue"),
        ("anchor", s["anchor_s"], "tab:blue"),
    ]
    for key, loop in r["loops"].items():
        bars.append((f"iteration {key}", statistics.median(loop["iteration_s"]), "tab:orange" if key.startswith("publishing") else "tab:gray"))
    if "inplace" in r:
        ip = r["inplace"]
        bars += [("in place: full fingerprint", ip["full_fingerprint_s"], "tab:green"),
                 ("in place: stage", statistics.median(x["stage_s"] for x in ip["steps"]), "tab:green"),
                 ("in place: write", statistics.median(x["write_s"] for x in ip["steps"]), "tab:green"),
                 ("floor: H2D load", f["h2d_s"], "tab:gray")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(9, 0.38 * len(bars) + 1.2))
    ax.barh([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("seconds (log scale)")
    ax.set_title(f"deltasync on {r['device_name']}: {r['params'] / 1e9:.2f}B bf16 parameters (gray: floors)")
    for i, b in enumerate(bars):
        ax.text(b[1], i, f" {b[1]:.3g} s", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (the CPU form CI runs)")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--densities", default="0.01,0.039", help="shares of bf16 elements changed per step")
    parser.add_argument("--iters", type=int, default=None, help="measured loop iterations (default 6, quick 3)")
    parser.add_argument("--backward", type=float, default=None, help="seconds of the loop's matmuls (default 0.87, quick 0.2)")
    parser.add_argument("--bucket", default=None, help="folder for the buckets (default: a temporary one)")
    parser.add_argument("--no-inplace", action="store_true")
    parser.add_argument("--no-view", action="store_true")
    parser.add_argument("--no-anchor-split", action="store_true", help="skip the anchor as one file against parts")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--plot", default=None, help="draw time per phase against the floors here (needs matplotlib)")
    parser.add_argument("--plot-from", default=None, help="only draw --plot from this JSON")
    args = parser.parse_args()
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text()), args.plot or "gpu.png")
        return
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = QUICK if args.quick else QWEN_3B
    iters = args.iters or (3 if args.quick else 6)
    densities = [float(x) for x in args.densities.split(",")]
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    r: dict[str, Any] = {"device": str(device), "device_name": name, "torch": torch.__version__, "quick": args.quick,
                         "shape": shape.__dict__, "host_cores": os.cpu_count()}  # fmt: skip
    def save() -> None:  # after every phase: a run cut short keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps(r, indent=1, default=str))

    root = Path(args.bucket or tempfile.mkdtemp(prefix="deltasync-gpu-"))
    root.mkdir(parents=True, exist_ok=True)
    log(f"{name}: building {sum(math.prod(s) for _, s in tensors(shape)) / 1e9:.2f}B parameters")
    model = build(shape, device, seed=0)
    params = list(model.parameters())
    r["params"] = sum(p.numel() for p in params)
    set_grads(params, seed=1)
    f = floors(model, device, root)
    lrs = {d: learning_rate(params, d) for d in densities}
    f["adamw_step_s"] = adamw_step_s(model, device, lrs[densities[0]])
    r["floors"] = f
    r["encode_threads"] = encode_threads(4_000_000 if args.quick else 40_000_000)
    log(f"encode: {r['encode_threads']}")
    r["decode_threads"] = decode_threads(4_000_000 if args.quick else 40_000_000)
    log(f"decode: {r['decode_threads']}")
    r["hash_threads"] = hash_threads(16_000_000 if args.quick else 160_000_000)
    log(f"hash: {r['hash_threads']}")
    save()
    log("floors: " + ", ".join(f"{k} {v:.4g}" for k, v in f.items()))
    burn = Burn(device, args.backward or (0.2 if args.quick else 0.87))
    r["loops"] = {}
    for d in densities:
        key = f"{d:.1%}"
        r["loops"][f"plain {key}"] = training_loop(model, device, burn, lrs[d], iters, None, None)
        bucket = root / f"loop-{key}"
        loop = training_loop(model, device, burn, lrs[d], iters, bucket, PublishOptions(capture="overlap"))
        if device.type == "cuda":
            snapshot = 2 * r["params"]
            # the publishing loop's peak over the plain loop's (both after the optimizer's state)
            extra = loop["memory_peak"] - r["loops"][f"plain {key}"]["memory_peak"]
            r["memory"] = {"extra_mib": extra / 2**20, "snapshot_mib": snapshot / 2**20,
                           "extra_minus_snapshot_mib": (extra - snapshot) / 2**20}  # fmt: skip
        r["loops"][f"publishing {key}"] = loop
        shutil.rmtree(bucket, ignore_errors=True)
        save()
        log(f"loop at {key}: without {statistics.median(r['loops'][f'plain {key}']['iteration_s']):.3f} s/it, "
            f"with {statistics.median(loop['iteration_s']):.3f} s/it (changed {loop['changed_share']:.2%}; "
            f"optimizer step held {statistics.median(loop['blocked_s']):.3f} s, commit {statistics.median(loop['commit_s']):.3f} s)")  # fmt: skip
    bucket = root / "submit"
    measure_inplace = None if args.no_inplace else (lambda: inplace(bucket, device, f["h2d_s"]))
    r["submit"] = submit_mode(model, device, lrs[densities[0]], 3, bucket, before_anchor=measure_inplace)
    s = r["submit"]
    if not args.no_inplace:
        r["inplace"] = s.pop("before_anchor")
    log(f"submit: hold {statistics.median(s['hold_s']):.3f} s, capture-to-commit {statistics.median(s['commit_s']):.3f} s, "
        f"anchor {s['anchor_s']:.2f} s (save_file {f['save_file_s']:.2f} s), snapshot on {s['snapshot_devices']}")  # fmt: skip
    shutil.rmtree(bucket, ignore_errors=True)
    save()
    from deltasync.format import ANCHOR_PART_BYTES

    if not args.no_anchor_split:
        # in the quick form a quarter of the weights (the default part is larger than them)
        r["anchor_split"] = anchor_split(model, device, lrs[densities[0]], root,
                                         max(1, int(f["weights_bytes"]) // 4) if args.quick else ANCHOR_PART_BYTES)  # fmt: skip
        log(f"anchor: {r['anchor_split']}")
        save()
    if not args.no_view:
        try:
            import compressed_tensors  # noqa: F401

            vb = root / "view"
            r["view"] = submit_mode(model, device, lrs[densities[0]], 3, vb, views=("FP8_DYNAMIC",))
            shutil.rmtree(vb, ignore_errors=True)
        except ImportError:
            log("no compressed-tensors: the FP8_DYNAMIC view is not measured")
    r["ratios"] = ratios(r)
    r["seconds"] = time.perf_counter() - started
    for k, v in r["ratios"].items():
        log(f"  {k}: {v:.3f}")
    log(f"done in {r['seconds']:.0f} s")
    save()
    if args.plot:
        try:
            plot(r, args.plot)
        except ImportError:
            log("no matplotlib: draw the plot later with --plot-from")
    if not args.bucket:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
