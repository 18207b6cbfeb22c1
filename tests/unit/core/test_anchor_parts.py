"""A single writer's large anchor, written as parts at once (format version 2's split anchor).

The planner (:func:`~deltasync.format.anchor_parts`) is held to the protocol's tiling rule and
to depending on names and sizes alone; the publisher's split anchors are read back bit for bit
by a late joiner, are the same bytes whatever the thread count, and a part that fails to write
commits nothing."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from helpers import GatedStore, checkpoint_model, publish_chain, same_state, small_transformer, train_step

from deltasync import ConfigError, DeltaPublisher, DeltaReceiver, StoreError, bf16_state_dict, fingerprint, open_store
from deltasync.format import AnchorSource, anchor_parts, part_path
from deltasync.reader.chain import read_pointer
from deltasync.reader.parts import fetch_anchor

SHAPES = {"a.weight": (8, 6), "b.weight": (40,), "c.bias": (3,), "d.weight": (16, 4), "e.weight": (5, 5)}


def sources(sizes: dict[str, int], dtype: torch.dtype = torch.bfloat16) -> list[AnchorSource]:
    return [AnchorSource(name, (n,), 0, n, lambda: (), dtype) for name, n in sizes.items()]


def check_tiling(parts: list[list[AnchorSource]], sizes: dict[str, int]) -> None:
    """Every part lists every tensor in name order; each tensor is whole in exactly one part,
    an empty range at 0 before it and at its end after it (section 18's tiling)."""
    for listed in parts:
        assert [s.name for s in listed] == sorted(sizes)
    for name, n in sizes.items():
        ranges = [next((s.begin, s.end) for s in listed if s.name == name) for listed in parts]
        home = [k for k, r in enumerate(ranges) if r != (0, 0) and r != (n, n)] if n else []
        assert len(home) == (1 if n else 0), (name, ranges)
        if n:
            k = home[0]
            assert ranges[k] == (0, n) and all(r == (0, 0) for r in ranges[:k]) and all(r == (n, n) for r in ranges[k + 1 :])


def test_an_anchor_within_one_part_stays_one_file() -> None:
    given = sources({"b": 10, "a": 20})
    (only,) = anchor_parts(given, 60)
    assert only == given  # as given: the single-file anchor's own sources
    with pytest.raises(ValueError, match="part_bytes must be 1 or more"):
        anchor_parts(given, 0)


@pytest.mark.parametrize("part_bytes", [64, 100, 250, 400])
def test_parts_hold_whole_tensors_in_name_order_and_tile_every_tensor(part_bytes: int) -> None:
    sizes = {f"t{k:02d}": n for k, n in enumerate([30, 7, 64, 1, 0, 200, 18, 18, 40, 3, 90])}
    parts = anchor_parts(sources(dict(reversed(sizes.items()))), part_bytes)
    total = 2 * sum(sizes.values())
    assert 1 < len(parts) <= math.ceil(total / part_bytes)
    check_tiling(parts, sizes)
    held = [[s.name for s in listed if s.end > s.begin and s.begin == 0] for listed in parts]
    assert [name for names in held for name in names] == sorted(n for n, size in sizes.items() if size)
    assert all(names for names in held)  # no part is left empty
    # Balanced: no part holds more than a part's share plus one tensor.
    share, largest = total / len(parts), 2 * max(sizes.values())
    for listed in parts:
        assert sum(2 * (s.end - s.begin) for s in listed) <= share + largest


def test_a_tensor_larger_than_a_part_is_a_part_of_its_own() -> None:
    sizes = {"a": 10, "b": 1000, "c": 10, "d": 10}
    parts = anchor_parts(sources(sizes), 100)
    check_tiling(parts, sizes)
    homes = {s.name: k for k, listed in enumerate(parts) for s in listed if s.end > s.begin and s.begin == 0}
    assert homes["b"] not in {homes["a"], homes["c"], homes["d"]}


@pytest.mark.parametrize(
    "sizes",
    [{"a": 100, "b": 0, "c": 100}, {"a": 0, "b": 0, "c": 300, "d": 50}, {"a": 60, "b": 60, "c": 0, "d": 0}],
    ids=["between", "first", "last"],
)
def test_an_empty_tensor_never_makes_a_part_of_its_own(sizes: dict[str, int]) -> None:
    """An empty tensor's middle falls where the tensor before it ends, which may be a part no
    other tensor's middle falls in: it goes with a nonempty neighbour, and no part is empty."""
    parts = anchor_parts(sources(sizes), 100)
    check_tiling(parts, sizes)
    assert len(parts) > 1
    for listed in parts:
        assert any(s.end > s.begin for s in listed)  # every part holds data


def test_the_split_depends_on_names_and_sizes_alone() -> None:
    sizes = {f"w{k}": 10 + 3 * k for k in range(20)}
    a = anchor_parts(sources(sizes), 90)
    b = anchor_parts(sources(dict(reversed(sizes.items()))), 90)
    assert [[(s.name, s.begin, s.end) for s in p] for p in a] == [[(s.name, s.begin, s.end) for s in p] for p in b]
    one_byte = anchor_parts(sources({k: 2 * v for k, v in sizes.items()}, torch.float8_e4m3fn), 90)
    assert len(one_byte) == len(a)  # sized in bytes: twice the one-byte elements weigh the same


@pytest.mark.parametrize("bad", [0, -1])
def test_a_part_size_below_one_byte_is_refused_naming_it(tmp_path: Path, bad: int) -> None:
    with pytest.raises(ConfigError, match=f"anchor_part_bytes must be >= 1, got {bad}"):
        DeltaPublisher(tmp_path / "bucket", checkpoint_model(SHAPES), anchor_part_bytes=bad)
    assert not (tmp_path / "bucket").exists() or not any((tmp_path / "bucket").iterdir())  # nothing written


def test_a_large_anchor_is_written_as_parts_and_read_back_bit_for_bit(tmp_path: Path) -> None:
    states = publish_chain(tmp_path / "b", checkpoint_model(SHAPES), deltas=3, anchor_at=2, anchor_part_bytes=100)
    store = open_store(tmp_path / "b")
    pointer = read_pointer(store)
    assert [a.version for a in pointer.anchors] == [0, 2]
    for entry in pointer.anchors:
        assert not entry.path and len(entry.parts) > 2
        assert [p.path for p in entry.parts] == [part_path("anchor", entry.version, n) for n in range(len(entry.parts))]
        anchor = fetch_anchor(store, entry)
        assert same_state(anchor.tensors, states[entry.version])
        assert anchor.header.fingerprint == fingerprint(states[entry.version])
    assert all(not e.parts for e in pointer.chain[1:] if e.kind == "delta")  # deltas stay one file
    late = DeltaReceiver(tmp_path / "b")
    staged = late.stage(3)
    assert (staged.kind, staged.versions) == ("anchor", [2, 3])
    late.apply(staged)
    assert same_state(late.state_dict(), states[3]) and late.fingerprint == fingerprint(states[3])


def test_split_anchors_are_the_same_bytes_whatever_the_thread_count(tmp_path: Path, monkeypatch) -> None:
    files = {}
    for threads in ("1", "3"):
        monkeypatch.setenv("DELTASYNC_ENCODE_THREADS", threads)
        bucket = tmp_path / threads
        publish_chain(bucket, checkpoint_model(SHAPES), deltas=2, anchor_at=2, anchor_part_bytes=100)
        files[threads] = {
            f"{d}/{name}": (bucket / d / name).read_bytes() for d in ("anchors", "deltas") for name in os.listdir(bucket / d)
        }
    assert any(".part" in name for name in files["1"])
    assert files["1"] == files["3"]


def test_a_part_that_fails_to_write_commits_nothing(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "bucket")
    model = small_transformer(0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    with DeltaPublisher(store, model, opt, anchor_part_bytes=4096, anchor_every=1000, anchor_bytes_ratio=0) as publisher:
        store.fail = part_path("anchor", 0, 1)
        with pytest.raises(StoreError, match="injected failure writing 'anchors/00000000.part1.safetensors'"):
            publisher.publish()
        assert publisher.pointer is None and not store.exists("pointer.json")
        assert store.list("anchors/") == []  # the parts written before the failure are deleted
        result = publisher.publish()  # tried again: the anchor, whole
        parts = len(publisher.pointer.anchors[0].parts)
        assert result.version == 0 and parts > 2
        train_step(model, opt, seed=1)
        publisher.publish()
        train_step(model, opt, seed=2)
        # The last part: with any thread count, part 0 was written before the last one started.
        store.fail = part_path("anchor", 2, parts - 1)
        result = publisher.publish(anchor=True)  # the delta commits; its anchor, written after, fails
        publisher.flush()
        assert result.version == 2 and [a.version for a in publisher.pointer.anchors] == [0]
        assert [p for p in store.list("anchors/") if "00000002" in p] == []  # its parts written before: deleted
        want = bf16_state_dict(model)
    late = DeltaReceiver(tmp_path / "bucket")
    late.sync()
    assert late.version == 2 and same_state(late.state_dict(), want)


def test_cpu_chunks_waiting_for_their_hash_stay_bounded_across_parts(tmp_path: Path, monkeypatch) -> None:
    """Parts written at once each hand their CPU chunks to the shared hash threads. A chunk may
    be a copy (a frozen fp32 parameter's bf16 values), so the chunks not hashed yet are bounded
    for all parts together: twice the thread count, whatever the number of parts."""
    import concurrent.futures
    import threading
    import time

    import deltasync.trainer.writer as W

    threads = 3
    monkeypatch.setenv("DELTASYNC_ENCODE_THREADS", str(threads))
    hash_share = W.fingerprint_slice_share

    def slow(name, values, offset):  # type: ignore[no-untyped-def]
        time.sleep(0.01)
        return hash_share(name, values, offset)

    waiting, peak, lock = [0], [0], threading.Lock()

    class Counting(concurrent.futures.ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            if fn is not slow:
                return super().submit(fn, *args, **kwargs)
            with lock:
                waiting[0] += 1
                peak[0] = max(peak[0], waiting[0])
            job = super().submit(fn, *args, **kwargs)

            def done(_job) -> None:  # type: ignore[no-untyped-def]
                with lock:
                    waiting[0] -= 1

            job.add_done_callback(done)
            return job

    monkeypatch.setattr(W, "fingerprint_slice_share", slow)
    monkeypatch.setattr(W, "ThreadPoolExecutor", Counting)
    model = torch.nn.Module()
    for k in range(6):  # frozen fp32: each chunk is a bf16 copy; 4M elements, 8 MiB of bf16 each
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(torch.randn(4 << 20), requires_grad=False)
        model.add_module(f"frozen{k}", layer)
    model.trained = torch.nn.Parameter(torch.randn(16).to(torch.bfloat16))
    optimizer = torch.optim.SGD([model.trained], lr=0.1)
    with DeltaPublisher(tmp_path / "b", model, optimizer, anchor_part_bytes=8 << 20, anchor_bytes_ratio=0) as publisher:
        publisher.publish()
        parts = len(publisher.pointer.anchors[0].parts)
    assert parts == 6
    assert 0 < peak[0] <= 2 * threads
    late = DeltaReceiver(tmp_path / "b")
    late.sync()
    assert late.verify() and late.fingerprint == publisher.fingerprint
