"""The follow poll: a policy timed from the trainer's commits (driven by a fake clock), and
conditional reads of the pointer on real local and fsspec buckets."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import small_transformer, train_step

from deltasync import ConfigError, DeltaPublisher, NotFoundError, VersionError
from deltasync.reader.poll import PointerWatch, PollOptions, PollPolicy, pointer_tag
from deltasync.stores import FsspecStore, LocalStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def follow(policy: PollPolicy, clock: Clock, commits: list[float], until: float) -> tuple[int, list[float]]:
    """Poll a bucket whose versions commit at ``commits`` until ``until``, as the policy says; the
    reads made after the first half hour, and how late each version was seen."""
    reads, lags, seen = 0, [], 0
    while clock.now < until:
        version = sum(1 for c in commits if c <= clock.now)
        if version > seen:
            lags.extend(clock.now - commits[v - 1] for v in range(seen + 1, version + 1))
            seen = version
        reads += clock.now >= 1800
        clock.now += policy.observe(version)
    return reads, lags


def test_a_regular_trainer_costs_about_two_reads_a_version_and_is_seen_as_soon_as_a_fixed_poll_would():
    clock = Clock()
    policy = PollPolicy(PollOptions(interval=2.0), clock=clock)
    commits = [5.0 + 60 * k for k in range(200)]
    reads, lags = follow(policy, clock, commits, until=3 * 3600)
    per_hour = reads / 2.5
    assert per_hour <= 200, per_hour  # a fixed 2 s poll: 1,800
    assert 100 <= per_hour <= 130, per_hour  # two reads a version (one wakes, one sees)
    assert max(lags) <= 2.0  # never later than the interval
    assert policy.rhythm == pytest.approx((60.0, 0.0), abs=1.01)


def test_a_jittery_trainer_stays_under_200_reads_an_hour():
    rng = random.Random(1)
    commits, t = [], 5.0
    for _ in range(200):
        commits.append(t)
        t += 60 + rng.uniform(-3, 3)
    clock = Clock()
    reads, lags = follow(PollPolicy(clock=clock), clock, commits, until=3 * 3600)
    assert reads / 2.5 <= 200
    assert sorted(lags)[len(lags) // 2] <= 2.0  # the median version is seen within the interval


def test_until_a_rhythm_is_known_it_polls_at_the_interval_then_backs_off_when_idle():
    clock = Clock()
    policy = PollPolicy(PollOptions(interval=2.0, idle_after=120.0, max_interval=60.0, backoff=0.25), clock=clock)
    assert policy.observe(0) == 2.0 and policy.rhythm is None
    clock.now = 119.0
    assert policy.observe(0) == 2.0
    clock.now = 120.0 + 40.0  # 40 s past idle_after: a quarter of it
    assert policy.observe(0) == 10.0
    clock.now = 10_000.0
    assert policy.observe(0) == 60.0  # bounded
    clock.now = 10_001.0
    assert policy.observe(1) == 2.0  # a change: the plain interval again


def test_it_waits_until_the_next_commit_is_due_and_backs_off_when_the_trainer_is_late():
    clock = Clock()
    policy = PollPolicy(PollOptions(interval=1.0, max_interval=30.0, backoff=0.5), clock=clock)
    for version, at in enumerate([0.0, 100.0, 200.0, 300.0]):
        clock.now = at
        delay = policy.observe(version)
    assert policy.rhythm == (100.0, 0.0)
    assert delay == 30.0  # due at 400, window 0.5 s: wait, at most max_interval
    clock.now = 399.0  # 0.5 s before the window: never less than the interval
    assert policy.observe(3) == 1.0
    clock.now = 399.6  # inside the window around 400
    assert policy.observe(3) == 1.0
    clock.now = 420.5  # 20 s overdue: half of it
    assert policy.observe(3) == pytest.approx(10.0)
    clock.now = 10_000.0
    assert policy.observe(3) == 30.0


def test_a_jump_of_several_versions_counts_as_several_intervals_and_a_reset_bucket_starts_over():
    clock = Clock()
    policy = PollPolicy(PollOptions(interval=1.0, min_history=2), clock=clock)
    policy.observe(0)
    clock.now = 10.0
    policy.observe(1)
    clock.now = 50.0
    policy.observe(5)  # four versions in 40 s
    assert policy.rhythm == (10.0, 0.0)
    clock.now = 51.0
    policy.observe(0)  # a new chain in a recreated bucket
    assert policy.rhythm is None


@pytest.mark.parametrize("field,value", [("interval", 0), ("max_interval", float("inf")), ("backoff", -1)])
def test_bad_options_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=f"PollOptions.{field} must be a positive number"):
        PollOptions(**{field: value})
    with pytest.raises(ConfigError, match=r"max_interval \(1\.0\) must be at least interval \(2\.0\)"):
        PollOptions(interval=2.0, max_interval=1.0)


def _publish(bucket, versions: int) -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    with DeltaPublisher(bucket, model, opt) as publisher:
        for v in range(versions):
            if v:
                train_step(model, opt, seed=v)
            publisher.publish()


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_the_watch_reads_the_pointer_whole_only_when_it_changed(tmp_path, kind):
    store = LocalStore(tmp_path / "b") if kind == "local" else FsspecStore(f"memory://poll-{tmp_path.name}")
    watch = PointerWatch(store)
    with pytest.raises(VersionError, match="no version is committed"):
        watch.read()
    _publish(store, 1)
    assert pointer_tag(store) is not None
    assert watch.read().version == 0 and (watch.full_reads, watch.tag_reads) == (2, 0)
    for _ in range(3):
        assert watch.read().version == 0
    assert (watch.full_reads, watch.tag_reads) == (2, 3)
    _publish(store, 2)  # the restarted publisher commits version 1, then 2... (same pointer length)
    assert watch.read().version == store_version(store)
    assert watch.full_reads == 3


def store_version(store) -> int:
    from deltasync.reader.chain import read_pointer

    return read_pointer(store).version


def test_a_store_that_cannot_tell_is_read_whole_every_time(tmp_path):
    class Plain:
        """The five methods of a store, nothing more."""

        def __init__(self, inner: LocalStore) -> None:
            self.inner, self.url = inner, inner.url

        def __getattr__(self, name):
            if name in ("read_bytes", "write_bytes", "exists", "list", "delete"):
                return getattr(self.inner, name)
            raise AttributeError(name)

    inner = LocalStore(tmp_path / "b")
    _publish(inner, 1)
    plain = Plain(inner)
    assert pointer_tag(plain) is None
    watch = PointerWatch(plain)
    for _ in range(3):
        assert watch.read().version == 0
    assert (watch.full_reads, watch.tag_reads) == (3, 0)


def test_a_views_folder_is_watched_through_its_parent(tmp_path):
    from deltasync.stores._sub import sub_store

    parent = LocalStore(tmp_path / "b")
    view = sub_store(parent, "views/FP8_DYNAMIC/")
    _publish(view, 1)
    assert pointer_tag(view) == pointer_tag(parent, "views/FP8_DYNAMIC/latest.json") is not None
    with pytest.raises(NotFoundError, match="latest.json"):
        pointer_tag(parent)  # the bf16 chain has no pointer here
    watch = PointerWatch(view)
    assert watch.read().version == 0 and watch.read().version == 0
    assert (watch.full_reads, watch.tag_reads) == (1, 1)
