"""The scale benchmark's store wrapper counts exactly, and its ``--quick`` size runs end to end
(tiny models, two followers), so the script cannot rot between reference runs."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scale
from _counting_store import CountingStore

from deltasync import DeltaReceiver, NotFoundError
from deltasync.stores import LocalStore


def test_the_store_wrapper_counts_requests_and_bytes_and_adds_its_latency(tmp_path):
    store = CountingStore(LocalStore(tmp_path / "b"), latency=0.01)
    start = time.perf_counter()
    store.write_bytes("a/x.bin", b"12345")
    store.write_stream("latest.json", [b"{}", memoryview(b"abc")])
    assert store.read_bytes("a/x.bin") == b"12345"
    assert store.read_head("a/x.bin", 2) == b"123"
    with store.open_read("a/x.bin") as f:
        buffer = bytearray(4)
        assert f.readinto(buffer) == 4 and f.read() == b"5"
    assert store.exists("a/x.bin") and store.list("a/") == ["a/x.bin"]
    first = store.change_tag("latest.json")
    assert first is not None and store.change_tag("latest.json") == first
    assert store.change_tag("a/x.bin") is None  # only the pointer has a tag (and costs no request)
    with pytest.raises(NotFoundError):
        store.read_bytes("missing")
    store.delete(["a/x.bin"])
    elapsed = time.perf_counter() - start
    counts = store.counts()
    assert counts["by_op"] == {"write": 2, "read": 4, "exists": 1, "list": 1, "stat": 2, "delete": 1}
    assert counts["requests"] == 11
    assert (counts["bytes_written"], counts["bytes_read"]) == (10, 5 + 3 + 5)
    assert elapsed >= 11 * 0.01


def test_a_receiver_through_the_wrapper_reads_what_the_bucket_holds(tmp_path):
    from helpers import small_transformer

    from deltasync import DeltaPublisher

    bucket = tmp_path / "b"
    with DeltaPublisher(bucket, small_transformer()) as publisher:
        publisher.publish()
    store = CountingStore(LocalStore(bucket))
    DeltaReceiver(store).sync()
    sizes = {p: (bucket / p).stat().st_size for p in ("latest.json", "anchors/00000000.safetensors")}
    counts = store.counts()
    assert counts["by_op"]["read"] >= 2 and counts["bytes_written"] == 0
    assert counts["bytes_read"] >= sum(sizes.values())


def test_the_quick_benchmark_runs_and_records_its_results(tmp_path):
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    argv = ["--quick", "--out", str(out)]
    if importlib.util.find_spec("matplotlib") is not None:
        argv += ["--plot", str(png)]
    if importlib.util.find_spec("vllm") is None:
        argv.append("--no-inplace")
    assert scale.main(argv) == 0
    results = json.loads(out.read_text())
    assert results["machine"]["cpus"] and [r["size"] for r in results["sizes"]] == ["tiny-2", "tiny-8"]
    for row in results["sizes"]:
        assert 0.009 < row["density"] < 0.011 and row["late_joiner_exact"]
        assert row.get("inplace_exact", "--no-inplace" in argv)
    densities = [r["density"] for r in results["density"]["rows"]]
    assert densities == sorted(densities) and len(densities) == 4
    fleets = {(r["followers"], r["poll"]): r for r in results["followers"]}
    assert set(fleets) == {(1, "policy"), (1, "fixed"), (2, "policy")}
    assert all(r["exact"] and r["p99_s"] is not None and r["requests_per_version"] > 0 for r in fleets.values())
    sixty = next(r for r in results["polling"] if (r["step_s"], r["jitter"]) == (60, 0))
    assert sixty["fixed"]["reads_per_hour"] == 1800 and sixty["policy"]["reads_per_hour"] < 200
    assert set(results["targets"]) == set(scale.TARGETS)
    assert png.exists() or "--plot" not in argv
