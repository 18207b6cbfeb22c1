"""How deltasync's costs grow: with model size, with density, and with the followers of one bucket.

Three sweeps, each through the package's own code on a local bucket:

1. **Size**: Qwen2.5-shaped bf16 weights (the codec benchmark's 0.5B shape scaled to 0.1B, then
   Qwen2.5-0.5B, 1.5B and 3B) changed directly, ~1% of the elements of every tensor by one ULP
   per version (no fp32 master weights or optimizer: the publisher holds the bf16 weights and
   its snapshot only, so 3B fits this 24 GiB machine). A publisher process writes the anchor
   (version 0) and four deltas: detect, encode and commit times, bytes, its peak RSS. Then a
   reader process, with the publisher gone: a receiver loads the anchor and stages and applies
   deltas 1 and 2; the in-place writer (``deltasync.server.inplace``, the vLLM-free part: one rank, a
   module whose parameters are the checkpoint's tensors) stages and writes deltas 3 and 4 into
   those tensors, and its full fingerprint must equal the bucket's; a late joiner catches up from
   the anchor and four deltas.
2. **Density**: at one size, one delta each at 0.1%, 1%, 5% and 20% changed: bytes per changed
   element, publish time against the anchor's full write, and the density from which an anchor
   would cost less.
3. **Followers**: 1, 8 and 64 followers (receivers in up to 8 processes, threads within) on one
   bucket, each through a :class:`_counting_store.CountingStore` that adds a request latency and
   counts requests and bytes. The trainer commits a version every ``--period`` seconds; each
   follower polls with :class:`deltasync.reader.poll.PollPolicy` (or a fixed poll, for comparison) and
   stages and applies every version it sees: commit-to-staged p50 and p99, requests and bytes
   per follower per version. The policy's reads per follower-hour at real trainer steps come
   from the same policy driven by a simulated clock.

Run from the repository root: ``python benchmarks/scale.py --quick`` (seconds), or the reference
run in benchmarks/README.md. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import multiprocessing as mp
import queue as queue_module
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

try:
    import deltasync  # noqa: F401
except ImportError:  # a checkout without an install: import the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _counting_store import CountingStore
from _machine import machine
from codec import ModelShape

from deltasync import DeltaPublisher, DeltaReceiver
from deltasync.reader.poll import PointerWatch, PollOptions, PollPolicy
from deltasync.stores import LocalStore

SIZES = {
    "0.1B": ModelShape().scaled(0.2),
    "0.5B": ModelShape(),
    "1.5B": ModelShape(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, head_dim=128),
    "3B": ModelShape(hidden=2048, intermediate=11008, layers=36, heads=16, kv_heads=2, head_dim=128),
}
QUICK_SIZES = {
    "tiny-2": ModelShape(hidden=128, intermediate=512, layers=2, heads=2, kv_heads=1, head_dim=64, vocab=1024),
    "tiny-8": ModelShape(hidden=128, intermediate=512, layers=8, heads=2, kv_heads=1, head_dim=64, vocab=4096),
}
DENSITIES = (0.001, 0.01, 0.05, 0.20)
TARGETS = {
    "time_per_changed_spread": ("publish time per changed element, largest vs smallest size", "within", 0.25),
    "publisher_rss_ratio": ("publisher peak RSS beyond the trainer's weights / bf16 bytes", "<=", 1.3),
    "p99_ratio_64": ("follower p99 commit-to-staged, most followers vs one", "<=", 2.0),
    "reads_per_hour_60s": ("pointer reads per follower-hour at a 60 s trainer step", "<=", 200),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- weights


def tensors(shape: ModelShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of a Qwen2 checkpoint of this shape (tied LM head), name and shape."""
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q", q), ("k", kv), ("v", kv)):
            out += [(f"{p}self_attn.{proj}_proj.weight", (rows, h)), (f"{p}self_attn.{proj}_proj.bias", (rows,))]
        out += [(f"{p}self_attn.o_proj.weight", (h, q)), (f"{p}mlp.gate_proj.weight", (shape.intermediate, h)),
                (f"{p}mlp.up_proj.weight", (shape.intermediate, h)), (f"{p}mlp.down_proj.weight", (h, shape.intermediate)),
                (f"{p}input_layernorm.weight", (h,)), (f"{p}post_attention_layernorm.weight", (h,))]  # fmt: skip
    return out + [("model.norm.weight", (h,))]


