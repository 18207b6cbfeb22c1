"""Server-side update cost: in-place apply vs layerwise reload, on a real vLLM-CPU server.

Builds a ~0.36B Qwen2-shaped model offline (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings, :func:`deltasync.tiny.build_tiny_model`), publishes an
anchor and ``--updates`` deltas of about ``--density`` changed elements each into a local
bucket (each changed element moves by one bf16 step), then, for each mode in turn, starts one
server from the model and has it follow the bucket the way the TRL integration does: every
version is prefetched first, then applied (pause emptying the prefix cache, apply, resume).

- ``in-place``: ``DELTASYNC_CPU_PLAIN_GEMM=1`` (plain linear weights), deltas written into the
  live weights;
- ``reload``: vLLM-CPU's default packed kernels, deltas applied by the layerwise reload.

Per mode it reports the anchor's and the deltas' paused and apply seconds (as the client and
the server measure them), and the growth of the server process tree's RSS from start-up to
after the last update, against the model's bf16 size. After every update the served
fingerprint must equal the bucket's; otherwise the run aborts. Times are noisy on a shared
machine: read the ratios, measured in the same run. For scale, the same run also measures
what no update can avoid: a bare pause/resume pair on the in-place server (the HTTP and engine
round trips of an update that loads nothing), and, in this process on one thread, a dense copy
of the model's bf16 bytes (the floor of an anchor's load) and one ``scatter_`` of as many int16
values as a delta changes, at sorted random positions (the floor of a delta's write).

Run from the repository root: ``python benchmarks/server.py --out benchmarks/results/server.json``.
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

from deltasync import DeltaPublisher, RolloutClient
from deltasync._serve import extension_args
from deltasync._server import VLLMServer
from deltasync.tiny import build_tiny_model

SHAPE = dict(hidden_size=896, num_layers=24, num_attention_heads=14, num_key_value_heads=2,
             intermediate_size=4864, vocab_size=512, tie_word_embeddings=True)  # fmt: skip
TARGETS = {
    "delta_apply_vs_anchor_apply": ("delta apply / anchor apply", 0.15),
    "delta_pause_vs_anchor_pause": ("delta pause / anchor pause", 0.25),
    "rss_growth_vs_bf16": ("RSS growth / bf16 model bytes", 0.10),
}


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


def publish_versions(model_dir: Path, bucket: Path, updates: int, density: float, seed: int) -> list[dict[str, Any]]:
    """Anchor 0, then ``updates`` deltas moving ``density`` of every tensor's elements by one bf16 step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    publisher = DeltaPublisher(bucket, model, None, anchor_every=10_000, anchor_bytes_ratio=0)
    out = [publisher.publish().__dict__]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(updates):
        with torch.no_grad():
            for param in model.parameters():
                flat = param.view(-1).view(torch.int16)
                n = max(1, int(flat.numel() * density))
                idx = torch.randint(0, flat.numel(), (n,), generator=gen)
                step = torch.where(torch.rand(n, generator=gen) < 0.5, -1, 1).to(torch.int16)
                flat[idx] = flat[idx] + step  # the neighbouring bf16 value (bit pattern +-1)
        result = publisher.publish()
        assert result.kind == "delta", result
        out.append(result.__dict__)
        log(f"published version {result.version}: {result.changed} changed, {result.nbytes} bytes")
    return out


