"""Publishing through S3 faults: versions published, versions lost, faults injected.

A real S3-protocol server (moto's, in a process of its own) sits behind a proxy that injects
faults into a random share of the requests: 503 SlowDown, 500, connection resets, answers lost
after the request landed, reads cut short and a slow link (tests/fault_proxy.py). A publisher
writes one version per step through the proxy (s3fs with its default retries), and a follower
(a ``DeltaReceiver`` through the same proxy) syncs after each step. A step whose publish fails
leaves its changes to the next one. At the end the faults stop, the publisher publishes once
more and the follower syncs; then the bucket is verified straight from the server.

"Versions lost" counts changes that a committed version should hold and does not: the final
state a fresh reader rebuilds against the trainer's, and every committed version against the
state the trainer had when it committed it.

    .venv/bin/python benchmarks/s3_faults.py --versions 40 --fault-rate 0.1 --out benchmarks/results/s3_faults.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from fault_proxy import KINDS, FaultProxy  # noqa: E402  (tests/: the proxy and the server the tests use)
from s3_server import CREDENTIALS, running_s3_server  # noqa: E402

from deltasync import DeltaPublisher, DeltaReceiver, DeltaSyncError, bf16_state_dict, fingerprint  # noqa: E402
from deltasync.stores import FsspecStore  # noqa: E402


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(512, 256, generator=gen).to(torch.bfloat16))
        self.b = torch.nn.Parameter(torch.randn(256, generator=gen).to(torch.bfloat16))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, default=40, help="trainer steps, one publish each")
    parser.add_argument("--fault-rate", type=float, default=0.1, help="share of requests that get a fault")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    os.environ.update(CREDENTIALS)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp, running_s3_server(Path(tmp)) as server, \
            FaultProxy(server.endpoint, seed=args.seed) as proxy:  # fmt: skip
        url = server.url("faults")
        faulty = FsspecStore(url, **server.storage_options(proxy.endpoint))
        direct = FsspecStore(url, **server.storage_options())
        model = Model()
        publisher = DeltaPublisher(faulty, model, None, anchor_every=10)
        publisher.publish()  # version 0, before the faults
        follower = DeltaReceiver(FsspecStore(url, **server.storage_options(proxy.endpoint)))
        follower.sync()
        for kind in KINDS:  # every request has fault_rate chance of one fault, of a kind drawn evenly
            proxy.add(kind, count=-1, probability=args.fault_rate / len(KINDS), delay=0.2)
        committed: dict[int, str] = {}
        failed_publishes, failed_syncs, errors = 0, 0, Counter[str]()
        start = time.perf_counter()
        for step in range(args.versions):
            with torch.no_grad():
                flat = model.w.view(-1)
                picked = torch.randint(0, flat.numel(), (flat.numel() // 100,))
                flat[picked] += 0.01 * torch.randn(picked.numel()).to(torch.bfloat16)
            try:
                result = publisher.publish()
                committed[result.version] = result.fingerprint
            except DeltaSyncError as exc:
                failed_publishes += 1
                errors[type(exc).__name__] += 1
            try:
                follower.sync()
            except DeltaSyncError:
                failed_syncs += 1
            print(f"step {step}: committed {publisher.version}, follower at {follower.version}, "
                  f"faults {sum(proxy.injected.values())}", file=sys.stderr)  # fmt: skip
        seconds = time.perf_counter() - start
        published = len(committed)
        proxy.clear()
        injected = dict(proxy.injected)
        requests = dict(proxy.requests)
        final = publisher.publish()
        committed[final.version] = final.fingerprint
        publisher.close()
        expected = fingerprint(bf16_state_dict(model))
        follower.sync()
        fresh = DeltaReceiver(direct)
        fresh.sync()
        lost = 0 if fresh.fingerprint == expected else 1
        # Each committed version, replayed from the bucket, against what the trainer committed.
        pointer = fresh.pointer()
        checker = DeltaReceiver(direct)
        for version in range(pointer.anchors[0].version, pointer.version + 1):
            checker.sync(version)
            if version in committed and checker.fingerprint != committed[version]:
                lost += 1
        figures = {
            "versions_attempted": args.versions,
            "fault_rate": args.fault_rate,
            "faults_injected": injected,
            "faults_total": sum(injected.values()),
            "proxy_requests": requests,
            "versions_published": published,
            "versions_published_after_the_faults": 1,
            "publishes_failed": failed_publishes,
            "publish_errors": dict(errors),
            "versions_lost": lost,
            "follower_syncs_failed": failed_syncs,
            "follower_exact_at_end": follower.fingerprint == expected and follower.version == final.version,
            "verify_ok": fresh.verify(),
            "seconds": round(seconds, 1),
        }
    print(json.dumps(figures, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if figures["versions_lost"] == 0 and figures["follower_exact_at_end"] else 1


if __name__ == "__main__":
    sys.exit(main())