class Weights(nn.Module):
    """bf16 parameters under checkpoint names; ``load_weights`` copies checkpoint tensors in, as a
    vLLM model's loader does for unfused, unsharded parameters (what the in-place writer maps)."""

    def __init__(self, named: dict[str, torch.Tensor], *, trainable: bool = False) -> None:
        super().__init__()
        for name, t in named.items():
            *path, leaf = name.split(".")
            module: nn.Module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, nn.Parameter(t, requires_grad=trainable))

    def load_weights(self, weights: Any) -> set[str]:
        params, loaded = dict(self.named_parameters()), set()
        for name, w in weights:
            params[name].data.copy_(w)
            loaded.add(name)
        return loaded


def build(shape: ModelShape, seed: int) -> Weights:
    g = torch.Generator().manual_seed(seed)
    named = {}
    for name, size in tensors(shape):
        t = torch.empty(size, dtype=torch.bfloat16)
        t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, 0.02, generator=g)
        named[name] = t
    return Weights(named, trainable=True)  # trainable: the detector compares trainable weights


def step(model: nn.Module, density: float, g: torch.Generator) -> None:
    """Move about ``density`` of every tensor's elements by one bf16 ULP (bit pattern +-1)."""
    with torch.no_grad():
        for p in model.parameters():
            flat = p.data.view(-1).view(torch.int16)
            k = max(1, round(density * flat.numel()))
            idx = torch.randint(0, flat.numel(), (k,), generator=g)
            sign = torch.randint(0, 2, (k,), generator=g, dtype=torch.int16) * 2 - 1
            flat[idx] += sign


# --------------------------------------------------------------------------- publisher side


@contextlib.contextmanager
def timed_encode() -> Any:
    """Sum the seconds the publisher spends in ``delta_pieces`` (encoding a delta)."""
    import deltasync.trainer.writer as writer_module

    original, spent = writer_module.delta_pieces, [0.0]

    def encode(*args: Any, **kwargs: Any) -> list[memoryview]:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    writer_module.delta_pieces = encode
    try:
        yield spent
    finally:
        writer_module.delta_pieces = original


def publish_phase(bucket: str, shape: ModelShape, densities: list[float], seed: int) -> dict[str, Any]:
    """Anchor, then one delta per density; times, bytes and the process's peak RSS."""
    base_rss = rss_bytes()
    model = build(shape, seed)
    total = sum(p.numel() for p in model.parameters())
    weights_rss = rss_bytes()
    store = CountingStore(LocalStore(bucket))
    g = torch.Generator().manual_seed(seed + 1)
    out: dict[str, Any] = {"params": total, "bf16_bytes": 2 * total, "base_rss": base_rss, "weights_rss": weights_rss}
    with timed_encode() as encode, DeltaPublisher(store, model, anchor_every=1 << 30, anchor_bytes_ratio=0) as pub:
        result = pub.publish()
        out["anchor"] = {"seconds": result.seconds, "bytes": result.nbytes}
        log(f"  anchor: {result.nbytes / 2**20:.0f} MiB in {result.seconds:.2f} s")
        versions = []
        for density in densities:
            step(model, density, g)
            writes, spent = store.seconds["write"], encode[0]
            r = pub.publish()
            v = {"version": r.version, "density": r.changed / r.total, "changed": r.changed, "bytes": r.nbytes,
                 "seconds": r.seconds, "detect": r.blocked_s, "encode": encode[0] - spent,
                 "commit": store.seconds["write"] - writes}  # fmt: skip
            versions.append(v)
            log(f"  v{r.version}: {100 * v['density']:.2f}% changed, {r.nbytes / 2**20:.1f} MiB, detect {v['detect']:.2f} s, "
                f"encode {v['encode']:.2f} s, commit {v['commit']:.2f} s")  # fmt: skip
        out["versions"] = versions
        out["fingerprint"] = pub.fingerprint
    out["peak_rss"] = peak_rss_bytes()
    return out


# --------------------------------------------------------------------------- reader side


