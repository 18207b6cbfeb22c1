"""Fuzz the read boundary of a bucket: mutated pointers, headers, metadata, codec streams,
data, shapes and bit patterns, for as long as you like.

Each case starts from an honest bucket (a format 3 pointer: deltas 1..3, anchor 0 and an anchor
of version 2 beside its delta; one raw and one zstd), applies one mutation (rewriting the
pointer's size and checksum where the category says so, as an attacker who can write the whole
bucket would), then syncs a receiver: one at version 1 replays deltas only, a new one loads the
anchor at or below a random target (0 for 0..1, 2 for 2..3). Outcomes:

- refused cleanly: a ``DeltaSyncError``, and the receiver's version, fingerprint and every
  bit of its tensors unchanged;
- accepted: the sync succeeded and the receiver holds exactly the honest state of the version
  it reports (a mutation that changes nothing the reader uses, e.g. whitespace);
- accepted wrongly: the sync succeeded with any other state (or shapes);
- crashed: any other exception, or a refusal that changed the receiver.

Peak memory is the largest growth of the resident size during one sync (Linux: the peak is
reset through /proc/self/clear_refs before each), next to the largest legitimate file.

    PYTHONPATH=. python scripts/fuzz.py --seconds 900 --out fuzz.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import zstandard
from safetensors.torch import load as st_load

from deltasync import DeltaPublisher, DeltaReceiver, DeltaSyncError, Pointer, fingerprint, open_store
from deltasync import format as F

SHAPES = {"embed.weight": (64, 32), "layer.weight": (32, 32), "layer.bias": (32,), "norm.weight": (32,)}
CATEGORIES = ("pointer", "header", "metadata", "codec", "data", "bytes", "shapes", "exact")
MiB = 1 << 20


# --------------------------------------------------------------------------- the honest buckets


class Model(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            module, _, leaf = name.partition(".")
            if not hasattr(self, module):
                self.add_module(module, torch.nn.Module())
            getattr(self, module).register_parameter(
                leaf, torch.nn.Parameter(torch.randn(shape, generator=gen).to(torch.bfloat16))
            )


def set_random_bits(model: Model, rng: random.Random, count: int, *, special: bool) -> None:
    """Write ``count`` random bit patterns (NaN payloads, infinities, -0 included when ``special``)."""
    specials = [0xFFFF, 0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x7F81, 0xFFC0]
    with torch.no_grad():
        params = list(model.parameters())
        for _ in range(count):
            p = rng.choice(params)
            bits = rng.choice(specials) if special and rng.random() < 0.5 else rng.randrange(0x10000)
            p.data.view(-1).view(torch.int16)[rng.randrange(p.numel())] = bits - 0x10000 if bits >= 0x8000 else bits


@dataclasses.dataclass
class Bucket:
    root: Path
    codec: str
    files: dict[str, bytes]
    """Every file of the honest bucket."""
    states: dict[int, dict[str, torch.Tensor]]
    """The honest state of each version."""

    @property
    def store(self):  # noqa: ANN201
        return open_store(self.root)

    def restore(self) -> None:
        store = self.store
        for path in store.list():
            if path not in self.files:
                store.delete([path])
        for path, data in self.files.items():
            if (self.root / path).stat().st_size != len(data) or store.read_bytes(path) != data:
                store.write_bytes(path, data)

    def pointer(self) -> Pointer:
        return Pointer.from_bytes(self.files[F.POINTER_PATH])


def honest_bucket(root: Path, codec: str, seed: int) -> Bucket:
    rng = random.Random(seed)
    model = Model(seed)
    publisher = DeltaPublisher(root, model, None, codec=codec, anchor_every=100, anchor_bytes_ratio=0, keep_anchors=2)
    states = {}
    for version in range(4):
        if version:
            set_random_bits(model, rng, rng.randrange(1, 40), special=True)
        publisher.publish(anchor=version == 2)
        publisher.flush()
        states[version] = {n: p.detach().clone() for n, p in model.named_parameters()}
    publisher.close()
    store = open_store(root)
    files = {path: store.read_bytes(path) for path in store.list()}
    bucket = Bucket(root, codec, files, states)
    pointer = bucket.pointer()
    assert [a.version for a in pointer.anchors] == [0, 2] and [e.version for e in pointer.chain] == [1, 2, 3]
    return bucket


# --------------------------------------------------------------------------- hostile values


def random_json(rng: random.Random) -> str:
    """Raw JSON text (or near-JSON) chosen to break parsers and unchecked arithmetic."""
    choice = rng.randrange(16)
    if choice == 0:
        return rng.choice(["Infinity", "-Infinity", "NaN", "1e999", "-1e999", "1.5", "0.0", "-0"])
    if choice == 1:
        return "9" * rng.choice([17, 20, 400, 4301, 5000, 20000])
    if choice == 2:
        return str(rng.choice([-1, -(2**63), 2**31, 2**32, 2**53, 2**63, 2**64, 10**15, 10**9, 0, 1]))
    if choice == 3:
        depth = rng.choice([9, 100, 1000, 50_000, 200_000])
        return "[" * depth + "]" * depth
    if choice == 4:
        depth = rng.choice([9, 1000, 100_000])
        return '{"a":' * depth + "1" + "}" * depth
    if choice == 5:
        return json.dumps(rng.choice(["+1", " 1", "1_0", "٣", "１", "01", "-1", "", "none", "0x10", "1e3"]))
    if choice == 6:
        return rng.choice(["true", "false", "null"])
    if choice == 7:
        return json.dumps([rng.randrange(-3, 2**40) for _ in range(rng.randrange(0, 5))])
    if choice == 8:
        return json.dumps([0, 2**63, 2**63])
    if choice == 9:
        return json.dumps("x" * rng.choice([0, 1, 16, 64, 100_000]))
    if choice == 10:
        return json.dumps({"k": rng.randrange(100)})
    if choice == 11:
        return "[" * rng.randrange(1, 50)  # unterminated
    if choice == 12:
        return '"' + "\\" * rng.randrange(1, 5) + '"'
    if choice == 13:
        return str(rng.randrange(0, 300))
    if choice == 14:
        return json.dumps(rng.choice(["anchor", "delta", "raw", "zstd", "deltas/00000002.safetensors", "../x", "F8"]))
    return json.dumps(rng.choice(["0" * 16, "f" * 64, "Z" * 16, "0" * 15]))


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    kind = rng.randrange(5)
    if kind == 0 and data:
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1 and data:
        del data[rng.randrange(len(data)) :]
    elif kind == 2:
        at = rng.randrange(len(data) + 1)
        data[at:at] = random_json(rng).encode()[: rng.choice([8, 64, 10**6])]
    elif kind == 3 and data:
        at = rng.randrange(len(data))
        data[at : at + rng.randrange(1, 16)] = b""
    else:
        data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    return bytes(data)


def replace_value(rng: random.Random, obj: dict, raw: str) -> str:
    """JSON text of ``obj`` with one randomly chosen value (at any depth) replaced by ``raw``."""
    paths: list[tuple] = []

    def walk(node, path) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                paths.append((*path, key))
                walk(value, (*path, key))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                paths.append((*path, i))
                walk(value, (*path, i))

    walk(obj, ())
    obj = json.loads(json.dumps(obj))
    if not paths:
        return raw
    path = rng.choice(paths)
    node = obj
    for key in path[:-1]:
        node = node[key]
    marker = "@@MARK@@"
    if rng.random() < 0.1 and isinstance(node, dict):
        del node[path[-1]]
        return json.dumps(obj)
    node[path[-1]] = marker
    return json.dumps(obj).replace(json.dumps(marker), raw, 1)


def fix_pointer(bucket: Bucket, path: str, data: bytes) -> None:
    """Write ``data`` at ``path`` and rewrite the pointer's size and checksum to match."""
    store = bucket.store
    store.write_bytes(path, data)
    pointer = bucket.pointer()
    anchors, chain = (
        tuple(dataclasses.replace(e, nbytes=len(data), sha256=F.sha256_hex(data)) if e.path == path else e for e in items)
        for items in (pointer.anchors, pointer.chain)
    )
    store.write_bytes(F.POINTER_PATH, dataclasses.replace(pointer, anchors=anchors, chain=chain).to_bytes())


