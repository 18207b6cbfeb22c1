"""How long the trainer waits for a publish, with a slow remote bucket, background vs blocking.

The model and the training trace are ``benchmarks/codec.py``'s (Qwen2.5-0.5B tensor shapes
and names, its simulated gradients and calibrated learning rate, fused AdamW), imported from
it. Three real :class:`~deltasync.DeltaPublisher` s follow the same model and optimizer, each
into its own bucket behind :class:`EmulatedBucket`, a store wrapper that makes a local
directory behave like a remote object store: every operation sleeps a latency (default
100 ms) and every byte read or written sleeps at a bandwidth (default 50 MB/s), streamed
writes and buffered reads included, so the publisher streams its anchors through it.

Per version, in one run and on the same weights:

1. the simulated gradient and the AdamW step (the trainer's own work);
2. **blocking**: publisher B, ``publish()`` then ``flush()``: the version's delta and, when
   its anchor is due, the anchor too, before the trainer may go on (what a trainer that
   publishes synchronously pays);
3. **background**: publisher A, ``submit()``: the trainer waits until the version is
   captured (and for the version before it, if that is still in flight); the wall time of
   the call is the trainer's wait;
4. a follower (``DeltaReceiver``) syncs A's bucket through a store that counts the bytes
   it reads;
5. **background, overlapping capture**: publisher C (``capture="overlap"``), ``submit()``
   returns at once and C finds the changes in its thread while the next simulated gradient
   is computed (and only that); the next AdamW step waits for that capture if it is not
   done. Its wait is ``submit()`` plus that hold (``result.blocked_s``).

The bucket time of a version is the least its files cost at the emulated latency and
bandwidth: the writes of its delta (or anchor) and of the commit (history and pointer), and
of its anchor and that anchor's commit when one is written beside it, as operations x latency
+ bytes / bandwidth, from what publisher A actually wrote. Version 0 (the chain's first
anchor, without a delta) is set-up: both publishers write it and the run waits for both
before the measured versions.

Run from the repository root, e.g. ``python benchmarks/trainer_stall.py --scale 0.1``; see
benchmarks/README.md for the reference run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
try:
    import deltasync  # noqa: F401
except ImportError:  # a checkout without an install: import the package next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import deltasync.trainer.writer as writer_module
from _machine import machine
from codec import DEFAULT_LR, ModelShape, SimulatedGradients, build_model, log, save_outputs
from deltasync import DeltaPublisher, DeltaReceiver
from deltasync.trainer.detector import named_parameters
from deltasync.stores import LocalStore

TARGETS = {
    "delta_wait_vs_bucket": ("trainer wait / bucket time, delta versions", 0.25),
    "anchor_wait_vs_bucket": ("trainer wait / bucket time, versions whose anchor is due", 0.10),
    "delta_overlap_vs_bucket": ("trainer wait / bucket time, delta versions, capture='overlap'", 0.25),
    "anchor_overlap_vs_bucket": ("trainer wait / bucket time, versions whose anchor is due, capture='overlap'", 0.10),
    "follower_bytes_vs_deltas": ("follower bytes / (first anchor + every delta)", 1.15),
}


# --------------------------------------------------------------------------- stores


@dataclass
class Op:
    """One store operation: what it moved and how long the emulation slept for it."""

    thread: int
    op: str
    path: str
    nbytes: int
    slept: float
    start: float
    end: float


class CountedFile:
    """A store's open file that counts what is read from it (and may pace it: ``pace(n)``
    sleeps for ``n`` bytes and returns the seconds slept)."""

    def __init__(self, f: Any, pace: Any = None) -> None:
        self.f, self.pace = f, pace
        self.nbytes, self.slept = 0, 0.0

    def _count(self, n: int) -> None:
        self.nbytes += n
        if self.pace is not None:
            self.slept += self.pace(n)

    def readinto(self, view: Any) -> int:
        n = self.f.readinto(view)
        self._count(n or 0)
        return n

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self._count(len(data))
        return data


class EmulatedBucket:
    """A remote bucket emulated over a local directory (a :class:`~deltasync.stores.LocalStore`).

    Every operation sleeps ``latency`` seconds once, and every byte read or written sleeps at
    ``bandwidth`` bytes per second, chunk by chunk for streamed writes (so an anchor streams
    at the emulated bandwidth, never whole in memory). The sleeps are the bucket's time; each
    operation is logged (:class:`Op`) with the thread that ran it.
    """

    def __init__(self, root: str | os.PathLike[str], *, latency: float = 0.1, bandwidth: float = 50e6) -> None:
        self.inner = LocalStore(root)
        self.url = self.inner.url
        self.latency = latency
        self.bandwidth = bandwidth
        self.ops: list[Op] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"EmulatedBucket({str(self.inner.root)!r}, latency={self.latency}, bandwidth={self.bandwidth:g})"

    def _sleep(self, seconds: float) -> float:
        if seconds > 0:
            time.sleep(seconds)
        return seconds

    def _record(self, op: str, path: str, nbytes: int, slept: float, start: float) -> None:
        with self._lock:
            self.ops.append(Op(threading.get_ident(), op, path, nbytes, slept, start, time.perf_counter()))

    def _read(self, op: str, path: str, read: Any) -> Any:
        start = time.perf_counter()
        slept = self._sleep(self.latency)
        try:
            data = read()
        except Exception:
            self._record(op, path, 0, slept, start)
            raise
        slept += self._sleep(len(data) / self.bandwidth)
        self._record(op, path, len(data), slept, start)
        return data

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        return self._read("read", path, lambda: self.inner.read_bytes(path, limit))

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[Any]:
        start = time.perf_counter()
        slept = self._sleep(self.latency)
        with self.inner.open_read(path) as f:
            counted = CountedFile(f, lambda n: self._sleep(n / self.bandwidth))
            try:
                yield counted
            finally:
                self._record("read", path, counted.nbytes, slept + counted.slept, start)

    def write_bytes(self, path: str, data: bytes) -> None:
        self.write_stream(path, (data,))

    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        start = time.perf_counter()
        slept = self._sleep(self.latency)
        sent = 0

        def paced() -> Iterator[bytes | memoryview]:
            nonlocal slept, sent
            for chunk in chunks:
                n = len(chunk) if isinstance(chunk, bytes) else chunk.nbytes
                slept += self._sleep(n / self.bandwidth)
                sent += n
                yield chunk

        try:
            self.inner.write_stream(path, paced())
        finally:
            self._record("write", path, sent, slept, start)

    def exists(self, path: str) -> bool:
        start = time.perf_counter()
        slept = self._sleep(self.latency)
        try:
            return self.inner.exists(path)
        finally:
            self._record("exists", path, 0, slept, start)

    def list(self, prefix: str = "") -> list[str]:
        start = time.perf_counter()
        slept = self._sleep(self.latency)
        try:
            return self.inner.list(prefix)
        finally:
            self._record("list", prefix, 0, slept, start)

    def delete(self, paths: Iterable[str]) -> None:
        paths = list(paths)
        start = time.perf_counter()
        slept = self._sleep(self.latency)  # one batch request, as object stores allow
        try:
            self.inner.delete(paths)
        finally:
            self._record("delete", ",".join(paths), 0, slept, start)


class CountingStore:
    """A local bucket that counts the bytes read from it, per path (a follower's downloads)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.inner = LocalStore(root)
        self.url = self.inner.url
        self.reads: list[tuple[str, int]] = []

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        data = self.inner.read_bytes(path, limit)
        self.reads.append((path, len(data)))
        return data

    @contextlib.contextmanager
    def open_read(self, path: str) -> Iterator[Any]:
        with self.inner.open_read(path) as f:
            counted = CountedFile(f)
            try:
                yield counted
            finally:
                self.reads.append((path, counted.nbytes))

    def write_bytes(self, path: str, data: bytes) -> None:
        raise AssertionError("a follower never writes")

    def write_stream(self, path: str, chunks: Iterable[bytes | memoryview]) -> None:
        raise AssertionError("a follower never writes")

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, paths: Iterable[str]) -> None:
        raise AssertionError("a follower never deletes")

    def total(self, prefix: str = "") -> int:
        return sum(n for path, n in self.reads if path.startswith(prefix))


