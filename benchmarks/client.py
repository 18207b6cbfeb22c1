"""What a trainer's calls to its rollout servers cost it: one HTTP client kept open, against a
new client per call (what ``RolloutClient`` did before), on an idle machine and on one whose
cores are all busy.

A server process answers ``RolloutClient``'s routes as a server with ``vllm_ext`` does
(``/deltasync/update`` and the status read through ``/collective_rpc``), from memory, so the
figures are the client's alone: the trainer's CPU seconds (``time.process_time``) and the
wall time per call. ``--busy N ...`` starts N processes that spin on the CPU (the rollout
engines' share of a node) for each further row.

Each row alternates the two ways call by call, so both see the same machine. "new client per
call" closes the client's connections after every call (``RolloutClient.close``), so the
next call builds an ``httpx.Client`` again, as every call did before.

    .venv/bin/python benchmarks/client.py --out benchmarks/results/client-cpu.json
"""

from __future__ import annotations

import argparse
import http.server
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import machine

from deltasync import RolloutClient
from deltasync.examples.launcher import free_port

WAYS = ("one client", "new client per call")


class _Server(http.server.BaseHTTPRequestHandler):
    """Answers an update and a status read as a one-worker server with ``vllm_ext`` does."""

    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # the headers and the body go out as two writes
    version = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/deltasync/update":
            type(self).version = body["version"]
            answer = {"results": [{"version": self.version}], "paused_s": 0.001, "noop": False, "mode": "pause", "note": None}
        elif self.path == "/collective_rpc" and body.get("method") == "deltasync_status":
            answer = {"results": [{"rank": 0, "version": self.version, "fingerprint": f"fp{self.version}",
                                   "last_update": {"version": self.version, "kind": "delta", "nbytes": 1,
                                                   "stage_s": 0.0, "apply_s": 0.0}}]}  # fmt: skip
        else:
            self.send_error(404)
            return
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def _serve(port: int) -> None:
    http.server.ThreadingHTTPServer(("127.0.0.1", port), _Server).serve_forever()


def _spin() -> None:
    while True:
        pass


def _wait_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    with RolloutClient(url) as client:
        while not (state := client.status()[url]).ok:  # a report, never an exception
            if time.monotonic() > deadline:
                raise RuntimeError(f"the benchmark's server at {url} did not answer: {state.error}")
            time.sleep(0.05)


def measure(url: str, calls: int, busy: int) -> dict:
    """``calls`` update-and-status rounds each way, alternated; per call: CPU and wall time."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(busy)]
    for p in spinners:
        p.start()
    try:
        times: dict[str, dict[str, list[float]]] = {way: {"cpu": [], "wall": []} for way in WAYS}
        shared = RolloutClient(url, "t0ken")
        fresh = RolloutClient(url, "t0ken")
        shared.status()  # the shared client is made and connected before the timed calls
        version = 1
        for i in range(calls):
            for way in WAYS if i % 2 == 0 else WAYS[::-1]:
                client = shared if way == WAYS[0] else fresh
                cpu, wall = time.process_time(), time.perf_counter()
                report = client.update(version)
                assert report.ok and client.status()[url].version == version, report
                times[way]["cpu"].append((time.process_time() - cpu) / 2)  # two calls: update, status
                times[way]["wall"].append((time.perf_counter() - wall) / 2)
                if way == WAYS[1]:
                    fresh.close()  # the next call makes its client again
                version += 1
        shared.close()
    finally:
        for p in spinners:
            p.kill()
            p.join()
    row: dict = {"busy_processes": busy, "calls": calls}
    for way in WAYS:
        key = "shared" if way == WAYS[0] else "new"
        row[f"{key}_cpu_ms"] = statistics.median(times[way]["cpu"]) * 1e3
        row[f"{key}_wall_ms"] = statistics.median(times[way]["wall"]) * 1e3
        row[f"{key}_wall_ms_max"] = max(times[way]["wall"]) * 1e3
    row["cpu_ratio"] = row["new_cpu_ms"] / row["shared_cpu_ms"] if row["shared_cpu_ms"] > 0 else None
    row["wall_ratio"] = row["new_wall_ms"] / row["shared_wall_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=40, help="update-and-status rounds each way, per row (default 40)")
    cores = os.cpu_count() or 2
    parser.add_argument("--busy", type=int, nargs="+", default=[cores, 2 * cores],
                        help="spinning processes, one row each, after the idle row (default: one and two per core)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    if min(args.busy) < 0:
        parser.error(f"--busy must be 0 or more, got {min(args.busy)}")
    port = free_port()
    server = multiprocessing.Process(target=_serve, args=(port,), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_up(url)
        rows = []
        for busy in sorted({0, *args.busy}):
            print(f"measuring {args.calls} rounds each way with {busy} busy processes ...", file=sys.stderr, flush=True)
            rows.append(measure(url, args.calls, busy))
    finally:
        server.kill()
        server.join()
    print("| busy processes | one client: CPU per call | new client per call: CPU | ratio "
          "| one client: wall (median, max) | new client per call: wall (median, max) |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['busy_processes']} | {r['shared_cpu_ms']:.2f} ms | {r['new_cpu_ms']:.2f} ms | {r['cpu_ratio'] or float('nan'):.1f}x "
              f"| {r['shared_wall_ms']:.1f}, {r['shared_wall_ms_max']:.1f} ms "
              f"| {r['new_wall_ms']:.1f}, {r['new_wall_ms_max']:.1f} ms |")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {"machine": machine(), "calls": args.calls, "rows": rows,
                  "what": "per call (an update or a status read) of RolloutClient against an in-memory server "
                          "process: the trainer process's CPU time and the wall time, medians over the calls"}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