def split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(header_text: bytes, rest: bytes) -> bytes:
    header_text += b" " * (-len(header_text) % 8)
    return struct.pack("<Q", len(header_text)) + header_text + rest


def data_file(rng: random.Random, bucket: Bucket, category: str) -> F.ChainEntry | None:
    """The file a case mutates: the pointer's own (None), a delta (codec streams), an anchor
    (shapes) or any data file."""
    pointer = bucket.pointer()
    if category == "pointer":
        return None
    entries = {"codec": pointer.chain, "shapes": pointer.anchors}.get(category, (*pointer.anchors, *pointer.chain))
    return rng.choice(entries)


def reader_for(rng: random.Random, bucket: Bucket, entry: F.ChainEntry | None) -> tuple[bool, int | None]:
    """``(live, target)``: a receiver that reads ``entry`` (now and then any receiver, which
    may not): the live one at version 1 replays deltas 2..3; a new one loads the anchor at or
    below ``target``, then the deltas after it."""
    pointer = bucket.pointer()
    readers = [(True, None), *((False, t) for t in bucket.states)]
    if entry is not None and rng.random() < 0.9:
        readers = [
            (live, t)
            for live, t in readers
            if (live and entry.kind == "delta" and entry.version >= 2)
            or (not live and entry.kind == "anchor" and pointer.anchor_for(t).version == entry.version)
            or (not live and entry.kind == "delta" and pointer.anchor_for(t).version < entry.version <= t)
        ]
    return rng.choice(readers)


