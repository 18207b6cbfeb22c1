"""The in-flight benchmark's own arithmetic: how it reads a stream and how it compares windows.

A throughput target is only as good as what counts the tokens, so the SSE reader and the
summaries are checked here on made-up phases with known answers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import inflight


class _Chunks:
    def __init__(self, body: bytes, size: int) -> None:
        self.body, self.size = body, size

    def iter_bytes(self):
        for i in range(0, len(self.body), self.size):
            yield self.body[i : i + self.size]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_sse_lines_end_only_at_cr_or_lf(size: int) -> None:
    # U+2028 and U+0085 are legal unescaped in JSON strings; str.splitlines would cut there.
    body = 'data: {"text": "a\u2028b\u0085c é"}\r\n\r\n: x-deltasync-versions 3-4\ndata: [DONE]\n\n'.encode()
    assert list(inflight.sse_lines(_Chunks(body, size))) == [
        'data: {"text": "a\u2028b\u0085c é"}', "", ": x-deltasync-versions 3-4", "data: [DONE]", "",
    ]  # fmt: skip


def test_tokens_are_spread_over_the_step_that_made_them() -> None:
    streams = inflight.Streams("http://unused", 2, 10)
    # Two streams, each step (1 s) gives every stream one token, all arriving at the step's end;
    # the second stream's request was sent at 0.5 and its first chunk came with the step at 2.
    streams.requests = [{"start": 0.0, "times": [1.0, 2.0, 3.0, 4.0], "tokens": [1, 2, 3, 4]},
                        {"start": 0.5, "times": [2.0, 3.0, 4.0], "tokens": [1, 2, 3]}]  # fmt: skip
    assert streams.tokens_between(0.0, 4.0) == pytest.approx(7)
    # A window that ends just after the step at 3 arrived, and the same length right after it:
    # by arrival they would hold 2 and 0 tokens; the steps made 0.2 and 0.2.
    assert streams.tokens_between(2.9, 3.0) == pytest.approx(0.2)
    assert streams.tokens_between(3.0, 3.1) == pytest.approx(0.2)
    assert streams.tokens_between(0.5, 1.25) == pytest.approx(0.75 + 0.75 / 1.5)  # the second: 1 token over 1.5 s
    assert streams.tokens_between(4.0, 9.0) == 0 and streams.tokens_between(-1.0, 0.0) == 0


def _phase(mode, start, seconds, tokens, updates=()):
    staged = sum(u.get("staged", 0) for u in updates)
    staging = sum(u["stage"][1] - u["stage"][0] for u in updates)
    return {"phase": str(mode), "mode": mode, "start": start, "end": start + seconds, "seconds": seconds,
            "tokens": tokens, "tokens_per_s": tokens / seconds, "preemptions": 0.0, "updates": list(updates),
            "gap_p99_outside_updates_s": 0.2, "gap_max_outside_updates_s": 0.3, "engine_gap_p99_outside_updates_s": 0.01,
            "engine_gap_max_outside_updates_s": 0.02, "staging_s": staging, "staged_tokens": staged}  # fmt: skip


def _update(t0, t1, tb, window_tokens, rest=None, rest_tokens=0, request_tokens=0):
    u = {"stage": [t0, t1], "update": [t1, tb], "window": [t0, tb], "paused_s": 0.0, "apply_s": 0.03, "request_s": tb - t1,
         "in_flight": 8, "recomputed_tokens_est": 0, "max_gap_s": 0.2, "max_gap_window_s": 0.25, "engine_gap_s": 0.05,
         "window_tokens": window_tokens,
         "staged": window_tokens - request_tokens, "stage_tokens": window_tokens - request_tokens,
         "request_tokens": request_tokens}  # fmt: skip
    if rest is not None:
        u["rest"], u["rest_tokens"] = rest, rest_tokens
    return u


def test_each_phase_is_compared_with_its_neighbours_and_pairs_with_the_window_after_each_update() -> None:
    # The machine slows from 60 to 40 tokens/s; the updates cost 10% of whatever the rate is.
    # Staging keeps the rate; each 1 s request gets half of it.
    ups = [_update(10.0, 14.0, 15.0, 45, rest=[15.0, 20.0], rest_tokens=50, request_tokens=5),  # 9/s against 10/s
           _update(20.0, 24.0, 25.0, 36, rest=[25.0, 30.0], rest_tokens=40, request_tokens=4)]  # fmt: skip
    phases = [
        _phase(None, 0.0, 10.0, 600),  # 60/s
        _phase("inflight", 10.0, 20.0, 171, ups),
        _phase(None, 30.0, 10.0, 400),  # 40/s
    ]
    summary = inflight.summarize(phases)
    r = summary["inflight"]
    assert summary["baseline_tokens_per_s"] == pytest.approx(50.0)
    assert r["throughput_ratio"] == pytest.approx(171 / 20 / 50)
    assert r["throughput_ratio_per_phase"] == [pytest.approx(171 / 20 / 50)]
    assert r["throughput_ratio_paired"] == pytest.approx((81 / 10) / (90 / 10))  # 0.9: the drift cancels
    # ... and splits into the staging part and the request part, each against the same rest windows.
    assert r["paired_ratio_staging"] == pytest.approx((72 / 8) / (90 / 10))  # 1.0
    assert r["paired_ratio_request"] == pytest.approx((9 / 2) / (90 / 10))  # 0.5
    assert r["request_share_of_window"] == pytest.approx(2 / 10)
    # Each update against its own rest window (both 0.9 here), and what each cost: 5 s at 90%.
    assert r["throughput_ratio_paired_median"] == pytest.approx(0.9)
    assert r["lost_s_per_update_median"] == pytest.approx(0.5)
    checks = inflight.verdicts(summary)
    assert checks["throughput_ratio_paired"]["pass"] is False and checks["preemptions"]["pass"] is True


def test_without_rest_windows_there_is_no_paired_figure() -> None:
    phases = [_phase(None, 0.0, 10.0, 500), _phase("inflight", 10.0, 5.0, 240, [_update(10.0, 14.0, 15.0, 240)]),
              _phase(None, 15.0, 10.0, 500)]  # fmt: skip
    summary = inflight.summarize(phases)
    assert summary["inflight"]["throughput_ratio_paired"] is None
    assert summary["inflight"]["throughput_ratio_paired_median"] is None
    assert summary["inflight"]["throughput_ratio"] == pytest.approx(48 / 50)
    assert "throughput_ratio_paired" not in inflight.verdicts(summary)
    assert "| - |" in inflight.table(summary)


def test_the_median_pair_shrugs_off_a_slump_in_one_window() -> None:
    # Three updates each cost 2% of their window; in the second pair the machine slumped to half
    # speed during the rest window, which lifts the pooled ratio but not the median.
    ups = [_update(0.0, 3.0, 4.0, 39.2, rest=[4.0, 8.0], rest_tokens=40),
           _update(8.0, 11.0, 12.0, 39.2, rest=[12.0, 16.0], rest_tokens=20),
           _update(16.0, 19.0, 20.0, 39.2, rest=[20.0, 24.0], rest_tokens=40)]  # fmt: skip
    phases = [_phase(None, -10.0, 10.0, 100), _phase("inflight", 0.0, 24.0, 197.6, ups), _phase(None, 24.0, 10.0, 100)]
    r = inflight.summarize(phases)["inflight"]
    assert r["throughput_ratio_paired"] == pytest.approx(117.6 / 100)
    assert r["throughput_ratio_paired_median"] == pytest.approx(0.98)
    assert r["lost_s_per_update_median"] == pytest.approx(4 * 0.02)


def test_the_engine_standstill_is_the_longest_time_between_two_steps_from_the_prefetch_to_the_answer() -> None:
    # Steps of 0.05 s every 0.1 s, a 0.45 s hole inside the update (prefetch at 2.0, answer at
    # 3.0) and a 0.25 s one after its answer, in the same phase.
    steps = [(t / 10, t / 10 + 0.05) for t in range(0, 60)]
    steps = [s for s in steps if not 2.4 < s[0] < 2.9 and not 3.1 < s[0] < 3.35]
    phases = [_phase(None, 0.0, 2.0, 100), _phase("cold", 2.0, 1.5, 50, [_update(2.0, 2.0, 3.0, 50)]),
              _phase(None, 3.5, 2.5, 100)]  # fmt: skip
    inflight.engine_gaps(phases, steps)
    assert phases[1]["updates"][0]["engine_gap_s"] == pytest.approx(0.45)  # 2.45 to 2.9
    assert phases[1]["engine_gap_max_outside_updates_s"] == pytest.approx(0.25)  # 3.15 to 3.4
    assert phases[0]["engine_gap_p99_outside_updates_s"] == pytest.approx(0.05)
    summary = inflight.summarize(phases)
    assert summary["cold"]["engine_max_gap_s"] == pytest.approx(0.45)
    assert summary["baseline_engine_gap_max_s"] == pytest.approx(0.05)
    checks = inflight.gap_verdicts(summary)
    # The engine's bound: max(0.1 s, 2 x the no-update p99 of the time between steps, 0.05 s).
    assert checks["engine_cold"]["bound"] == "<= 0.100" and checks["engine_cold"]["pass"] is False
    assert checks["cold"]["value"] == 0.25  # the streams' longest gap from the prefetch on


def test_a_phase_settles_only_when_every_stream_makes_tokens_again() -> None:
    streams = inflight.Streams("http://unused", 2, 10)
    streams.requests = [{"client": 0, "times": [1.0, 5.0]}, {"client": 1, "times": [1.0, 2.0]}]
    assert streams.streaming_since(1.5)
    assert not streams.streaming_since(3.0)  # client 1 is still recomputing its KV
    streams.requests.append({"client": 1, "times": []})  # its next request, no token yet
    assert not streams.streaming_since(1.5)
    streams.requests[-1]["times"].append(6.0)
    assert streams.streaming_since(3.0)
    with pytest.raises(RuntimeError, match="made no token"):
        streams.wait_streaming(since=10.0, timeout=0.0)