def bucket_time(ops: list[Op], latency: float, bandwidth: float) -> dict[int, dict[str, float]]:
    """Per version, the writes of its files and commits: count, bytes and least time.

    A data file (``deltas/V...`` or ``anchors/V...``) belongs to version V; the history and
    pointer writes that follow it on the same thread are its commit.
    """
    tags: dict[int, int] = {}
    out: dict[int, dict[str, float]] = {}
    for op in ops:
        if op.op != "write":
            continue
        name = op.path.rsplit("/", 1)[-1]
        if op.path.startswith(("deltas/", "anchors/")):
            tags[op.thread] = int(name.split(".", 1)[0])
            kind = "anchor" if op.path.startswith("anchors/") else "delta"
        else:
            kind = "commit"
        version = tags.get(op.thread)
        if version is None:
            continue
        rec = out.setdefault(version, {"writes": 0, "bytes": 0, "anchor_bytes": 0, "delta_bytes": 0, "commit_bytes": 0})
        rec["writes"] += 1
        rec["bytes"] += op.nbytes
        rec[f"{kind}_bytes"] += op.nbytes
    for rec in out.values():
        rec["seconds"] = rec["writes"] * latency + rec["bytes"] / bandwidth
    return out


# --------------------------------------------------------------------------- timing hooks