# --------------------------------------------------------------------------- categories


def m_pointer(rng: random.Random, bucket: Bucket, entry: F.ChainEntry | None) -> None:
    text = bucket.files[F.POINTER_PATH]
    if rng.random() < 0.5:
        new = mutate_bytes(rng, text)
    else:
        new = replace_value(rng, json.loads(text), random_json(rng)).encode()
    bucket.store.write_bytes(F.POINTER_PATH, new)


def m_header(rng: random.Random, bucket: Bucket, entry: F.ChainEntry | None) -> None:
    path = entry.path
    header, rest = split(bucket.files[path])
    if rng.random() < 0.2:
        text = mutate_bytes(rng, json.dumps(header, separators=(",", ":")).encode())
    else:
        text = replace_value(rng, header, random_json(rng)).encode()
    fix_pointer(bucket, path, join(text, rest))


def m_metadata(rng: random.Random, bucket: Bucket, entry: F.ChainEntry | None) -> None:
    path = entry.path
    header, rest = split(bucket.files[path])
    meta = header["__metadata__"]
    key = rng.choice([*meta, "names", "base_fingerprint"])
    value = random_json(rng)
    try:
        meta[key] = str(json.loads(value)) if rng.random() < 0.7 else value
    except (ValueError, RecursionError):
        meta[key] = value
    fix_pointer(bucket, path, join(json.dumps(header, separators=(",", ":")).encode(), rest))


