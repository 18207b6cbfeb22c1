"""The map over threads (deltasync/format/threads.py, ``spread``): results in order; given the
items' sizes, the small ones run in the calling thread and the others in the map's threads; the
first failing item's error is raised, wherever it ran."""

from __future__ import annotations

import threading
import time

import pytest

from deltasync.format.threads import SMALL, spread


def _where(x: int) -> tuple[int, str]:
    time.sleep(0.001)  # long enough for the threads to share the items
    return x * x, threading.current_thread().name


def test_a_sized_map_runs_small_items_here_and_large_ones_in_its_threads() -> None:
    items = list(range(40))
    sizes = [SMALL if x % 3 == 0 else SMALL - 1 for x in items]
    with spread(2, "deltasync-test") as threads:
        got = threads(_where, items, sizes=sizes)
        unsized = threads(_where, items)
        low = threads(_where, items, sizes=sizes, small=1)  # every item large
    assert [r for r, _ in got] == [x * x for x in items] == [r for r, _ in unsized] == [r for r, _ in low]
    for x, (_, name) in zip(items, got):
        assert (name == "MainThread") == (sizes[x] < SMALL), (x, name)
    assert all(name.startswith("deltasync-test") for _, name in unsized + low)
    # One thread: everything here, sizes or not.
    with spread(1, "deltasync-test") as threads:
        assert threads(_where, items, sizes=sizes) == [(x * x, "MainThread") for x in items]


def test_a_sized_map_needs_one_size_per_item() -> None:
    with spread(2, "deltasync-test") as threads, pytest.raises(ValueError, match="3 items but 2 sizes"):
        threads(_where, [1, 2, 3], sizes=[1, 2])


class Boom(Exception):
    pass


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize(
    "failing, large",
    [
        ({5}, {5}),  # in a thread
        ({5}, set()),  # here
        ({5, 9}, {9}),  # here first, a thread later
        ({5, 9}, {5}),  # a thread first, here later
        ({2, 5, 9}, {5, 9}),
    ],
)
def test_the_first_failing_item_is_raised_wherever_it_ran(workers: int, failing: set[int], large: set[int]) -> None:
    ran: list[int] = []
    lock = threading.Lock()

    def fn(x: int) -> int:
        with lock:
            ran.append(x)
        if x in failing:
            time.sleep(0.01 if x == min(failing) else 0)  # the first failure is not the first to happen
            raise Boom(f"item {x}")
        return x

    items = list(range(12))
    with spread(workers, "deltasync-test") as threads, pytest.raises(Boom, match=f"item {min(failing)}$"):
        threads(fn, items, sizes=[SMALL if x in large else 0 for x in items])
    # Items run here stop at the first one here that fails.
    here = [x for x in items if x not in large or workers == 1]
    stop = next(x for x in here if x in failing) if any(x in failing for x in here) else None
    assert stop is None or not any(x > stop for x in ran if x in here)
