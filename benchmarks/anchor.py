"""An anchor's write against ``safetensors.torch.save_file`` of the same weights, on this host.

An anchor is the whole bf16 state, written beside a version's delta: streamed from the
publisher's snapshot, hashed on the way (the chain's 64-bit fingerprint, which it must match,
and the file's SHA-256), written, and made durable (``fsync``) before it is renamed into place.
This script times, in one run and on the same weights (CPU tensors, ``--gb`` of bf16 in
2048x5504 layers):

- ``save_file``: ``safetensors.torch.save_file`` into the same folder, and the same followed by
  ``fsync`` (durable, as every bucket file is);
- a publisher's first anchor (hashed once first, then streamed) and an anchor beside a delta
  (hashed as it streams), written as one file and as parts of ``--part-mib`` (default: the
  library's ``ANCHOR_PART_BYTES``), several at once.

Every figure is also given as a ratio to ``save_file`` and to ``save_file`` + ``fsync`` of the
same run. Run it alone: it measures the host's cores and disk::

    python benchmarks/anchor.py --gb 1 --repeat 3 --out benchmarks/results/anchor.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from deltasync import DeltaPublisher, DeltaReceiver
try:
    from deltasync.format import ANCHOR_PART_BYTES
except ImportError:  # a deltasync from before split anchors (to time it as a baseline): one file only
    ANCHOR_PART_BYTES = 0
from deltasync.trainer.publisher import PublishOptions


def log(message: str) -> None:
    print(f"[anchor.py {time.strftime('%H:%M:%S')}] {message}", flush=True)


def save_file_s(state: dict[str, torch.Tensor], folder: Path) -> tuple[float, float]:
    """``save_file`` of ``state`` into ``folder``: seconds, and seconds with its ``fsync``."""
    from safetensors.torch import save_file

    path = folder / "save_file.safetensors"
    start = time.perf_counter()
    save_file(state, str(path))
    plain = time.perf_counter() - start
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    durable = time.perf_counter() - start
    path.unlink()
    return plain, durable


def anchors(model: torch.nn.Module, folder: Path, part_bytes: int) -> dict[str, Any]:
    """A publisher's first anchor, then an anchor beside a delta (waited for), in ``folder``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the changes are made by hand
    split = {"anchor_part_bytes": part_bytes} if ANCHOR_PART_BYTES else {}
    options = PublishOptions(anchor_every=1000, anchor_bytes_ratio=0.0, **split)
    bucket = folder / "bucket"
    start = time.perf_counter()
    publisher = DeltaPublisher(str(bucket), model, optimizer, options=options)
    publisher.publish()
    first = time.perf_counter() - start
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[::100].view(torch.int16).add_(1)  # 1% of the elements, one ULP
    start = time.perf_counter()
    publisher.publish(anchor=True)
    publisher.flush()
    beside = time.perf_counter() - start
    pointer = publisher.pointer
    assert pointer is not None
    files = len(pointer.anchors[-1].files)
    publisher.close()
    late = DeltaReceiver(str(bucket))
    late.sync()
    exact = late.fingerprint == publisher.fingerprint
    shutil.rmtree(bucket)
    return {"first_s": first, "beside_delta_s": beside, "files": files, "read_back": exact}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="bf16 weights, in GB (default 1)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--part-mib", type=float, default=ANCHOR_PART_BYTES / 2**20, help="the parts' size (default: the library's)")
    parser.add_argument("--folder", default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    layers = max(1, round(args.gb * 1e9 / (2 * 2048 * 5504)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 5504, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    nbytes = sum(p.numel() * 2 for p in model.parameters())
    folder = Path(args.folder or tempfile.mkdtemp(prefix="deltasync-anchor-"))
    folder.mkdir(parents=True, exist_ok=True)
    part_bytes = int(args.part_mib * 2**20)
    log(f"{nbytes / 1e9:.2f} GB of bf16 in {layers} tensors, {os.cpu_count()} cores, parts of {part_bytes / 2**20:.0f} MiB")
    state = {f"{k}.weight": p.detach() for k, p in enumerate(model.parameters())}
    labels = ("one_file", "parts") if ANCHOR_PART_BYTES else ("one_file",)
    rows: dict[str, list[Any]] = {"save_file_s": [], "save_file_fsync_s": [], **{label: [] for label in labels}}
    for r in range(args.repeat):  # interleaved, so that a busy moment of the host hits all of them
        plain, durable = save_file_s(state, folder)
        rows["save_file_s"].append(plain)
        rows["save_file_fsync_s"].append(durable)
        for label in labels:
            rows[label].append(anchors(model, folder, 1 << 62 if label == "one_file" else part_bytes))
        log(f"round {r + 1}: save_file {plain:.2f} s (+ fsync {durable:.2f} s); anchor beside a delta: "
            + ", ".join(f"{rows[k][-1]['files']} file(s) {rows[k][-1]['beside_delta_s']:.2f} s" for k in labels))
    med = {k: statistics.median(rows[k]) for k in ("save_file_s", "save_file_fsync_s")}
    out: dict[str, Any] = {"bytes": nbytes, "tensors": layers, "cores": os.cpu_count(), "part_bytes": part_bytes,
                           "rows": rows, "median": med}  # fmt: skip
    ratios = {}
    for label in labels:
        for key in ("first_s", "beside_delta_s"):
            value = statistics.median(x[key] for x in rows[label])
            med[f"{label} {key}"] = value
            ratios[f"{label} {key} / save_file"] = value / med["save_file_s"]
            ratios[f"{label} {key} / (save_file + fsync)"] = value / med["save_file_fsync_s"]
    out["ratios"] = ratios
    out["exact"] = all(x["read_back"] for label in labels for x in rows[label])
    for k, v in {**med, **ratios}.items():
        log(f"  {k}: {v:.3f}")
    log(f"every anchor read back exact: {out['exact']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    if not args.folder:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
