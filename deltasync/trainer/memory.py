"""Handing freed host memory back to the operating system.

glibc keeps freed memory in its heaps for reuse, and raises its threshold for giving big
blocks straight back as they are freed. A publisher's versions allocate and free tens of MiB
of short-lived buffers in background threads (each with a heap of its own), which then stay
resident until the process ends: on a trainer that runs near its memory limit, that is the
difference between fitting and not. ``malloc_trim`` returns every free page of every heap.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["release_free_memory"]


def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # another C library (musl): nothing to trim
        return None


_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Return the C allocator's free memory to the system, where it is glibc (a few ms)."""
    if _TRIM is not None:
        _TRIM(0)
