"""How many threads the host-side loops of the format use, and a map over threads started in
the calling thread.

NumPy, torch and zstandard release the GIL in the loops that matter, so the codec's encode and
decode and the fingerprint of host values spread over the cores. Each count is the CPUs the
calling thread may run on, unless its environment variable sets it. Threads started by a call
(:func:`spread`) inherit that thread's CPUs and priority (a server's staging thread, which runs
beside the engine, hands them its own), and end with the call.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import ConfigError

__all__ = ["thread_count", "spread", "Spread"]

_T = TypeVar("_T")
_R = TypeVar("_R")

Spread = Callable[[Callable[[_T], _R], Sequence[_T]], list[_R]]
"""``map(fn, items)`` as a list, in order."""


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


@contextlib.contextmanager
def spread(workers: int, name: str) -> Iterator[Spread[Any, Any]]:
    """A map over ``workers`` threads started here, named ``name`` (1: in this thread), in
    order; where several items fail, the first one's error is raised."""
    if workers <= 1:
        yield lambda fn, items: [fn(x) for x in items]
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        yield lambda fn, items: [fn(x) for x in items] if len(items) <= 1 else list(pool.map(fn, items))