def bomb(rng: random.Random) -> bytes:
    kind = rng.randrange(3)
    if kind == 0:  # a tiny frame that declares a huge size
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(rng.randrange(1, 5000)))
        size = rng.choice([2**40, 2**50, 2**63, 2**32, 10**9])
        return frame[:4] + bytes([frame[4] | 0xC0]) + frame[5:6] + struct.pack("<Q", size) + frame[6:]
    size = rng.choice([16, 64, 256]) * MiB
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=kind == 1).compressobj(size=size if kind == 1 else -1)
    chunk = bytes(16 * MiB)
    return b"".join(cobj.compress(chunk) for _ in range(size // len(chunk))) + cobj.flush()


def m_codec(rng: random.Random, bucket: Bucket, entry: F.ChainEntry | None) -> None:
    path = entry.path
    data = bucket.files[path]
    header = F.read_header(data, where=path)
    tensors = st_load(data)
    key = rng.choice(sorted(tensors))
    blob = tensors[key].view(-1).view(torch.uint8).numpy().tobytes()
    kind = rng.randrange(4)
    if kind == 0 and "zstd" in key and key != "zstd:counts":
        new = bomb(rng)
    elif kind == 1 and key == "zstd:counts":
        values = [rng.choice([-1, 0, 1, 2**62, -(2**63), rng.randrange(0, 5000)]) for _ in range(tensors[key].numel())]
        tensors[key] = torch.tensor(values, dtype=torch.int64)
        fix_pointer(bucket, path, F.safetensors_bytes(tensors, header.to_metadata()))
        return
    elif kind == 2:
        new = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 200)))
    else:
        new = mutate_bytes(rng, blob)
    if tensors[key].dtype == torch.uint8:
        tensors[key] = torch.frombuffer(bytearray(new), dtype=torch.uint8) if new else torch.zeros(0, dtype=torch.uint8)
    else:  # keep the dtype: reinterpret whole elements of the new bytes
        itemsize = tensors[key].element_size()
        new = new[: len(new) // itemsize * itemsize]
        tensors[key] = torch.frombuffer(bytearray(new), dtype=tensors[key].dtype) if new else tensors[key][:0]
    fix_pointer(bucket, path, F.safetensors_bytes(tensors, header.to_metadata()))


def m_data(rng: random.Random, bucket: Bucket, entry: F.ChainEntry | None) -> None:
    path = entry.path
    header, rest = split(bucket.files[path])
    body = bytearray(rest)
    for _ in range(rng.randrange(1, 6)):
        if body:
            body[rng.randrange(len(body))] ^= 1 << rng.randrange(8)
    fix_pointer(bucket, path, join(json.dumps(header, separators=(",", ":")).encode(), bytes(body)))


def m_bytes(rng: random.Random, bucket: Bucket, entry: F.ChainEntry | None) -> None:
    path = entry.path
    data = bucket.files[path]
    if rng.random() < 0.1:  # an oversized object: a sparse file of up to 4 GiB
        with open(bucket.root / path, "r+b") as f:
            f.truncate(rng.choice([1, 64, 1024, 4096]) * MiB)
        return
    new = mutate_bytes(rng, data)
    if rng.random() < 0.5:
        fix_pointer(bucket, path, new)
    else:
        bucket.store.write_bytes(path, new)


def m_shapes(rng: random.Random, bucket: Bucket, entry: F.ChainEntry | None) -> None:
    state = {k: v.clone() for k, v in bucket.states[entry.version].items()}
    name = rng.choice(sorted(state))
    kind = rng.randrange(4)
    shape = state[name].shape
    if kind == 0:  # flattened, or a column
        state[name] = state[name].reshape(-1) if len(shape) > 1 else state[name].reshape(-1, 1)
    elif kind == 1:
        state[name] = state[name].reshape(1, *shape)
    elif kind == 2 and len(shape) == 2 and shape[0] != shape[1]:
        state[name] = state[name].reshape(shape[1], shape[0])
    else:
        state[f"extra.{rng.randrange(100)}"] = torch.zeros(0, rng.randrange(1, 9), dtype=torch.bfloat16)
    fp = fingerprint(state)
    fix_pointer(bucket, entry.path, F.encode_anchor(state, version=entry.version, fingerprint=fp))


MUTATIONS: dict[str, Callable[[random.Random, Bucket, F.ChainEntry | None], None]] = {
    "pointer": m_pointer,
    "header": m_header,
    "metadata": m_metadata,
    "codec": m_codec,
    "data": m_data,
    "bytes": m_bytes,
    "shapes": m_shapes,
}


# --------------------------------------------------------------------------- running cases


@dataclasses.dataclass
class Tally:
    tried: int = 0
    refused: int = 0
    accepted: int = 0
    accepted_wrongly: int = 0
    crashed: int = 0
    peak_mib: float = 0.0
    examples: list[str] = dataclasses.field(default_factory=list)

    def bad(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what[:2000])


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(
        a[k].shape == b[k].shape and torch.equal(a[k].reshape(-1).view(torch.int16), b[k].reshape(-1).view(torch.int16))
        for k in a
    )


def run_case(rng: random.Random, bucket: Bucket, category: str, tally: Tally) -> None:
    bucket.restore()
    entry = data_file(rng, bucket, category)
    live, target = reader_for(rng, bucket, entry)
    receiver = DeltaReceiver(bucket.root, expected=SHAPES if category == "shapes" else None)
    if live:
        receiver.sync(1)
    before = (receiver.version, receiver.fingerprint, {k: v.clone() for k, v in receiver.state_dict().items()})
    MUTATIONS[category](rng, bucket, entry)
    tally.tried += 1
    base = reset_peak()
    try:
        receiver.sync(target)
    except DeltaSyncError as exc:
        after = (receiver.version, receiver.fingerprint)
        if after == before[:2] and same_bits(receiver.state_dict(), before[2]):
            tally.refused += 1
        else:
            tally.crashed += 1
            tally.bad(f"refused but changed the receiver: {exc!r}")
        return
    except Exception:  # noqa: BLE001  (that is what we count)
        tally.crashed += 1
        tally.bad(traceback.format_exc(limit=4))
        return
    finally:
        tally.peak_mib = max(tally.peak_mib, (_rss_kib("VmHWM") - base) / 1024)
    version = receiver.version
    honest = bucket.states.get(version)  # type: ignore[arg-type]
    if honest is not None and same_bits(receiver.state_dict(), honest) and receiver.verify():
        tally.accepted += 1
    else:
        tally.accepted_wrongly += 1
        tally.bad(f"accepted version {version} with a state that is not the honest one")


def run_exact(rng: random.Random, tally: Tally) -> None:
    """Random bit patterns over several versions: live and replaying receivers stay exact."""
    bucket = f"memory://fuzz-exact-{rng.randrange(2**62)}"
    model = Model(rng.randrange(1000))
    publisher = DeltaPublisher(bucket, model, None, codec=rng.choice(F.CODECS), anchor_every=100, anchor_bytes_ratio=0)
    publisher.publish()
    live = DeltaReceiver(bucket)
    live.sync()
    tally.tried += 1
    base = reset_peak()
    try:
        for _ in range(rng.randrange(1, 6)):
            set_random_bits(model, rng, rng.choice([1, 1, 2, 17, 300]), special=True)
            publisher.publish(anchor=rng.random() < 0.3)  # an anchor beside: new receivers start there
            if rng.random() < 0.5:
                live.sync()
        publisher.close()  # every anchor committed
        live.sync()
        fresh = DeltaReceiver(bucket)
        fresh.sync()
    except Exception:  # noqa: BLE001
        tally.crashed += 1
        tally.bad(traceback.format_exc(limit=4))
        return
    tally.peak_mib = max(tally.peak_mib, (_rss_kib("VmHWM") - base) / 1024)
    expected = {n: p.detach() for n, p in model.named_parameters()}
    if all(same_bits(r.state_dict(), expected) and r.fingerprint == publisher.fingerprint for r in (live, fresh)):
        tally.accepted += 1
    else:
        tally.accepted_wrongly += 1
        tally.bad("a receiver's bits differ from the trainer's")
    open_store(bucket).fs.rm(bucket.split("://", 1)[1], recursive=True)  # type: ignore[attr-defined]


def _rss_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))  # type: ignore[union-attr]