def read_phase(bucket: str, deltas: int, inplace: bool) -> dict[str, Any]:
    """A receiver (anchor, then each delta staged and applied), the in-place writer on the
    receiver's tensors (the later deltas), and a late joiner's catch-up."""
    store = CountingStore(LocalStore(bucket))
    out: dict[str, Any] = {}
    receiver = DeltaReceiver(store)
    start = time.perf_counter()
    receiver.sync(0)
    out["anchor_load"] = time.perf_counter() - start
    half = deltas // 2 if inplace else deltas
    out["receiver"] = []
    for v in range(1, half + 1):
        start = time.perf_counter()
        staged = receiver.stage(v)
        stage_s = time.perf_counter() - start
        start = time.perf_counter()
        receiver.apply(staged)
        out["receiver"].append({"version": v, "stage": stage_s, "apply": time.perf_counter() - start, "changed": staged.changed})
    log(f"  receiver: anchor {out['anchor_load']:.2f} s; " + ", ".join(
        f"v{r['version']} stage {r['stage']:.2f} s apply {r['apply']:.3f} s" for r in out["receiver"]))  # fmt: skip
    if inplace:
        out["inplace"] = inplace_phase(store, receiver, half, deltas)
    del receiver
    gc.collect()
    from deltasync.server.inplace import release_freed_memory

    release_freed_memory()
    joiner = DeltaReceiver(store)
    start = time.perf_counter()
    joiner.sync()
    out["late_joiner"] = {"seconds": time.perf_counter() - start, "version": joiner.version}
    out["late_joiner"]["exact"] = joiner.fingerprint == joiner.pointer().fingerprint
    log(f"  late joiner: anchor + {joiner.version} deltas in {out['late_joiner']['seconds']:.2f} s")
    out["peak_rss"] = peak_rss_bytes()
    return out


def inplace_phase(store: CountingStore, receiver: DeltaReceiver, first: int, last: int) -> dict[str, Any]:
    from deltasync.reader.chain import ChainReader, read_pointer
    from deltasync.server.inplace import InPlaceState
    from deltasync.server.weight_map import discover

    model = Weights(receiver.state_dict())  # the receiver's tensors are the live weights now
    shapes = {name: tuple(t.shape) for name, t in receiver.state_dict().items()}
    start = time.perf_counter()
    wmap = discover(model, shapes)
    assert not wmap.fallback, wmap.fallback
    live = InPlaceState(model, wmap, lambda obj: [obj], 0, model.load_weights)
    setup = time.perf_counter() - start
    assert live.fingerprint == receiver.fingerprint, "the in-place writer's full fingerprint differs from the receiver's"
    live.commit(first, receiver.fingerprint or "")
    steps = []
    for v in range(first + 1, last + 1):
        reader = ChainReader(store, read_pointer(store))
        start = time.perf_counter()
        staged = live.stage_deltas(reader, v)
        stage_s = time.perf_counter() - start
        start = time.perf_counter()
        fp = live.check_chain(staged, [staged.shares])
        live.write(staged)
        live.commit(v, fp)
        steps.append({"version": v, "stage": stage_s, "write": time.perf_counter() - start, "changed": staged.changed})
    exact = live.verify()["ok"] and live.fingerprint == read_pointer(store).fingerprint_at(last)
    log(f"  in place: setup {setup:.2f} s; " + ", ".join(
        f"v{s['version']} stage {s['stage']:.2f} s write {s['write']:.3f} s" for s in steps) + f"; exact {exact}")  # fmt: skip
    if not exact:
        raise SystemExit("FAIL: the in-place writer's weights do not match the bucket's fingerprint")
    return {"setup": setup, "steps": steps, "exact": exact}


def _child(fn: Any, args: tuple[Any, ...], queue: Any) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent)
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def in_process(fn: Any, *args: Any, spawn: bool = True) -> Any:
    """``fn(*args)`` in a fresh process (its own peak RSS), or here."""
    if not spawn:
        return fn(*args)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, queue))
    proc.start()
    while True:
        try:
            status, value = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if not proc.is_alive():  # killed (out of memory?) before it could answer
                raise SystemExit(f"FAIL: {fn.__name__}: its process ended with status {proc.exitcode}") from None
    proc.join()
    if status != "ok":
        raise SystemExit(f"FAIL: {fn.__name__}: {value}")
    return value


# --------------------------------------------------------------------------- sweeps


