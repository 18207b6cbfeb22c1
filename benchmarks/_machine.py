"""What a result was measured on: benchmarks record it beside their figures, since the same
script gives other ratios on another CPU (a bf16 matmul without AVX-512 runs several times
slower, and every fixed cost then weighs less against an engine step)."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

__all__ = ["machine"]

#: CPU flags that decide how fast bf16 runs on the CPU.
BF16_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine() -> dict[str, Any]:
    mem = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    cpu, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "bf16_flags": [flag for flag in BF16_FLAGS if flag in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": mem,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
