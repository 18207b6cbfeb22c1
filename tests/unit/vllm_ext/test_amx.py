"""The plugin asks Linux for the AMX tile state where the CPU has AMX, and nowhere else."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_ext import _amx

_LINUX_X86 = sys.platform == "linux" and platform.machine().lower() in ("x86_64", "amd64")
_AMX_FLAGS = "flags\t\t: fpu vme sse sse2 avx512f amx_bf16 avx512_fp16 amx_tile amx_int8\n"
_PLAIN_FLAGS = "flags\t\t: fpu vme sse sse2 avx2 avx512f avx512_bf16\n"


def _cpuinfo(tmp_path: Path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\n{flags}bugs\t\t: spectre_v1\n\nprocessor\t: 1\n{flags}")
    return str(path)


def test_cpu_lists_amx_reads_the_flags_line(tmp_path: Path) -> None:
    assert _amx.cpu_lists_amx(_cpuinfo(tmp_path, _AMX_FLAGS))
    assert not _amx.cpu_lists_amx(_cpuinfo(tmp_path, _PLAIN_FLAGS))
    # amx_tile elsewhere than in the flags is not a flag.
    other = tmp_path / "other"
    other.write_text("model name\t: amx_tile lookalike\nflags\t\t: sse avx2\n")
    assert not _amx.cpu_lists_amx(str(other))
    assert not _amx.cpu_lists_amx(str(tmp_path / "missing"))


@pytest.mark.skipif(not _LINUX_X86, reason="x86-64 Linux only")
def test_asks_for_xtiledata_where_cpuinfo_lists_amx(tmp_path: Path) -> None:
    calls: list[tuple[int, int, int]] = []

    def syscall(number: int, a: int, b: int) -> int:
        calls.append((number, a, b))
        return 0

    assert _amx.request_amx_tile_state(cpuinfo=_cpuinfo(tmp_path, _AMX_FLAGS), syscall=syscall) == "granted"
    assert calls == [(158, 0x1023, 18)]


@pytest.mark.skipif(not _LINUX_X86, reason="x86-64 Linux only")
def test_asks_nothing_without_amx(tmp_path: Path) -> None:
    def syscall(number: int, a: int, b: int) -> int:
        raise AssertionError("no syscall on a CPU without AMX")

    assert _amx.request_amx_tile_state(cpuinfo=_cpuinfo(tmp_path, _PLAIN_FLAGS), syscall=syscall) == "no-amx"


@pytest.mark.skipif(not _LINUX_X86, reason="x86-64 Linux only")
def test_a_refusal_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The real call on a CPU without AMX: the kernel refuses the component (EINVAL), which is
    # what a refusal on an AMX machine looks like too.
    if _amx.cpu_lists_amx():
        pytest.skip("this CPU has AMX: the kernel grants it (see the next test)")
    with caplog.at_level("WARNING", logger="vllm_ext.amx"):
        assert _amx.request_amx_tile_state(cpuinfo=_cpuinfo(tmp_path, _AMX_FLAGS)) == "refused"
    assert "Linux refused the AMX tile state" in caplog.text
    assert "DELTASYNC_CPU_PLAIN_GEMM=1" in caplog.text


@pytest.mark.skipif(not _amx.cpu_lists_amx(), reason="this CPU has no AMX")
def test_granted_on_an_amx_cpu_in_a_fresh_process() -> None:
    # The real syscall, in a process that has not asked before: the permission is then set.
    script = textwrap.dedent(
        """
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("amx", sys.argv[1])
        amx = importlib.util.module_from_spec(spec); spec.loader.exec_module(amx)
        before = amx.amx_tile_permitted()
        print(before, amx.request_amx_tile_state(), amx.amx_tile_permitted())
        """
    )
    out = subprocess.run([sys.executable, "-c", script, _amx.__file__], capture_output=True, text=True, check=True)
    assert out.stdout.split()[1:] == ["granted", "True"]


def test_the_plugin_entry_point_asks_first(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_ext

    order: list[str] = []
    monkeypatch.setattr(vllm_ext, "request_amx_tile_state", lambda: order.append("amx") or "no-amx")
    monkeypatch.setattr(vllm_ext, "register_backend", lambda: order.append("backend"))
    monkeypatch.setattr(vllm_ext, "install_plain_gemm", lambda: order.append("gemm"))
    vllm_ext.register()
    assert order == ["amx", "backend", "gemm"]
