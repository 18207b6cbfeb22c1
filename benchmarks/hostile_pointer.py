"""What a hostile pointer at the size cap costs a reader before it is refused.

A bucket's pointer (``latest.json``) is read with a bound (``MAX_POINTER_BYTES``, 32 MiB) and
parsed with limits. Within that bound an attacker can still fill it with the cheapest JSON
values there are: ``{}``, ``[]``, ``0`` or ``""`` three bytes apiece, each of which a JSON
parser turns into a Python object. For each filling, and for an honest pointer of about the
same size (a long chain of real entries, written by ``Pointer.to_bytes``) for comparison, a
fresh interpreter imports deltasync, reads the file, resets its peak resident size (Linux:
``/proc/self/clear_refs``, then ``VmHWM``), calls ``Pointer.from_bytes`` and reports how far
the peak grew over the resident size before the call, the seconds taken and the error.

Run from the repository root: ``python benchmarks/hostile_pointer.py [--out FILE.json]``;
``--package-dir DIR`` imports the ``deltasync`` package found in DIR instead (e.g. an older
revision exported with ``git archive``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, sys, time
from deltasync import FormatError, Pointer
from deltasync.format import MAX_POINTER_BYTES

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])  # KiB

data = open(sys.argv[1], "rb").read()
assert len(data) <= MAX_POINTER_BYTES
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak (VmHWM) to the resident size now
before = status("VmRSS")
start = time.perf_counter()
try:
    pointer = Pointer.from_bytes(data)
    error = None
except FormatError as exc:
    error = str(exc)
seconds = time.perf_counter() - start
after = status("VmHWM")
print(json.dumps({"bytes": len(data), "peak_growth_mib": (after - before) / 1024, "seconds": seconds,
                  "error": None if error is None else error[:300]}))
"""


def _hostile(filling: bytes, cap: int) -> bytes:
    """A format-2 pointer whose chain is ``filling`` repeated up to ``cap`` bytes."""
    head = b'{"format": "deltasync", "format_version": 2, "version": 1, "chain": ['
    tail = b"]}"
    count = (cap - len(head) - len(tail) + 1) // (len(filling) + 1)
    return head + b",".join([filling] * count) + tail


def _densest(cap: int) -> bytes:
    """As many ``{}`` and ``0`` as the reader's counts before parsing let through, padded with
    spaces to ``cap``: the most objects a pointer of that size can still make a reader build."""
    from deltasync.format.pointer import _SLACK, BYTES_PER_COMMA, BYTES_PER_CONTAINER

    head = b'{"format": "deltasync", "format_version": 2, "version": 1, "chain": ['
    tail = b"]}"
    objects = _SLACK + cap // BYTES_PER_CONTAINER - 2
    commas = _SLACK + cap // BYTES_PER_COMMA - 4
    body = b",".join([b"{}"] * objects + [b"0"] * (commas - objects + 1))
    return head + body + b" " * (cap - len(head) - len(body) - len(tail)) + tail


def _honest(cap: int) -> bytes:
    """A real pointer (anchor 0, then deltas) as large as fits under ``cap``."""
    sys.path.insert(0, str(ROOT))
    from deltasync import Pointer
    from deltasync.format import ChainEntry

    def entry(version: int, kind: str) -> ChainEntry:
        return ChainEntry(version=version, kind=kind, path=f"{kind}s/{version:08d}.safetensors", nbytes=123456,
                          sha256="ab" * 32, fingerprint=f"{version:016x}", changed=1000)  # fmt: skip

    count = cap // 200  # about 230 bytes an entry: this overshoots, then shrinks
    while True:
        chain = [entry(0, "anchor"), *(entry(v, "delta") for v in range(1, count + 1))]
        data = Pointer.from_chain(version=count, anchor=0, fingerprint=f"{count:016x}", total=10**9, chain=chain).to_bytes()
        if len(data) <= cap:
            return data
        count = int(count * cap / len(data) * 0.999)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--package-dir", type=Path, default=ROOT, help="where the deltasync package is imported from")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/deltasync-hostile-pointer"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from deltasync.format import MAX_POINTER_BYTES

    cap = MAX_POINTER_BYTES
    cases = {
        "honest (real entries)": _honest(cap),
        "empty objects {}": _hostile(b"{}", cap),
        "empty arrays []": _hostile(b"[]", cap),
        "zeros 0": _hostile(b"0", cap),
        'empty strings ""': _hostile(b'""', cap),
    }
    try:
        cases["densest that passes the counts"] = _densest(cap)
    except ImportError:  # a deltasync from before the counts
        pass
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(args.package_dir.resolve())}
    results = {}
    print("| pointer of the cap's size | bytes | peak growth | peak / size | seconds | outcome |")
    print("|---|---:|---:|---:|---:|---|")
    for name, data in cases.items():
        path = args.workdir / "latest.json"
        path.write_bytes(data)
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, env=env,
                              cwd=args.workdir, check=True)  # fmt: skip
        result = json.loads(proc.stdout.splitlines()[-1])
        results[name] = result
        outcome = "parsed" if result["error"] is None else "refused: " + result["error"][:90]
        print(f"| {name} | {result['bytes']:,} | {result['peak_growth_mib']:.1f} MiB | "
              f"{result['peak_growth_mib'] * 2**20 / result['bytes']:.1f}x | {result['seconds']:.2f} | {outcome} |")  # fmt: skip
    if args.out is not None:
        args.out.write_text(json.dumps({"package_dir": str(args.package_dir), "cases": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