def size_sweep(sizes: dict[str, ModelShape], density: float, seed: int, spawn: bool, inplace: bool) -> list[dict[str, Any]]:
    rows = []
    for label, shape in sizes.items():
        log(f"size {label}: {sum(torch.Size(s).numel() for _, s in tensors(shape)) / 1e9:.2f}B parameters")
        with tempfile.TemporaryDirectory(prefix="deltasync-scale-") as bucket:
            pub = in_process(publish_phase, bucket, shape, [density] * 4, seed, spawn=spawn)
            read = in_process(read_phase, bucket, 4, inplace, spawn=spawn)
        rows.append(summarize_size(label, pub, read))
    return rows


def summarize_size(label: str, pub: dict[str, Any], read: dict[str, Any]) -> dict[str, Any]:
    vs = pub["versions"]
    changed = statistics.mean(v["changed"] for v in vs)
    med = {k: statistics.median(v[k] for v in vs) for k in ("detect", "encode", "commit", "seconds", "bytes")}
    row: dict[str, Any] = {"size": label, "params": pub["params"], "changed": changed, "density": changed / pub["params"],
                           **{f"{k}_s": med[k] for k in ("detect", "encode", "commit")}, "publish_s": med["seconds"],
                           "delta_bytes": med["bytes"], "anchor_bytes": pub["anchor"]["bytes"],
                           "anchor_write_s": pub["anchor"]["seconds"]}  # fmt: skip
    row["publish_ns_per_changed"] = 1e9 * row["publish_s"] / changed
    row["publish_ns_per_byte"] = 1e9 * row["publish_s"] / row["delta_bytes"]
    row["bytes_per_changed"] = row["delta_bytes"] / changed
    row["anchor_ns_per_byte"] = 1e9 * row["anchor_write_s"] / row["anchor_bytes"]
    rec = read["receiver"]
    row["receiver_stage_s"] = statistics.median(r["stage"] for r in rec)
    row["receiver_apply_s"] = statistics.median(r["apply"] for r in rec)
    row["receiver_ns_per_changed"] = 1e9 * (row["receiver_stage_s"] + row["receiver_apply_s"]) / changed
    row["anchor_load_s"] = read["anchor_load"]
    if "inplace" in read:
        steps = read["inplace"]["steps"]
        row["inplace_stage_s"] = statistics.median(s["stage"] for s in steps)
        row["inplace_write_s"] = statistics.median(s["write"] for s in steps)
        row["inplace_ns_per_changed"] = 1e9 * (row["inplace_stage_s"] + row["inplace_write_s"]) / changed
        row["inplace_exact"] = read["inplace"]["exact"]
    row["late_joiner_s"] = read["late_joiner"]["seconds"]
    row["late_joiner_exact"] = read["late_joiner"]["exact"]
    row["publisher_peak_rss"] = pub["peak_rss"]
    row["publisher_rss_per_weight"] = pub["peak_rss"] / pub["params"]
    # What the publisher adds to a trainer that already holds the bf16 weights: its snapshot
    # (2 bytes a weight) and whatever else it allocates, per bf16 byte of the model.
    row["publisher_rss_ratio"] = (pub["peak_rss"] - pub["weights_rss"]) / pub["bf16_bytes"]
    row["reader_peak_rss"] = read["peak_rss"]
    return row