def reset_peak() -> int:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _rss_kib("VmRSS")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0, help="total time, split evenly over the categories")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--categories", nargs="*", default=list(CATEGORIES), choices=CATEGORIES)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    tallies: dict[str, Tally] = {}
    with tempfile.TemporaryDirectory(prefix="deltasync-fuzz-") as tmp:
        buckets = [honest_bucket(Path(tmp) / codec, codec, args.seed) for codec in F.CODECS]
        legit = max(len(d) for b in buckets for d in b.files.values())
        per = args.seconds / len(args.categories)
        for category in args.categories:
            tally = tallies[category] = Tally()
            deadline = time.monotonic() + per
            last = time.monotonic()
            while time.monotonic() < deadline:
                if category == "exact":
                    run_exact(rng, tally)
                else:
                    bucket = buckets[1] if category == "codec" else rng.choice(buckets)
                    run_case(rng, bucket, category, tally)
                if time.monotonic() - last > 30:
                    last = time.monotonic()
                    print(f"  {category}: {tally.tried} cases so far", file=sys.stderr, flush=True)
            print(
                f"{category:9s} tried {tally.tried:7d}  refused {tally.refused:7d}  accepted {tally.accepted:6d}  "
                f"accepted wrongly {tally.accepted_wrongly}  crashed {tally.crashed}  peak +{tally.peak_mib:.1f} MiB",
                flush=True,
            )
            for example in tally.examples:
                print("    " + example.replace("\n", "\n    "))
    total = Tally(
        tried=sum(t.tried for t in tallies.values()),
        refused=sum(t.refused for t in tallies.values()),
        accepted=sum(t.accepted for t in tallies.values()),
        accepted_wrongly=sum(t.accepted_wrongly for t in tallies.values()),
        crashed=sum(t.crashed for t in tallies.values()),
        peak_mib=max((t.peak_mib for t in tallies.values()), default=0.0),
    )
    print(
        f"{'total':9s} tried {total.tried:7d}  refused {total.refused:7d}  accepted {total.accepted:6d}  "
        f"accepted wrongly {total.accepted_wrongly}  crashed {total.crashed}  "
        f"(largest legitimate file: {legit} bytes; {sum(map(lambda s: torch.Size(s).numel(), SHAPES.values()))} elements)"
    )
    if args.out:
        report = {
            "seconds": args.seconds,
            "seed": args.seed,
            "largest_legitimate_file_bytes": legit,
            "categories": {k: dataclasses.asdict(v) for k, v in tallies.items()},
        }
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if total.crashed or total.accepted_wrongly else 0


if __name__ == "__main__":
    sys.exit(main())
