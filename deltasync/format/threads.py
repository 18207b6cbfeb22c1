"""How many threads the host-side loops of the format use, and a map over threads started in
the calling thread.

NumPy, torch and zstandard release the GIL in the loops that matter, so the codec's encode and
decode and the fingerprint of host values spread over the cores. Each count is the CPUs the
calling thread may run on, unless its environment variable sets it. Threads started by a call
(:func:`spread`) inherit that thread's CPUs and priority (a server's staging thread, which runs
beside the engine, hands them its own), and end with the call.

A short item is run in the calling thread where the map is told the items' sizes: handing it to
another thread costs more than it saves. Each short NumPy call releases the interpreter lock and
takes it back, and two threads of such calls pass the lock back and forth between them: a stage
of a delta over 4,000 small tensors took 2.8-3.6x as long over two threads as in one
(``benchmarks/stage.py``; ``benchmarks/tensors.py`` measures it against the tensor count).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, TypeVar

from ..errors import ConfigError

__all__ = ["thread_count", "spread", "Spread", "SMALL"]

_T = TypeVar("_T")
_R = TypeVar("_R")

SMALL = 1 << 16
"""Elements under which an item of a sized map runs in the calling thread (:class:`Spread`)."""


class Spread(Protocol):
    """``map(fn, items)`` as a list, in order; where several items fail, the first one's error is
    raised. Given ``sizes`` (one per item), items smaller than ``small`` run in the calling thread,
    one after the other, while the threads run the others."""

    def __call__(
        self, fn: Callable[[_T], _R], items: Sequence[_T], sizes: Sequence[int] | None = None, small: int = SMALL
    ) -> list[_R]: ...


def thread_count(variable: str) -> int:
    """The count the environment ``variable`` sets, else the CPUs the calling thread may run on.
    A value that is not a whole number of 1 or more is refused with a :class:`ConfigError` naming it."""
    env = os.environ.get(variable)
    if env:
        if not env.strip().isdigit() or int(env) < 1:
            raise ConfigError(f"{variable} must be a whole number of threads, 1 or more; it is {env!r}")
        return int(env)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def _in_order(fn: Callable[[_T], _R], items: Sequence[_T], sizes: Sequence[int] | None = None, small: int = SMALL) -> list[_R]:
    return [fn(x) for x in items]


@contextlib.contextmanager
def spread(workers: int, name: str) -> Iterator[Spread]:
    """A map (:class:`Spread`) over ``workers`` threads started here, named ``name`` (1: all in
    this thread)."""
    if workers <= 1:
        yield _in_order
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:

        def run(fn: Callable[[_T], _R], items: Sequence[_T], sizes: Sequence[int] | None = None, small: int = SMALL) -> list[_R]:
            if len(items) <= 1:
                return [fn(x) for x in items]
            if sizes is None:
                return list(pool.map(fn, items))
            if len(sizes) != len(items):
                raise ValueError(f"{len(items)} items but {len(sizes)} sizes")
            away = {k: pool.submit(fn, x) for k, (x, size) in enumerate(zip(items, sizes)) if size >= small}
            return _gather(fn, items, away)

        yield run


def _gather(fn: Callable[[_T], _R], items: Sequence[_T], away: dict[int, Future[_R]]) -> list[_R]:
    """The results of ``items`` in order: those in ``away`` from their futures, the others
    computed here meanwhile. The first failing item's error is raised (a later item run here is
    not started once one before it failed here)."""
    results: list[_R] = []
    failed: tuple[int, Exception] | None = None
    try:
        for k, x in enumerate(items):
            if k in away:
                continue
            try:
                results.append(fn(x))
            except Exception as exc:  # noqa: BLE001  (raised below, unless an item before it failed in a thread)
                failed = (k, exc)
                break
        out: list[_R] = []
        here = iter(results)
        for k in range(len(items) if failed is None else failed[0]):
            out.append(away[k].result() if k in away else next(here))
        if failed is not None:
            raise failed[1]
        return out
    finally:
        for future in away.values():
            future.cancel()  # after an error: those not started yet are not run