def density_sweep(shape: ModelShape, densities: tuple[float, ...], seed: int, spawn: bool) -> dict[str, Any]:
    log(f"density sweep: {', '.join(f'{100 * d:g}%' for d in densities)}")
    with tempfile.TemporaryDirectory(prefix="deltasync-scale-") as bucket:
        pub = in_process(publish_phase, bucket, shape, list(densities), seed, spawn=spawn)
        read = in_process(read_phase, bucket, len(densities), False, spawn=spawn)
    anchor = pub["anchor"]
    rows = []
    for v, r in zip(pub["versions"], read["receiver"]):
        rows.append({"density": v["density"], "changed": v["changed"], "bytes": v["bytes"],
                     "bytes_per_changed": v["bytes"] / v["changed"], "publish_s": v["seconds"],
                     "detect_s": v["detect"], "encode_s": v["encode"], "commit_s": v["commit"],
                     "bytes_vs_anchor": v["bytes"] / anchor["bytes"], "time_vs_anchor": v["seconds"] / anchor["seconds"],
                     "receiver_stage_s": r["stage"], "receiver_apply_s": r["apply"]})  # fmt: skip
    # An anchor costs 2 bytes a weight; a delta costs bytes_per_changed at density p: they meet
    # at p = 2 / bytes_per_changed (bytes_per_changed taken at the densest point measured).
    crossover = min(1.0, 2.0 / rows[-1]["bytes_per_changed"])
    # In time: where publishing a delta takes as long as writing an anchor (interpolated on log
    # density between the two points measured around it; None if it is not crossed).
    faster = None
    for a, b in itertools.pairwise(rows):
        if a["time_vs_anchor"] < 1 <= b["time_vs_anchor"]:
            t = math.log(1 / a["time_vs_anchor"]) / math.log(b["time_vs_anchor"] / a["time_vs_anchor"])
            faster = math.exp(math.log(a["density"]) + t * math.log(b["density"] / a["density"]))
    return {"params": pub["params"], "anchor_bytes": anchor["bytes"], "anchor_write_s": anchor["seconds"],
            "rows": rows, "anchor_cheaper_from_density": crossover, "anchor_faster_from_density": faster}  # fmt: skip


# --------------------------------------------------------------------------- followers


def _followers(bucket: str, n: int, options: dict[str, Any], latency: float, stop: Any, queue: Any) -> None:
    """``n`` followers in threads of this process; each reports its staged times and counts."""
    torch.set_num_threads(1)
    fixed = options.pop("fixed", False)
    results: list[dict[str, Any]] = [{} for _ in range(n)]
    ready = threading.Barrier(n + 1)

    def follow(k: int) -> None:
        store = CountingStore(LocalStore(bucket), latency=latency)
        receiver, watch = DeltaReceiver(store), PointerWatch(store)
        receiver.sync()
        policy = PollPolicy(PollOptions(**options))
        start_counts, staged_at, seen_at = store.counts(), {}, {}
        ready.wait()
        while not stop.is_set():
            pointer = watch.read()
            if pointer.version > (receiver.version or 0):
                seen_at[pointer.version] = time.time()
                receiver.apply(receiver.stage(pointer.version))
                staged_at[pointer.version] = time.time()
            delay = policy.options.interval if fixed else policy.observe(pointer.version)
            stop.wait(delay)
        end = store.counts()
        results[k] = {"staged_at": staged_at, "seen_at": seen_at, "requests": end["requests"] - start_counts["requests"],
                      "bytes_read": end["bytes_read"] - start_counts["bytes_read"], "exact": receiver.verify()}  # fmt: skip

    threads = [threading.Thread(target=follow, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    ready.wait()
    queue.put(("ready", n))
    for t in threads:
        t.join()
    queue.put(("done", results))


def fleet(n: int, *, versions: int, period: float, latency: float, options: dict[str, Any], seed: int) -> dict[str, Any]:
    """One trainer and ``n`` followers on one bucket: latencies and what each follower costs."""
    shape = QUICK_SIZES["tiny-8"]
    procs_n = min(n, 8)
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory(prefix="deltasync-fleet-") as bucket:
        model = build(shape, seed)
        g = torch.Generator().manual_seed(seed)
        with DeltaPublisher(LocalStore(bucket), model, anchor_every=1 << 30, anchor_bytes_ratio=0) as pub:
            pub.publish()
            procs = []
            for i in range(procs_n):
                share = n // procs_n + (1 if i < n % procs_n else 0)
                proc = ctx.Process(target=_followers, args=(bucket, share, dict(options), latency, stop, queue))
                proc.start()
                procs.append(proc)
            ready = 0
            while ready < n:
                kind, count = queue.get()
                ready += count
            began = time.time()
            commits: dict[int, float] = {}
            for _ in range(versions):
                time.sleep(period)
                step(model, 0.01, g)
                r = pub.publish()
                commits[r.version] = time.time()
            time.sleep(period)
            stop.set()
            window = time.time() - began
            results = []
            while len(results) < procs_n:
                kind, value = queue.get()
                if kind == "done":
                    results.append(value)
            for proc in procs:
                proc.join()
    followers = [f for batch in results for f in batch]
    # A version is staged when the follower stages it or any later one (it may jump ahead).
    lat = sorted(min(t for w, t in f["staged_at"].items() if w >= v) - commits[v]
                 for f in followers for v in commits if any(w >= v for w in f["staged_at"]))  # fmt: skip
    # Split: from the commit until the follower's read saw it, and from then until staged.
    seen_lat = sorted(min(t for w, t in f["seen_at"].items() if w >= v) - commits[v]
                      for f in followers for v in commits if any(w >= v for w in f["seen_at"]))  # fmt: skip
    work = sorted(f["staged_at"][v] - f["seen_at"][v] for f in followers for v in f["staged_at"])
    seen = sum(1 for f in followers for v in commits if v in f["staged_at"])
    requests = statistics.mean(f["requests"] for f in followers)
    return {"followers": n, "processes": procs_n, "versions": versions, "period_s": period, "latency_s": latency,
            "poll": "fixed" if options.get("fixed") else "policy", "interval_s": options["interval"],
            "p50_s": _pct(lat, 50), "p99_s": _pct(lat, 99), "max_s": lat[-1] if lat else None,
            "seen_p50_s": _pct(seen_lat, 50), "seen_p99_s": _pct(seen_lat, 99),
            "stage_p50_s": _pct(work, 50), "stage_p99_s": _pct(work, 99),
            "versions_staged": seen, "versions_skipped": n * versions - seen,
            "requests_per_version": requests / versions, "requests_per_hour": requests / window * 3600,
            "bytes_per_version": statistics.mean(f["bytes_read"] for f in followers) / versions,
            "exact": all(f["exact"] for f in followers), "window_s": window}  # fmt: skip


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, max(0, round(p / 100 * len(values) + 0.5) - 1))]