def run_mode(mode: str, model_dir: Path, bucket: Path, versions: int, root: Path) -> dict[str, Any]:
    env = {
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "DELTASYNC_BUCKET": str(bucket),
        "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")) if p),
    }
    if mode == "in-place":
        env["DELTASYNC_CPU_PLAIN_GEMM"] = "1"
    server = VLLMServer(model_dir, env=env, extra_args=["--enforce-eager", *extension_args()],
                        log_file=root / f"server-{mode}.log")  # fmt: skip
    server.start(timeout=900)
    try:
        time.sleep(2)
        rss_start = tree_rss(server.pid)  # type: ignore[arg-type]
        client = RolloutClient(server.url, timeout=600)
        status = client.status()[server.url]
        assert status.mode == mode, (status.mode, status.workers[0].get("fallback", [])[:3])
        rows = []
        for version in range(versions):
            (pre,) = client.prefetch(version).values()
            assert pre.ok, pre.error
            assert client.wait_prefetched(version, timeout=600) == {server.url: True}
            report = client.update(version)
            assert report.ok, report.failed
            (r,) = report.results
            pointer = json.loads((bucket / "latest.json").read_text())
            want = next(e["fingerprint"] for e in pointer["chain"] if e["version"] == version)
            assert r.fingerprint == want, f"{mode}: version {version} serves {r.fingerprint}, the bucket says {want}"
            last = client.status()[server.url].workers[0]["last_update"]
            rows.append({"version": version, "kind": r.kind, "paused_s": r.paused_s, "apply_s": r.apply_s,
                         "stage_s": r.stage_s, "load_s": last.get("load_s"), "hash_s": last.get("hash_s")})  # fmt: skip
            log(f"{mode}: version {version} ({r.kind}): paused {r.paused_s:.3f} s, apply {r.apply_s:.3f} s")
        pause_resume = []
        with httpx.Client(timeout=60) as http:  # one connection, as RolloutClient keeps
            http.get(server.url + "/health").raise_for_status()
            for _ in range(5):  # what the pause costs with nothing to load: the round trips alone
                start = time.perf_counter()
                http.post(server.url + "/pause", params={"mode": "keep", "clear_cache": "true"}).raise_for_status()
                http.post(server.url + "/resume").raise_for_status()
                pause_resume.append(time.perf_counter() - start)
        time.sleep(2)
        rss_end = tree_rss(server.pid)  # type: ignore[arg-type]
    finally:
        server.stop()
    deltas = [row for row in rows if row["kind"] == "delta"]
    anchor = rows[0]
    return {
        "mode": mode,
        "rows": rows,
        "anchor_paused_s": anchor["paused_s"],
        "anchor_apply_s": anchor["apply_s"],
        "delta_paused_s": statistics.median(r["paused_s"] for r in deltas),
        "delta_apply_s": statistics.median(r["apply_s"] for r in deltas),
        "rss_start": rss_start,
        "rss_end": rss_end,
        "pause_resume_s": statistics.median(pause_resume),
    }


