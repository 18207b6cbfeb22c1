"""What a fleet costs on S3: requests and bytes per version, for the publisher and each follower.

A real S3-protocol server (moto's) with two counting proxies in front (tests/fault_proxy.py,
no faults): one for the publisher, one for a follower. The trainer publishes a version every
``--step`` seconds (each step drawn within +-5%), 1% of a 131K-element bf16 state changed. The
follower is what a rollout server in follow mode runs, engine aside: :class:`PollPolicy` says
when to read the pointer, :class:`PointerWatch` reads it (one GET with ``If-None-Match: <ETag>``,
answered 304 while it is unchanged), and a :class:`DeltaReceiver` syncs the new versions from
the pointer the watch read (as a server's workers do: ``DeltaReceiver.offer_pointer``). Time is simulated (a fake
clock drives the trainer's steps and the follower's reads), so an hour of a 60 s trainer runs
in seconds; every request is real and counted at the proxy.

Commit-to-seen is, on the simulated clock, from the commit until the follower's read that found
it (what a server adds to it is the apply: see docs/server.md). The first ``--warmup`` versions,
while the policy learns the rhythm, are left out of the figures.

    .venv/bin/python benchmarks/s3_fleet_cost.py --out benchmarks/results/s3_fleet_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from fault_proxy import FaultProxy  # noqa: E402  (tests/: the proxy and the server the tests use)
from s3_server import CREDENTIALS, running_s3_server  # noqa: E402

from deltasync import DeltaPublisher, DeltaReceiver  # noqa: E402
from deltasync.reader.poll import PointerWatch, PollOptions, PollPolicy  # noqa: E402
from deltasync.stores import FsspecStore  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(512, 256, generator=gen).to(torch.bfloat16))


def _pointer(path: str) -> bool:
    return path.endswith("/latest.json")


def run(server: Any, step: float, versions: int, warmup: int, interval: float, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    url = server.url(f"fleet-{int(step)}")
    with FaultProxy(server.endpoint) as pub_proxy, FaultProxy(server.endpoint) as fol_proxy:
        publisher_store = FsspecStore(url, **server.storage_options(pub_proxy.endpoint))
        follower_store = FsspecStore(url, **server.storage_options(fol_proxy.endpoint))
        model = Model()
        publisher = DeltaPublisher(publisher_store, model, None, anchor_every=10)
        now = [0.0]
        policy = PollPolicy(PollOptions(interval=interval), clock=lambda: now[0])
        publisher.publish()
        watch, receiver = PointerWatch(follower_store), DeltaReceiver(follower_store)
        receiver.sync()
        pub_proxy.take_log()
        fol_proxy.take_log()
        committed: dict[int, float] = {}
        seen: dict[int, float] = {}
        next_commit = step * rng.uniform(0.95, 1.05)
        wait = policy.observe(receiver.version or 0)
        logs: list[tuple[int, list[Any], list[Any]]] = []
        while len(committed) < versions:
            read_at = now[0] + wait
            while next_commit <= read_at and len(committed) < versions:
                now[0] = next_commit
                with torch.no_grad():
                    flat = model.w.view(-1)
                    flat[torch.randint(0, flat.numel(), (flat.numel() // 100,))] += 0.01
                result = publisher.publish()
                publisher.flush()
                committed[result.version] = now[0]
                logs.append((result.version, pub_proxy.take_log(), fol_proxy.take_log()))
                next_commit += step * rng.uniform(0.95, 1.05)
            now[0] = read_at
            pointer = watch.read()
            if receiver.version is None or pointer.version > receiver.version:
                receiver.offer_pointer(watch.data)  # as the follower hands it to its workers
                receiver.sync(pointer.version)
                for v in committed:
                    seen.setdefault(v, now[0]) if v <= pointer.version else None
            wait = policy.observe(pointer.version)
        # The follower's reads until it has seen the last version.
        while max(committed) not in seen:
            now[0] += wait
            pointer = watch.read()
            if pointer.version > (receiver.version or -1):
                receiver.offer_pointer(watch.data)
                receiver.sync(pointer.version)
                for v in committed:
                    seen.setdefault(v, now[0]) if v <= pointer.version else None
            wait = policy.observe(pointer.version)
        logs.append((-1, pub_proxy.take_log(), fol_proxy.take_log()))
        publisher.close()
    # Each log holds the requests from one commit to the next: count those after the warm-up.
    measured = [v for v in committed if v > warmup]
    first = min(measured)
    pub = [r for v, p, _ in logs if v >= first or v == -1 for r in p]
    fol = [r for v, _, f in logs if v > first or v == -1 for r in f]  # the reads that led to each measured version
    n = len(measured)
    latency = [seen[v] - committed[v] for v in measured]
    return {
        "trainer_step_s": step,
        "follow_interval_s": interval,
        "versions_measured": n,
        "publisher_requests_per_version": round(len(pub) / n, 2),
        "publisher_requests_by_method": {m: sum(1 for r in pub if r[0] == m) for m in sorted({r[0] for r in pub})},
        "publisher_bytes_up_per_version": round(sum(r[2] for r in pub) / n),
        "follower_pointer_requests_per_version": round(sum(1 for r in fol if _pointer(r[1])) / n, 2),
        "follower_pointer_requests_by_method": {m: sum(1 for r in fol if _pointer(r[1]) and r[0] == m)
                                                for m in sorted({r[0] for r in fol if _pointer(r[1])})},
        "follower_other_requests_per_version": round(sum(1 for r in fol if not _pointer(r[1])) / n, 2),
        "follower_bytes_down_per_version": round(sum(r[3] for r in fol) / n),
        "commit_to_seen_median_s": round(statistics.median(latency), 2),
        "commit_to_seen_max_s": round(max(latency), 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=float, nargs="+", default=[15.0, 60.0], help="trainer steps (seconds)")
    parser.add_argument("--versions", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=4, help="versions left out while the policy learns")
    parser.add_argument("--interval", type=float, default=2.0, help="the follower's poll interval while a version is due")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.update(CREDENTIALS)
    with tempfile.TemporaryDirectory() as tmp, running_s3_server(Path(tmp)) as server:
        figures = [run(server, step, args.versions, args.warmup, args.interval, args.seed) for step in args.steps]
    print(json.dumps(figures, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