def simulate_polling(step_s: float, jitter: float, *, interval: float = 2.0, hours: float = 3.0, seed: int = 0) -> dict[str, Any]:
    """The follow poll against a trainer committing every ``step_s`` (+- ``jitter`` of it,
    uniform), on a simulated clock: reads per follower-hour and how late versions are seen,
    after the first half hour (the policy has learnt the rhythm), beside a fixed poll."""
    rng = random.Random(seed)
    commits, t = [], 5.0
    while t < hours * 3600 + step_s:
        commits.append(t)
        t += step_s * (1 + rng.uniform(-jitter, jitter))
    out: dict[str, Any] = {"step_s": step_s, "jitter": jitter}
    for kind in ("fixed", "policy"):
        now = [0.0]
        policy = PollPolicy(PollOptions(interval=interval), clock=lambda now=now: now[0])
        reads, lags, seen, k = 0, [], 0, 0
        while now[0] < hours * 3600:
            while k < len(commits) and commits[k] <= now[0]:
                k += 1
            lags += [now[0] - commits[v] for v in range(seen, k) if commits[v] >= 1800]
            seen = k
            reads += now[0] >= 1800
            now[0] += interval if kind == "fixed" else policy.observe(k)
        lags = sorted(lags)
        out[kind] = {"reads_per_hour": reads / (hours - 0.5), "lag_p50_s": _pct(lags, 50), "lag_max_s": lags[-1]}
    return out


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    sizes = results["sizes"]
    x = [r["params"] / 1e9 for r in sizes]
    ax = axes[0][0]
    for key, label in (("publish_ns_per_changed", "publish (detect+encode+commit)"),
                       ("receiver_ns_per_changed", "receiver stage+apply"),
                       ("inplace_ns_per_changed", "in-place stage+write")):  # fmt: skip
        if all(key in r for r in sizes):
            ax.plot(x, [r[key] for r in sizes], "o-", label=label)
    ax.set(xscale="log", xlabel="parameters (B)", ylabel="ns per changed element", title="Time per changed element (~1% density)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax = axes[0][1]
    ax.plot(x, [r["publisher_rss_ratio"] for r in sizes], "o-", label="publisher peak RSS beyond the weights / bf16 bytes")
    ax.plot(x, [r["reader_peak_rss"] / (2 * r["params"]) for r in sizes], "s-", label="reader process peak RSS / bf16 bytes")
    ax.axhline(1.3, color="gray", ls="--", lw=1, label="target 1.3")
    ax.set(xscale="log", xlabel="parameters (B)", ylabel="x bf16 bytes", title="Peak memory")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    ax = axes[1][0]
    d = results["density"]["rows"]
    dx = [100 * r["density"] for r in d]
    ax.plot(dx, [r["bytes_vs_anchor"] for r in d], "o-", label="delta bytes / anchor bytes")
    ax.plot(dx, [r["time_vs_anchor"] for r in d], "s-", label="publish time / anchor write time")
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.set(xscale="log", yscale="log", xlabel="% of elements changed", ylabel="ratio",
           title=f"Density at {results['density']['params'] / 1e9:.2f}B: delta vs full write")  # fmt: skip
    ax.legend(fontsize=8)
    ax = axes[1][1]
    fl = [r for r in results["followers"] if r["poll"] == "policy"]
    ax.plot([r["followers"] for r in fl], [r["p50_s"] for r in fl], "o-", label="p50")
    ax.plot([r["followers"] for r in fl], [r["p99_s"] for r in fl], "s-", label="p99")
    ax.set(xscale="log", xlabel="followers on one bucket", ylabel="seconds", title="Commit to staged (policy poll)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def check_targets(results: dict[str, Any]) -> dict[str, Any]:
    sizes = results["sizes"]
    per = [r["publish_ns_per_changed"] for r in sizes]
    spread = per[-1] / per[0] - 1
    policy = [r for r in results["followers"] if r["poll"] == "policy"]
    one, most = policy[0], policy[-1]
    sixty = next(r for r in results["polling"] if r["step_s"] == 60 and r["jitter"] == 0)
    values = {
        "time_per_changed_spread": spread,
        "publisher_rss_ratio": max(r["publisher_rss_ratio"] for r in sizes),
        "p99_ratio_64": most["p99_s"] / one["p99_s"] if one["p99_s"] else None,
        "reads_per_hour_60s": sixty["policy"]["reads_per_hour"],
    }
    out = {}
    for key, (label, op, bound) in TARGETS.items():
        value = values[key]
        met = value is not None and (abs(value) <= bound if op == "within" else value <= bound)
        out[key] = {"label": label, "value": value, "target": f"{op} {bound}", "met": met}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models and fleets: a check that runs in seconds")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), help=f"from {', '.join(SIZES)}")
    parser.add_argument("--density-size", default="0.5B")
    parser.add_argument("--followers", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--versions", type=int, default=12, help="versions each fleet follows")
    parser.add_argument("--period", type=float, default=2.0, help="seconds between the fleet's commits")
    parser.add_argument("--interval", type=float, default=0.25, help="the fleet's poll interval while a commit is due")
    parser.add_argument("--latency", type=float, default=0.02, help="seconds added to each bucket request")
    parser.add_argument("--no-inplace", action="store_true", help="skip the in-place writer (it needs vLLM installed)")
    parser.add_argument("--sweeps", nargs="+", default=["sizes", "density", "followers"],
                        help="which sweeps to run (the others are left out of the results)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    spawn = not args.quick
    if args.quick:
        sizes, density_shape = QUICK_SIZES, QUICK_SIZES["tiny-8"]
        followers, versions, period, interval = [1, 2], 3, 0.4, 0.1
    else:
        sizes = {k: SIZES[k] for k in args.sizes}
        density_shape = SIZES[args.density_size]
        followers, versions, period, interval = args.followers, args.versions, args.period, args.interval
    started = time.time()
    results: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    if "sizes" in args.sweeps:
        results["sizes"] = size_sweep(sizes, 0.01, args.seed, spawn, not args.no_inplace)
    if "density" in args.sweeps:
        results["density"] = density_sweep(density_shape, DENSITIES, args.seed, spawn)
    options = {"interval": interval, "max_interval": 4 * period, "idle_after": 10 * period}
    results["followers"] = []
    for n in followers if "followers" in args.sweeps else []:
        for fixed in ([False, True] if n == followers[0] or (n == followers[-1] and not args.quick) else [False]):
            log(f"fleet: {n} followers, {'fixed' if fixed else 'policy'} poll")
            row = fleet(n, versions=versions, period=period, latency=args.latency,
                        options={**options, "fixed": fixed}, seed=args.seed)  # fmt: skip
            log(f"  p50 {row['p50_s']:.3f} s, p99 {row['p99_s']:.3f} s (seen p99 {row['seen_p99_s']:.3f} s, staged p99 "
                f"{row['stage_p99_s']:.3f} s after), {row['requests_per_version']:.1f} requests and "
                f"{row['bytes_per_version'] / 1024:.1f} KiB per follower per version; exact {row['exact']}")  # fmt: skip
            if not row["exact"]:
                raise SystemExit("FAIL: a follower's weights do not match its fingerprint")
            results["followers"].append(row)
    results["polling"] = [simulate_polling(s, j, hours=1.0 if args.quick else 3.0)
                          for s, j in ((15, 0), (60, 0), (60, 0.05), (300, 0), (300, 0.05))]  # fmt: skip
    results["wall_s"] = time.time() - started
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if set(args.sweeps) < {"sizes", "density", "followers"}:
        return 0  # a partial run: no targets, no table, no plot
    results["targets"] = check_targets(results)
    report(results)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    if args.plot:
        plot(results, args.plot)
    return 0


def report(results: dict[str, Any]) -> None:
    print("| size | params | changed | delta MiB | detect s | encode s | commit s | ns/changed | ns/byte | "
          "receiver stage+apply s | in-place stage+write s | late joiner s | anchor write s | publisher RSS x bf16 |")
    print("|---" * 14 + "|")
    for r in results["sizes"]:
        inplace = f"{r['inplace_stage_s']:.2f}+{r['inplace_write_s']:.3f}" if "inplace_stage_s" in r else "-"
        print(f"| {r['size']} | {r['params'] / 1e9:.3f}B | {100 * r['density']:.2f}% | {r['delta_bytes'] / 2**20:.1f} | "
              f"{r['detect_s']:.2f} | {r['encode_s']:.2f} | {r['commit_s']:.3f} | {r['publish_ns_per_changed']:.0f} | "
              f"{r['publish_ns_per_byte']:.0f} | {r['receiver_stage_s']:.2f}+{r['receiver_apply_s']:.3f} | {inplace} | "
              f"{r['late_joiner_s']:.1f} | {r['anchor_write_s']:.1f} | {r['publisher_rss_ratio']:.2f} |")  # fmt: skip
    print()
    print("| density | bytes/changed | delta / anchor bytes | publish / anchor time | receiver stage+apply s |")
    print("|---|---|---|---|---|")
    for r in results["density"]["rows"]:
        print(f"| {100 * r['density']:.2f}% | {r['bytes_per_changed']:.2f} | {r['bytes_vs_anchor']:.4f} | "
              f"{r['time_vs_anchor']:.3f} | {r['receiver_stage_s']:.2f}+{r['receiver_apply_s']:.3f} |")
    d = results["density"]
    faster = "beyond the densest point" if d["anchor_faster_from_density"] is None else f"~{100 * d['anchor_faster_from_density']:.0f}%"
    print(f"anchor cheaper in bytes from ~{100 * d['anchor_cheaper_from_density']:.0f}% changed; faster to write from {faster}")
    print()
    print("| followers | poll | p50 s | p99 s | requests/version | KiB/version | requests/hour |")
    print("|---|---|---|---|---|---|---|")
    for r in results["followers"]:
        print(f"| {r['followers']} | {r['poll']} | {r['p50_s']:.3f} | {r['p99_s']:.3f} | {r['requests_per_version']:.1f} | "
              f"{r['bytes_per_version'] / 1024:.1f} | {r['requests_per_hour']:.0f} |")
    print()
    print("| trainer step | jitter | fixed 2 s: reads/h | policy: reads/h | policy lag p50 / max s |")
    print("|---|---|---|---|---|")
    for r in results["polling"]:
        p = r["policy"]
        print(f"| {r['step_s']} s | {100 * r['jitter']:.0f}% | {r['fixed']['reads_per_hour']:.0f} | {p['reads_per_hour']:.0f} | "
              f"{p['lag_p50_s']:.2f} / {p['lag_max_s']:.2f} |")
    print()
    for t in results["targets"].values():
        value = "n/a" if t["value"] is None else f"{t['value']:.3g}"
        print(f"- {t['label']}: {value} (target {t['target']}): {'met' if t['met'] else 'NOT met'}")
    print(f"wall time {results['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