def floors(bf16_bytes: int, changed: int, seed: int) -> dict[str, float]:
    """Seconds (best of 3, one thread) of a dense copy of the model's bytes into a buffer already
    in memory, and of one scatter_ of ``changed`` int16 values at sorted random positions of it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        flat = torch.zeros(bf16_bytes // 2, dtype=torch.int16)
        gen = torch.Generator().manual_seed(seed)
        index = torch.unique(torch.randint(0, flat.numel(), (changed,), generator=gen))
        values = torch.ones(index.numel(), dtype=torch.int16)
        target = torch.ones_like(flat)  # touched: the copy into it faults no pages in
        copy_s, scatter_s = [], []
        for _ in range(3):
            start = time.perf_counter()
            target.copy_(flat)
            copy_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            flat.scatter_(0, index, values)
            scatter_s.append(time.perf_counter() - start)
        return {"dense_copy_s": min(copy_s), "scatter_s": min(scatter_s), "scatter_elements": index.numel()}
    finally:
        torch.set_num_threads(threads)


def plot(summary: dict[str, Any], path: Path) -> None:
    """Paused and apply seconds of every update, per mode, and the RSS growth, in one figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = summary["modes"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.2
    for k, (mode, r) in enumerate(modes.items()):
        xs = [row["version"] + (k - 0.5) * 2 * width for row in r["rows"]]
        ax.bar(xs, [row["paused_s"] for row in r["rows"]], width, label=f"{mode}: paused", alpha=0.5)
        ax.bar(xs, [row["apply_s"] for row in r["rows"]], width * 0.6, label=f"{mode}: apply")
    ax.set_xticks(range(len(next(iter(modes.values()))["rows"])))
    ax.set_xticklabels(["anchor 0"] + [f"delta {v}" for v in range(1, len(next(iter(modes.values()))["rows"]))])
    ax.set_ylabel("seconds")
    ax.set_title(f"per update, {summary['density']:.0%} of elements changed per delta (prefetched)")
    ax.legend(fontsize=8)
    gib = 2**30
    bx.bar(list(modes), [(r["rss_end"] - r["rss_start"]) / gib for r in modes.values()], color=["C2", "C3"][: len(modes)])
    bx.axhline(summary["bf16_bytes"] / gib, color="k", linestyle="--", linewidth=1, label="model bf16 size")
    bx.set_ylabel("GiB")
    bx.set_title("server RSS growth")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", nargs="+", default=["in-place", "reload"], choices=["in-place", "reload"])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="write a figure of the results (PNG)")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="deltasync-server-bench-"))
    model_dir = build_tiny_model(root / "model", **SHAPE)
    bf16_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    log(f"model: {model_dir} ({bf16_bytes / 2**30:.2f} GiB bf16)")
    published = publish_versions(model_dir, root / "bucket", args.updates, args.density, args.seed)
    changed = int(statistics.median(p["changed"] for p in published[1:]))
    floor = floors(bf16_bytes, changed, args.seed)
    log(f"floors: dense copy {floor['dense_copy_s']:.3f} s, scatter of {changed} {floor['scatter_s']:.3f} s")
    results = {}
    for mode in args.modes:
        results[mode] = run_mode(mode, model_dir, root / "bucket", args.updates + 1, root)
    summary: dict[str, Any] = {"shape": SHAPE, "bf16_bytes": bf16_bytes, "density": args.density,
                               "published": published, "modes": results, "floors": floor}  # fmt: skip
    print("| mode | anchor paused s | anchor apply s | delta paused s (median) | delta apply s (median) "
          "| delta/anchor apply | delta/anchor pause | RSS growth | RSS growth / bf16 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        growth = r["rss_end"] - r["rss_start"]
        r["delta_apply_vs_anchor_apply"] = r["delta_apply_s"] / r["anchor_apply_s"]
        r["delta_pause_vs_anchor_pause"] = r["delta_paused_s"] / r["anchor_paused_s"]
        r["rss_growth_vs_bf16"] = growth / bf16_bytes
        print(f"| {mode} | {r['anchor_paused_s']:.3f} | {r['anchor_apply_s']:.3f} | {r['delta_paused_s']:.3f} "
              f"| {r['delta_apply_s']:.3f} | {r['delta_apply_vs_anchor_apply']:.0%} "
              f"| {r['delta_pause_vs_anchor_pause']:.0%} | {growth / 2**30:+.2f} GiB "
              f"| {r['rss_growth_vs_bf16']:.0%} |")  # fmt: skip
    if "in-place" in results:
        anchor = results["in-place"]["rows"][0]
        if anchor.get("load_s") is not None:
            print(f"\nin-place anchor apply: {anchor['load_s']:.3f} s dense load through vLLM's loader; the full "
                  "hash of the served weights runs after the pause")  # fmt: skip
        if "reload" in results:
            r = results["in-place"]["delta_paused_s"] / results["reload"]["delta_paused_s"]
            a = results["in-place"]["delta_paused_s"] / results["reload"]["anchor_paused_s"]
            print(f"in-place delta pause / reload delta pause: {r:.0%}; / reload anchor pause: {a:.0%}")
        r = results["in-place"]
        print(f"in-place pause/resume with nothing loaded: {r['pause_resume_s']:.3f} s; floors on one thread here: "
              f"dense copy of the bf16 bytes {floor['dense_copy_s']:.3f} s, scatter_ of {changed} values "
              f"{floor['scatter_s']:.3f} s")  # fmt: skip
        print()
        for key, (label, limit) in TARGETS.items():
            value = results["in-place"][key]
            print(f"- in-place {label}: {value:.1%} (target <= {limit:.0%}): {'met' if value <= limit else 'MISSED'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    if args.plot:
        plot(summary, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
