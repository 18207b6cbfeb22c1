"""The ``deltasync`` command. Only here do exceptions become exit codes and one-line hints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .errors import DeltaSyncError, NotFoundError, VersionError
from .format import HISTORY_PATH, POINTER_PATH, Pointer, get_codec, read_header, view_prefix

__all__ = ["main"]

def _human(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    raise AssertionError


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def _read_file(target: str) -> tuple[bytes, str]:
    """A local file, or ``BUCKET_URL/path/in/bucket`` for a file in a bucket."""
    if os.path.exists(target):
        return Path(target).read_bytes(), target
    from .stores import open_store

    for marker in ("/anchors/", "/deltas/"):
        if marker in target:
            root, rest = target.rsplit(marker, 1)
            return open_store(root).read_bytes(marker.strip("/") + "/" + rest), target
    raise NotFoundError(f"{target}: no such file (give a local path or BUCKET_URL/deltas/<file>)")


# --------------------------------------------------------------------------- inspect


def _inspect(args: argparse.Namespace) -> int:
    from safetensors.torch import load

    data, where = _read_file(args.file)
    header = read_header(data, where=where)
    tensors = load(data)
    print(f"file         {where}")
    print(f"kind         {header.kind}")
    print(f"version      {header.version}")
    print(f"base         {'-' if header.base is None else header.base}")
    print(f"anchor       {header.anchor}")
    print(f"codec        {header.codec}")
    if header.parts is not None:
        print(f"part         {header.part} of {header.parts} (format version 2: one file per sharded writer)")
    print(f"size         {_human(len(data))}")
    print(f"parameters   {header.params}")
    print(f"changed      {header.changed} of {header.total} elements ({100 * header.changed / max(header.total, 1):.4f}%)")
    if header.kind == "delta" and header.changed:
        print(f"bytes/change {len(data) / header.changed:.3f}")
    print(f"fingerprint  {header.fingerprint}")
    if header.base_fingerprint:
        print(f"base fp      {header.base_fingerprint}")
    print()
    rows: list[list[str]] = []
    if header.kind == "anchor" and header.slices is not None:
        for name, shape, begin, end in header.slices:
            rows.append([name, "x".join(map(str, shape)) or "scalar", f"{begin}..{end}", str(end - begin)])
        print(_table(rows, ["parameter", "full shape", "flat elements", "in this part"]))
    elif header.kind == "anchor":
        for name in sorted(tensors):
            t = tensors[name]
            rows.append([name, "x".join(map(str, t.shape)), str(t.numel()), str(t.dtype).removeprefix("torch.")])
        print(_table(rows, ["parameter", "shape", "elements", "dtype"]))
    else:
        tables = get_codec(header.codec).describe(tensors, names=header.names, changed=header.changed)
        print("\n\n".join(_table(rows, columns) for columns, rows in tables))
    return 0


# --------------------------------------------------------------------------- verify


def _verify(args: argparse.Namespace) -> int:
    from .reader.chain import ChainReader
    from .reader.receiver import DeltaReceiver

    receiver = DeltaReceiver(args.bucket, view=args.view)
    pointer = receiver.pointer()
    first = pointer.anchors[0]
    anchors = ", ".join(str(a.version) for a in pointer.anchors)
    oldest = min(first.version, pointer.base + 1)
    print(f"{receiver.store.url}: versions {oldest}..{pointer.version} (anchors {anchors})")
    # Deltas before the oldest anchor serve followers only: no kept state lets them be replayed
    # here, but each file is checked as far as it can be (size, SHA-256, header).
    early = [e for e in pointer.chain if e.version <= first.version]
    reader = ChainReader(receiver.store, pointer, view=args.view)
    for entry in early:
        try:
            reader.check_files(entry.version)
        except DeltaSyncError as exc:
            print(f"version {entry.version}: BAD: {exc}")
            print(f"error: the first bad version is {entry.version} ({', '.join(f.path for f in entry.files)})", file=sys.stderr)
            return 1
        print(f"version {entry.version}: ok  delta  {_human(entry.nbytes):>10s}  (before the oldest anchor: size, "
              "SHA-256 and header checked)")
    entries = [first, *(e for e in pointer.chain if e.version > first.version)]
    for entry in entries:
        try:
            staged = receiver.stage(entry.version)
        except DeltaSyncError as exc:
            print(f"version {entry.version}: BAD: {exc}")
            files = ", ".join(f.path for f in entry.files)
            print(f"error: the first bad version is {entry.version} ({files})", file=sys.stderr)
            return 1
        receiver.apply(staged)
        parts = f"  {len(entry.parts)} parts" if entry.parts else ""
        print(
            f"version {entry.version}: ok  {entry.kind:6s} {_human(entry.nbytes):>10s}  "
            f"fingerprint {receiver.fingerprint}{parts}"
        )
    for entry in pointer.anchors[1:]:  # every other anchor must give the state of its version
        late = receiver.fresh()
        try:
            late.apply(late.stage(entry.version))
        except DeltaSyncError as exc:
            print(f"anchor {entry.version}: BAD: {exc}")
            print(f"error: the anchor of version {entry.version} is bad ({', '.join(f.path for f in entry.files)})", file=sys.stderr)
            return 1
        print(f"anchor {entry.version}: ok  {_human(entry.nbytes):>10s}  fingerprint {late.fingerprint}")
    # Every chain has its history in its folder: the bucket's, or a view's (views/<SCHEME>/).
    problem = _two_writers(receiver.store, pointer, (view_prefix(args.view) if args.view else "") + HISTORY_PATH)
    if problem is not None:
        print(f"history: BAD: {problem}")
        print(f"error: {problem}", file=sys.stderr)
        return 1
    print(f"ok: {len(early) + len(entries) + len(pointer.anchors) - 1} versions and anchors verified, state "
          f"fingerprint {receiver.fingerprint}")
    return 0


def _two_writers(store: Any, pointer: Pointer, name: str = HISTORY_PATH) -> str | None:
    """What says that two writers published one version of the chain in ``store`` (the bucket,
    or a view's folder): history lines of one version that name different writers, or a line
    naming another writer than the pointer (where it names one) for a version whose
    fingerprint it gives otherwise. None if nothing does (or there is no history). ``name``:
    the history's path in the bucket, for the message."""
    try:
        text = store.read_bytes(HISTORY_PATH).decode(errors="replace")
    except NotFoundError:
        return None
    seen: dict[int, dict[str, Any]] = {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
            version = int(record["version"])
        except (ValueError, TypeError, KeyError):
            continue  # the history is informative: a bad line is not a second writer
        writer = record.get("writer")
        if not isinstance(writer, dict) or version > pointer.version:
            continue
        who = f"host {writer.get('host')!r}, process {writer.get('pid')}"
        other = seen.setdefault(version, writer)
        if other.get("token") != writer.get("token"):
            return (f"{name} names two writers for version {version}: host {other.get('host')!r}, process "
                    f"{other.get('pid')} and {who}; two publishers wrote into this bucket")  # fmt: skip
        committed = pointer.fingerprint_at(version)
        held = pointer.writer
        if (committed is not None and record.get("fingerprint") != committed and held is not None
                and held.token != writer.get("token")):  # fmt: skip
            return (f"{name} names {who} for version {version} with fingerprint {record.get('fingerprint')}, "
                    f"the pointer's chain has {committed} from {held.describe()}; two publishers wrote into this bucket")
    return None


# --------------------------------------------------------------------------- stats


def _history(bucket: str) -> tuple[Pointer, list[dict]]:
    from .stores import open_store

    store = open_store(bucket)
    where = f"{store.url}/{POINTER_PATH}"
    try:
        data = store.read_bytes(POINTER_PATH)
    except NotFoundError as exc:
        raise VersionError(f"{where}: no version is committed in this bucket yet") from exc
    pointer = Pointer.from_bytes(data, where=where)
    records: dict[int, dict] = {}
    try:
        for line in store.read_bytes(HISTORY_PATH).decode().splitlines():
            if line.strip():
                record = json.loads(line)
                records[int(record["version"])] = record
    except NotFoundError:
        pass
    for entry in pointer.chain:  # the pointer is authoritative for what it lists
        records.setdefault(entry.version, {"version": entry.version})
        records[entry.version].update(
            kind=entry.kind, nbytes=entry.nbytes, changed=entry.changed, total=pointer.total, files=len(entry.files)
        )
    for entry in pointer.anchors:
        record = records.setdefault(entry.version, {"version": entry.version, "kind": "anchor", "nbytes": 0,
                                                    "changed": entry.changed, "total": pointer.total})  # fmt: skip
        record["anchor_nbytes"] = entry.nbytes
        if record.get("kind") == "anchor":
            record.update(nbytes=entry.nbytes, files=len(entry.files))
    return pointer, [records[v] for v in sorted(records) if v <= pointer.version]


def _stats(args: argparse.Namespace) -> int:
    _, records = _history(args.bucket)
    rows = []
    split = any(r.get("files", 1) > 1 for r in records)
    for r in records:
        frac = r["changed"] / r["total"] if r.get("total") else 0.0
        seconds = r.get("seconds")
        beside = _human(r["anchor_nbytes"]) if "anchor_nbytes" in r and r["kind"] != "anchor" else "-"
        rows.append([str(r["version"]), r["kind"], _human(r["nbytes"]), beside, f"{100 * frac:.3f}%",
                     "-" if seconds is None else f"{seconds:.2f}"] + ([str(r.get("files", "-"))] if split else []))
    headers = ["version", "kind", "bytes", "anchor beside", "changed", "publish s"]
    print(_table(rows, headers + (["files"] if split else [])))
    anchors = [r["anchor_nbytes"] for r in records if "anchor_nbytes" in r]
    # Anchors beside deltas are written too (a version of kind "anchor" has no delta: its
    # nbytes is the anchor's).
    shipped = sum(r["nbytes"] + (r.get("anchor_nbytes", 0) if r["kind"] != "anchor" else 0) for r in records)
    if anchors:
        full = anchors[-1] * len(records)
        print()
        print(f"{len(records)} versions, {_human(shipped)} written; full copies would be {_human(full)} "
              f"({full / max(shipped, 1):.1f}x more)")
    if args.plot:
        _plot(records, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _plot(records: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise DeltaSyncError("--plot needs matplotlib: pip install 'deltasync[plot]'") from exc
    fig, ax = plt.subplots(figsize=(8, 4))
    for kind, color in (("anchor", "tab:red"), ("delta", "tab:blue")):
        xs = [r["version"] for r in records if r["kind"] == kind]
        ys = [r["nbytes"] for r in records if r["kind"] == kind]
        ax.bar(xs, ys, color=color, label=f"{kind} bytes")
    ax.set_yscale("log")
    ax.set_xlabel("version")
    ax.set_ylabel("bytes written (log)")
    ax2 = ax.twinx()
    deltas = [r for r in records if r["kind"] == "delta" and r.get("total")]
    ax2.plot([r["version"] for r in deltas], [100 * r["changed"] / r["total"] for r in deltas],
             color="black", marker=".", linestyle="", label="changed % (deltas)")
    ax2.set_ylabel("changed elements per delta (%)")
    ax2.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    labels = ax.get_legend_handles_labels()[1] + ax2.get_legend_handles_labels()[1]
    ax.legend(lines, labels, loc="upper right")
    ax.set_title("deltasync: bytes and changed fraction per version")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- export


def _export(args: argparse.Namespace) -> int:
    from .export import export_checkpoint

    what = f"view {args.view}" if args.view else "the bf16 chain"
    receiver = export_checkpoint(args.bucket, args.out, view=args.view, version=args.version, like=args.like,
                                 max_shard_bytes=args.max_shard_gb << 30)  # fmt: skip
    state = receiver.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    print(f"{receiver.store.url}: {what} at version {receiver.version} (fingerprint {receiver.fingerprint}), "
          f"{len(state)} tensors, {_human(total)} written to {args.out}"
          + ("" if args.like else " (tensors only: pass --like MODEL_DIR for config.json and the tokenizer)"))
    return 0


# --------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deltasync", description="Exact sparse bf16 weight sync for RL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("inspect", help="show what an anchor or delta file holds")
    p.add_argument("file", help="a local file, or BUCKET_URL/deltas/<file>")
    p = sub.add_parser("verify", help="replay a bucket's committed chain and check every fingerprint")
    p.add_argument("bucket", help="a path or URL (file://, hf://buckets/ns/name, s3://, ...)")
    p.add_argument("--view", help="verify a quantized view of the bucket (e.g. FP8_DYNAMIC); default: the bf16 chain")
    p = sub.add_parser("export", help="write a version of a bucket (bf16, or a quantized view) as a checkpoint folder")
    p.add_argument("bucket")
    p.add_argument("out", help="the folder to write (must hold no safetensors files yet)")
    p.add_argument("--view", help="a quantized view of the bucket (e.g. FP8_DYNAMIC); default: the bf16 chain")
    p.add_argument("--version", type=int, help="the version to export (default: the newest committed)")
    p.add_argument("--like", metavar="MODEL_DIR", help="copy config.json (with the view's quantization_config), "
                   "the tokenizer and generation files from this model folder")
    p.add_argument("--max-shard-gb", type=int, default=5, help="largest safetensors shard, in GiB (default 5)")
    p = sub.add_parser("stats", help="bytes, changed fraction and kind per version")
    p.add_argument("bucket")
    p.add_argument("--plot", metavar="FILE.png", help="also plot them")
    for extra in _EXTRA_PARSERS:
        extra(sub)
    return parser


def _demo_parser(sub: argparse._SubParsersAction) -> None:
    from .examples.demo import add_parser

    add_parser(sub)


def _demo(args: argparse.Namespace) -> int:
    from .examples.demo import run

    return run(args)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from .control.serve import add_parser

    add_parser(sub)


def _serve(args: argparse.Namespace) -> int:
    from .control.serve import run

    return run(args)


def _spaces_parser(sub: argparse._SubParsersAction) -> None:
    from .examples.spaces import add_parser

    add_parser(sub)


def _spaces(args: argparse.Namespace) -> int:
    from .examples.spaces import run

    return run(args)


_EXTRA_PARSERS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_demo_parser, _serve_parser, _spaces_parser)

#: The function each command runs.
_COMMANDS: Mapping[str, Callable[[argparse.Namespace], int]] = MappingProxyType({
    "inspect": _inspect, "verify": _verify, "stats": _stats, "export": _export,
    "demo": _demo, "serve": _serve, "spaces": _spaces,
})  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 a deltasync error, 2 usage)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    try:
        return _COMMANDS[args.command](args)
    except DeltaSyncError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
