"""Ask Linux for the AMX tile state before vLLM-CPU's kernels use it.

On x86-64 Linux a process must ask for the AMX tile data state (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``) before its first AMX instruction; one that does not is killed with
SIGILL. vLLM-CPU 0.32's workers never ask, so on a Xeon whose cpuinfo lists ``amx_tile`` a
worker dies at its first forward whose kernels choose AMX (a short first prompt is enough).
The plugin entry point runs in every process vLLM starts, before a worker loads its model, so
it asks there. Elsewhere (another architecture or OS, a CPU without AMX) it does nothing.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import sys
from collections.abc import Callable
from typing import Literal

__all__ = [
    "ARCH_REQ_XCOMP_PERM",
    "XFEATURE_XTILEDATA",
    "AmxState",
    "amx_tile_permitted",
    "cpu_lists_amx",
    "request_amx_tile_state",
]

logger = logging.getLogger("vllm_ext.amx")

SYS_ARCH_PRCTL = 158
"""The ``arch_prctl`` system call's number on x86-64 Linux."""
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
"""The AMX tile data component of the XSAVE state (bit 18 of the permitted mask)."""

AmxState = Literal["granted", "no-amx", "not-linux-x86-64", "refused"]

Syscall = Callable[[int, int, int], int]
"""``syscall(number, arg1, arg2)``: returns 0 or -1 with ``ctypes.get_errno()`` set."""


def cpu_lists_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU's flags (``/proc/cpuinfo``) list ``amx_tile``."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags") and "amx_tile" in line.split(":", 1)[-1].split():
                    return True
    except OSError:
        return False
    return False


def _libc_syscall() -> Syscall:
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.syscall
    call.restype = ctypes.c_long
    return lambda number, a, b: int(call(ctypes.c_long(number), ctypes.c_long(a), ctypes.c_long(b)))


def request_amx_tile_state(*, cpuinfo: str = "/proc/cpuinfo", syscall: Syscall | None = None) -> AmxState:
    """Ask Linux for the AMX tile state for this process where the CPU has AMX; never raises.

    Returns what happened: ``"granted"`` (asked and given, or given before), ``"no-amx"``,
    ``"not-linux-x86-64"``, or ``"refused"`` (the kernel said no; logged as a warning with the
    errno, since a server on this CPU may then die with SIGILL: set ``DELTASYNC_CPU_PLAIN_GEMM=1``).
    """
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return "not-linux-x86-64"
    if not cpu_lists_amx(cpuinfo):
        return "no-amx"
    call = syscall or _libc_syscall()
    try:
        result = call(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as exc:  # no libc syscall(): as refused
        logger.warning("deltasync: cannot ask Linux for the AMX tile state (%s); vLLM-CPU may die with SIGILL", exc)
        return "refused"
    if result == 0:
        return "granted"
    code = ctypes.get_errno()
    logger.warning(
        "deltasync: Linux refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): %s); "
        "vLLM-CPU's worker may die with SIGILL at its first forward; DELTASYNC_CPU_PLAIN_GEMM=1 avoids its AMX kernels",
        errno.errorcode.get(code, str(code)) + (f" {os.strerror(code)}" if code else ""),
    )
    return "refused"


def amx_tile_permitted() -> bool:
    """Whether this process may use the AMX tile state (``ARCH_GET_XCOMP_PERM``; x86-64 Linux)."""
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    mask = ctypes.c_uint64(0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_GET_XCOMP_PERM), ctypes.byref(mask)) != 0:
        return False
    return bool(mask.value >> XFEATURE_XTILEDATA & 1)