class Timers:
    """Wall seconds of the publishers' detect and encode steps, by thread."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str, int | None, float]] = []
        self._lock = threading.Lock()

    def wrap(self, what: str, fn: Any, version_of: Any = None) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                version = version_of(args, kwargs) if version_of else None
                with self._lock:
                    self.records.append((threading.get_ident(), what, version, time.perf_counter() - t0))

        return timed

    def take(self) -> list[tuple[int, str, int | None, float]]:
        with self._lock:
            out, self.records = self.records, []
        return out


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(args.seed)
    shape = ModelShape().scaled(args.scale)
    log(f"building a Qwen2.5-0.5B-shaped model at scale {args.scale}: {shape}")
    model = build_model(shape, generator)
    named = list(named_parameters(model))
    params = [p for _, p in named]
    total = sum(p.numel() for p in params)
    log(f"{len(named)} tensors, {total / 1e6:.1f}M parameters ({2 * total / 1e6:.0f} MB in bf16)")
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, fused=True)
    grads = SimulatedGradients(params, generator)
    for w in range(args.warmup):
        t0 = time.perf_counter()
        grads.step()
        optimizer.step()
        log(f"warm-up {w + 1}/{args.warmup}: {time.perf_counter() - t0:.1f}s")

    timers = Timers()
    # delta_pieces (the encode) runs in a publisher's background thread; the thread says whose.
    writer_module.delta_pieces = timers.wrap(
        "encode", writer_module.delta_pieces, lambda a, k: k.get("version")
    )
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="deltasync-stall-bench-", dir=args.workdir) as tmp:
        bucket_a = EmulatedBucket(os.path.join(tmp, "background"), latency=args.latency, bandwidth=args.bandwidth)
        bucket_b = EmulatedBucket(os.path.join(tmp, "blocking"), latency=args.latency, bandwidth=args.bandwidth)
        bucket_c = EmulatedBucket(os.path.join(tmp, "overlap"), latency=args.latency, bandwidth=args.bandwidth)
        options = {"anchor_every": args.anchor_every, "zstd_level": 3}
        t0 = time.perf_counter()
        pub_a = DeltaPublisher(bucket_a, model, optimizer, **options)
        pub_b = DeltaPublisher(bucket_b, model, optimizer, **options)
        # C captures in its background thread while the next gradient is computed; the
        # optimizer's next step waits for that capture (result.blocked_s counts the wait).
        pub_c = DeltaPublisher(bucket_c, model, optimizer, capture="overlap", **options)
        log(f"three publishers built in {time.perf_counter() - t0:.1f}s (anchor_every={args.anchor_every})")
        pub_a.detector.changes = timers.wrap("detect", pub_a.detector.changes)  # type: ignore[method-assign]
        follower_store = CountingStore(os.path.join(tmp, "background"))
        follower = DeltaReceiver(follower_store)

        # ---- version 0: the chain's first anchor, without a delta (set-up, reported apart)
        t0 = time.perf_counter()
        future0 = pub_a.submit()
        root_wait = time.perf_counter() - t0
        t0 = time.perf_counter()
        root_b = pub_b.publish()
        pub_b.flush()
        root_blocking = time.perf_counter() - t0
        t0 = time.perf_counter()
        root_a = future0.result()
        pub_a.flush()
        root_extra = time.perf_counter() - t0
        pub_c.publish()
        pub_c.flush()
        follower.sync()
        if root_a.fingerprint != root_b.fingerprint:
            raise SystemExit("FAIL: the two publishers' version 0 differ")
        ops0 = bucket_time(bucket_a.ops, args.latency, args.bandwidth)[0]
        root = {
            "version": 0, "wait_s": root_wait, "blocking_s": root_blocking, "bucket_s": ops0["seconds"],
            "bucket_bytes": ops0["bytes"], "anchor_bytes": root_a.nbytes, "background_more_s": root_extra,
        }
        log(f"version 0 (root anchor, {root_a.nbytes / 1e6:.1f} MB): submit {root_wait:.3f}s, blocking "
            f"{root_blocking:.2f}s, bucket time {ops0['seconds']:.2f}s")  # fmt: skip
        timers.take()

        futures: dict[int, Future[Any]] = {}
        futures_c: dict[int, Future[Any]] = {}
        done_at: dict[int, float] = {}
        last_return = time.perf_counter()
        read_before = follower_store.total()
        for version in range(1, args.versions + 1):
            rec: dict[str, Any] = {"version": version}
            t0 = time.perf_counter()
            grads.step()
            optimizer.step()
            rec["train_s"] = time.perf_counter() - t0

            # Blocking: publisher B, the version and its anchor before the trainer goes on.
            t0 = time.perf_counter()
            res_b = pub_b.publish()
            rec["blocking_publish_s"] = time.perf_counter() - t0
            pub_b.flush()
            rec["blocking_s"] = time.perf_counter() - t0

            # The trainer's step time between versions: pad to --step-time.
            pad = last_return + args.step_time - time.perf_counter()
            if pad > 0:
                time.sleep(pad)
            rec["pad_s"] = max(pad, 0.0)
            rec["interval_s"] = time.perf_counter() - last_return

            # Background: publisher A.
            first = len(timers.records)
            start = time.perf_counter()
            future = pub_a.submit()
            last_return = time.perf_counter()
            rec["wait_s"] = last_return - start
            rec["_start"] = start
            rec["detect_s"] = sum(s for _, what, _, s in timers.records[first:] if what == "detect")
            futures[version] = future
            future.add_done_callback(lambda f, v=version: done_at.__setitem__(v, time.perf_counter()))

            # The follower syncs whatever A has committed (the version before, normally).
            t0 = time.perf_counter()
            follower.sync()
            rec["follower_version"] = follower.version
            rec["follower_sync_s"] = time.perf_counter() - t0
            rec["follower_read_bytes"] = follower_store.total() - read_before
            read_before = follower_store.total()

            # Overlapping capture: publisher C (its wait is submit() + the next step's hold).
            # Last, so that only the next simulated gradient runs beside its capture.
            t0 = time.perf_counter()
            futures_c[version] = pub_c.submit()
            rec["overlap_submit_s"] = time.perf_counter() - t0
            rec["_res_b"] = res_b
            records.append(rec)
            log(f"version {version}/{args.versions}: trainer waits {rec['wait_s']:.3f}s in submit() "
                f"(detect {rec['detect_s']:.3f}s), blocking "
                f"publish+flush {rec['blocking_s']:.2f}s{' (anchor due)' if res_b.anchor_scheduled else ''}, "
                f"train {rec['train_s']:.2f}s, follower at {follower.version}")  # fmt: skip

        t0 = time.perf_counter()
        pub_a.flush()
        pub_c.flush()
        log(f"background publishers flushed in {time.perf_counter() - t0:.2f}s")
        follower.sync()
        final_read = follower_store.total() - read_before
        encodes = timers.take()
        threads_a = {t.ident for t in pub_a._jobs._threads}  # type: ignore[attr-defined]
        results_a = {v: f.result() for v, f in futures.items()}
        results_c = {v: f.result() for v, f in futures_c.items()}
        times_a = bucket_time(bucket_a.ops, args.latency, args.bandwidth)
        times_b = bucket_time(bucket_b.ops, args.latency, args.bandwidth)
        times_c = bucket_time(bucket_c.ops, args.latency, args.bandwidth)

        # Checks: the same versions, and every reader exact.
        for rec in records:
            v = rec["version"]
            res_a, res_b = results_a[v], rec.pop("_res_b")
            start = rec.pop("_start")
            # The part of the wait spent on the version before (it ended after the call began).
            prev = done_at.get(v - 1)
            rec["waited_previous_s"] = max(0.0, min(prev, start + rec["wait_s"]) - start) if prev is not None else 0.0
            res_c = results_c[v]
            if res_a.fingerprint != res_b.fingerprint or res_a.nbytes != res_b.nbytes:
                raise SystemExit(f"FAIL: version {v}: the background and blocking publishers wrote different versions")
            if (res_c.fingerprint, res_c.nbytes, res_c.anchor_scheduled) != (res_a.fingerprint, res_a.nbytes, res_a.anchor_scheduled):
                raise SystemExit(f"FAIL: version {v}: the overlapping publisher wrote another version than the background one")
            ta, tb = times_a[v], times_b[v]
            anchor_due = res_b.anchor_scheduled
            if res_a.anchor_scheduled != anchor_due:
                raise SystemExit(f"FAIL: version {v}: the two publishers disagree on its anchor")
            rec.update(
                kind="anchor due" if anchor_due else "delta",
                changed_pct=100 * res_a.changed_fraction,
                delta_bytes=res_a.nbytes,
                anchor_bytes=ta["anchor_bytes"],
                bucket_writes=ta["writes"],
                bucket_bytes=ta["bytes"],
                bucket_s=ta["seconds"],
                bucket_s_blocking=tb["seconds"],
                blocked_s=res_a.blocked_s,
                background_s=res_a.seconds,
                encode_s=sum(s for t, what, ver, s in encodes if what == "encode" and ver == v and t in threads_a),
                wait_vs_bucket=rec["wait_s"] / ta["seconds"],
                overlap_wait_s=res_c.blocked_s,
                overlap_hold_s=max(0.0, res_c.blocked_s - rec["overlap_submit_s"]),
                overlap_vs_bucket=res_c.blocked_s / times_c[v]["seconds"],
                blocking_vs_bucket=rec["blocking_s"] / tb["seconds"],
            )
        final_fp = pub_a.fingerprint
        if follower.fingerprint != final_fp or {pub_b.fingerprint, pub_c.fingerprint} != {final_fp} or not follower.verify():
            raise SystemExit("FAIL: the follower is not at the trainer's last version")
        late_store = CountingStore(os.path.join(tmp, "background"))
        late = DeltaReceiver(late_store)
        late.sync()
        if late.fingerprint != final_fp:
            raise SystemExit("FAIL: a late joiner is not at the trainer's last version")
        log(f"verified: follower and late joiner at version {late.version}, fingerprint {final_fp}")
        follower_reads = follower_store.reads
        late_reads = late_store.reads
        ops_a = [vars(op) for op in bucket_a.ops]
        pub_a.close()
        pub_b.close()
        pub_c.close()

    follower_anchor = sum(n for p, n in follower_reads if p.startswith("anchors/"))
    follower_delta = sum(n for p, n in follower_reads if p.startswith("deltas/"))
    follower_other = sum(n for p, n in follower_reads if not p.startswith(("anchors/", "deltas/")))
    deltas_total = sum(r["delta_bytes"] for r in records)
    follower_total = follower_anchor + follower_delta + follower_other
    follower = {
        "bytes_read": follower_total,
        "anchor_bytes_read": follower_anchor,
        "delta_bytes_read": follower_delta,
        "pointer_bytes_read": follower_other,
        "anchor_files_read": sorted({p for p, _ in follower_reads if p.startswith("anchors/")}),
        "first_anchor_bytes": root["anchor_bytes"],
        "deltas_bytes": deltas_total,
        "final_sync_bytes": final_read,
        "ratio": follower_total / (root["anchor_bytes"] + deltas_total),
        "late_joiner_bytes": sum(n for _, n in late_reads),
        "late_joiner_files": sorted({p for p, _ in late_reads if p.startswith(("anchors/", "deltas/"))}),
    }
    return _summary(args, shape, total, len(named), root, records, follower, ops_a)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _summary(args: argparse.Namespace, shape: ModelShape, total: int, tensors: int, root: dict[str, Any],
             records: list[dict[str, Any]], follower: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    groups = {"delta": [r for r in records if r["kind"] == "delta"], "anchor due": [r for r in records if r["kind"] == "anchor due"]}
    stats: dict[str, dict[str, Any]] = {}
    for kind, recs in groups.items():
        stats[kind] = {
            "versions": [r["version"] for r in recs],
            **{key: _median([r[key] for r in recs]) for key in (
                "wait_s", "detect_s", "waited_previous_s", "blocking_s", "blocking_publish_s", "bucket_s",
                "bucket_bytes", "wait_vs_bucket", "blocking_vs_bucket", "background_s", "encode_s", "train_s",
                "interval_s", "changed_pct", "delta_bytes", "overlap_wait_s", "overlap_submit_s", "overlap_hold_s",
                "overlap_vs_bucket",
            )},  # fmt: skip
            "wait_vs_bucket_max": max((r["wait_vs_bucket"] for r in recs), default=None),
        }
    targets = []
    for key, kind, field in (
        ("delta_wait_vs_bucket", "delta", "wait_vs_bucket"),
        ("anchor_wait_vs_bucket", "anchor due", "wait_vs_bucket"),
        ("delta_overlap_vs_bucket", "delta", "overlap_vs_bucket"),
        ("anchor_overlap_vs_bucket", "anchor due", "overlap_vs_bucket"),
    ):
        label, bound = TARGETS[key]
        recs = groups[kind]
        value = stats[kind][field]
        if value is None:
            continue
        targets.append({"key": key, "label": label, "value": value, "bound": bound, "met": value <= bound,
                        "versions_met": sum(r[field] <= bound for r in recs), "versions": len(recs)})  # fmt: skip
    label, bound = TARGETS["follower_bytes_vs_deltas"]
    targets.append({"key": "follower_bytes_vs_deltas", "label": label, "value": follower["ratio"], "bound": bound,
                    "met": follower["ratio"] <= bound, "versions_met": None, "versions": len(records)})  # fmt: skip
    return {
        "benchmark": "deltasync trainer stall",
        "command": " ".join(["python", "benchmarks/trainer_stall.py", *args.argv]),
        "config": {
            "scale": args.scale, "versions": args.versions, "warmup": args.warmup, "lr": args.lr,
            "anchor_every": args.anchor_every, "latency_s": args.latency, "bandwidth_Bps": args.bandwidth,
            "step_time_s": args.step_time, "seed": args.seed, "codec": "zstd", "zstd_level": 3,
        },  # fmt: skip
        "model": {"scale": args.scale, "layers": shape.layers, "vocab": shape.vocab, "tensors": tensors, "parameters": total},
        "machine": machine(),
        "root": root,
        "versions": records,
        "stats": stats,
        "follower": follower,
        "targets": targets,
        "ops_background": ops,
    }


def table(result: dict[str, Any]) -> str:
    s, f, root = result["stats"], result["follower"], result["root"]
    lines = [
        "| median over versions | delta versions | versions whose anchor is due |",
        "|---|---:|---:|",
    ]

    def row(label: str, key: str, fmt: str) -> None:
        cells = [("-" if s[k][key] is None else fmt.format(s[k][key])) for k in ("delta", "anchor due")]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    lines.append(f"| versions | {len(s['delta']['versions'])} | {len(s['anchor due']['versions'])} "
                 f"({', '.join(map(str, s['anchor due']['versions']))}) |")  # fmt: skip
    row("changed elements", "changed_pct", "{:.3f}%")
    lines.append("| bytes written (delta + anchor + commits) | " + " | ".join(
        "-" if s[k]["bucket_bytes"] is None else f"{s[k]['bucket_bytes'] / 1e6:.2f} MB" for k in ("delta", "anchor due")) + " |")
    row("bucket time (writes x latency + bytes / bandwidth)", "bucket_s", "{:.3f} s")
    row("**trainer wait, background** (`submit()`)", "wait_s", "**{:.3f} s**")
    row("of which detect (`changes()`)", "detect_s", "{:.3f} s")
    row("of which waiting for the version before", "waited_previous_s", "{:.3f} s")
    row("trainer wait, blocking (`publish()` + `flush()`)", "blocking_s", "{:.3f} s")
    row("blocking `publish()` alone", "blocking_publish_s", "{:.3f} s")
    row("**background wait / bucket time**", "wait_vs_bucket", "**{:.3f}**")
    row("blocking / bucket time", "blocking_vs_bucket", "{:.3f}")
    row("**trainer wait, `capture=\"overlap\"`** (`submit()` + the next step's hold)", "overlap_wait_s", "**{:.3f} s**")
    row("of which `submit()`", "overlap_submit_s", "{:.3f} s")
    row("of which the next optimizer step held for the capture", "overlap_hold_s", "{:.3f} s")
    row("**overlap wait / bucket time**", "overlap_vs_bucket", "**{:.3f}**")
    row("background: capture to commit (`result.seconds`)", "background_s", "{:.3f} s")
    row("background: encode", "encode_s", "{:.3f} s")
    row("trainer step between submits (train + blocking + pad)", "interval_s", "{:.2f} s")
    row("simulated gradient + AdamW step (with the hold)", "train_s", "{:.2f} s")
    lines += [
        "",
        f"Version 0 (the root anchor, {root['anchor_bytes'] / 1e6:.1f} MB, set-up): `submit()` {root['wait_s']:.3f} s, "
        f"blocking {root['blocking_s']:.2f} s, bucket time {root['bucket_s']:.2f} s.",
        "",
        f"Follower (syncing after every version): read {f['bytes_read'] / 1e6:.2f} MB: the first anchor "
        f"{f['anchor_bytes_read'] / 1e6:.2f} MB, deltas {f['delta_bytes_read'] / 1e6:.2f} MB, pointers "
        f"{f['pointer_bytes_read'] / 1e3:.1f} kB; first anchor + every delta = "
        f"{(f['first_anchor_bytes'] + f['deltas_bytes']) / 1e6:.2f} MB. Anchor files read: "
        f"{', '.join(f['anchor_files_read']) or 'none'}. A late joiner read {f['late_joiner_bytes'] / 1e6:.2f} MB "
        f"({', '.join(f['late_joiner_files'])}).",
        "",
        "| target | measured (median) | bound | met | versions that met it |",
        "|---|---:|---:|---|---:|",
    ]
    for t in result["targets"]:
        per = "-" if t["versions_met"] is None else f"{t['versions_met']} of {t['versions']}"
        lines.append(f"| {t['label']} | {t['value']:.3f} | <= {t['bound']} | {'PASS' if t['met'] else 'FAIL'} | {per} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = result["versions"]
    v = [r["version"] for r in recs]
    fig, ax = plt.subplots(figsize=(9, 5))
    ax.plot(v, [r["blocking_s"] for r in recs], "s-", color="tab:red", label="blocking: publish() + flush()")
    ax.plot(v, [r["wait_s"] for r in recs], "o-", color="tab:blue", label="background: submit()")
    ax.plot(v, [max(r["overlap_wait_s"], 1e-4) for r in recs], "^-", color="tab:purple",
            label="background, capture='overlap': submit() + the next step's hold")  # fmt: skip
    ax.plot(v, [r["bucket_s"] for r in recs], "k--", label="bucket time of the version's files")
    for key, factor, style in (("delta", 0.25, "tab:blue"), ("anchor due", 0.10, "tab:green")):
        xs = [r["version"] for r in recs if r["kind"] == key]
        ax.scatter(xs, [factor * r["bucket_s"] for r in recs if r["kind"] == key], marker="_", s=300, color=style,
                   label=f"target: {factor}x bucket time ({key})")  # fmt: skip
    for r in recs:
        if r["kind"] == "anchor due":
            ax.axvline(r["version"], color="0.85", zorder=0)
    ax.set_yscale("log")
    ax.set_xticks(v)
    ax.set_xlabel("version (grey lines: an anchor is due)")
    ax.set_ylabel("seconds the trainer waits")
    cfg, model = result["config"], result["model"]
    ax.set_title(
        f"trainer wait per version: Qwen2.5-0.5B shapes x{cfg['scale']} ({model['parameters'] / 1e6:.0f}M params), "
        f"bucket {cfg['latency_s'] * 1e3:.0f} ms/op, {cfg['bandwidth_Bps'] / 1e6:.0f} MB/s",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of layers and vocabulary (default 1: full shape)")
    parser.add_argument("--versions", type=int, default=20, help="measured versions after the root anchor (default 20)")
    parser.add_argument("--warmup", type=int, default=10, help="optimizer steps before the root anchor (default 10)")
    parser.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"AdamW learning rate (default {DEFAULT_LR:g}, ~1%% changed)")
    parser.add_argument("--anchor-every", type=int, default=5, help="anchor_every of both publishers (default 5)")
    parser.add_argument("--latency", type=float, default=0.1, help="emulated seconds per bucket operation (default 0.1)")
    parser.add_argument("--bandwidth", type=float, default=50e6, help="emulated bucket bytes per second (default 50e6)")
    parser.add_argument(
        "--step-time", type=float, default=0.5,
        help="least seconds between one submit() and the next (the trainer's step; the simulated step and the "
        "blocking publish count towards it, a sleep pads the rest; default 0.5, about a full-shape delta's "
        "bucket time)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="where the two buckets go (default: the system temp directory)")
    parser.add_argument("--out", help="write the results as JSON to this file")
    parser.add_argument("--plot", help="write a plot (PNG) of the per-version waits to this file")
    args = parser.parse_args(argv)
    if not 0 < args.scale <= 1 or args.versions < 1 or args.warmup < 0 or args.anchor_every < 1:
        parser.error("--scale in (0, 1], --versions >= 1, --warmup >= 0, --anchor-every >= 1 please")
    if args.latency < 0 or args.bandwidth <= 0 or args.step_time < 0:
        parser.error("--latency >= 0, --bandwidth > 0 and --step-time >= 0 please")
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(table(result))
    save_outputs(result, args.out, args.plot, plot)
    for t in result["targets"]:
        print(f"{'PASS' if t['met'] else 'FAIL'}: {t['label']}: {t['value']:.3f} (bound <= {t['bound']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
