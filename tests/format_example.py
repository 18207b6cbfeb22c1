"""The worked example of docs/protocol.md, and the helpers the format's tests share.

The example state and changes below are the worked example of docs/protocol.md, and
tests/unit/format/test_protocol_doc.py checks that the dumps printed there are what the code writes. After a
deliberate format change, ``PYTHONPATH=. python tests/format_example.py`` prints the new dumps to paste into the
document. The bytes they must give are pinned in tests/format_golden.py.
"""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import torch
import zstandard
from safetensors.torch import load as st_load

from deltasync import format as F
from deltasync.format.codecs import zstd as Z
from deltasync.format.fingerprint import fingerprint

BUCKET = "memory://example"
ANCHOR_WHERE = f"{BUCKET}/anchors/00000000.safetensors (version 0)"
DELTA_WHERE = f"{BUCKET}/deltas/00000001.safetensors (version 1)"
MASK64 = (1 << 64) - 1


# --------------------------------------------------------------------------- helpers


def bf16(bits: list[int]) -> torch.Tensor:
    """A 1-D bf16 tensor with exactly these (unsigned 16-bit) bit patterns."""
    return torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in bits], dtype=torch.int16).view(torch.bfloat16)


def bits_of(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFF for b in t.reshape(-1).view(torch.int16).tolist()]


def hexdump(data: bytes) -> str:
    """``hexdump -C`` layout: offset, 16 bytes in two groups of 8, printable ASCII."""
    lines = []
    for at in range(0, len(data), 16):
        row = data[at : at + 16]
        cells = [f"{b:02x}" for b in row] + ["  "] * (16 - len(row))
        text = "".join(chr(b) if 0x20 <= b < 0x7F else "." for b in row)
        lines.append(f"{at:08x}  {' '.join(cells[:8])}  {' '.join(cells[8:])}  |{text}|")
    lines.append(f"{len(data):08x}")
    return "\n".join(lines)


def header_json(data: bytes) -> dict:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n])


def rebuild(data: bytes, *, meta: dict | None = None, tensors: dict | None = None, drop: tuple[str, ...] = ()) -> bytes:
    """Re-serialize a file with metadata keys changed (value None deletes) and tensors changed."""
    metadata = dict(header_json(data)["__metadata__"])
    for key, value in (meta or {}).items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    content = {k: v for k, v in st_load(data).items() if k not in drop}
    content.update(tensors or {})
    return F.safetensors_bytes(content, metadata)


def apply(state: dict[str, torch.Tensor], changes: dict[str, F.Change]) -> dict[str, torch.Tensor]:
    out = {name: t.clone() for name, t in state.items()}
    for name, change in changes.items():
        out[name].view(-1)[change.index] = change.new
    return out


def lookup(state: dict[str, torch.Tensor]) -> F.BaseLookup:
    return lambda name, index: state[name].reshape(-1)[index]


def decode(data: bytes, state: dict[str, torch.Tensor] | None = None, *, where: str = DELTA_WHERE):
    state = example_state() if state is None else state
    numels = {name: t.numel() for name, t in state.items()}
    return F.decode_delta(data, where=where, numels=numels, base_values=lookup(state))


# --------------------------------------------------------------------------- the worked example


# Version 0: two parameters, bit patterns chosen by hand.
#   model.norm.weight [4]   = 1.0 1.0 1.0 1.0
#   model.proj.weight [2,3] = 0.5 -0.25 +0.0 / -0.0 2.0 -3.0
NORM_BITS = [0x3F80, 0x3F80, 0x3F80, 0x3F80]


PROJ_BITS = [0x3F00, 0xBE80, 0x0000, 0x8000, 0x4000, 0xC040]


# Version 1 changes six elements; each exercises one case of the zstd value code:
#   proj[0] 0x3F00 -> 0x3F01  one ULP up                      diff +1  zigzag 2      symbol 1
#   proj[2] +0.0   -> -0.0    across zero, one step down      diff -1  zigzag 1      symbol 0
#   proj[3] -0.0   -> 0x0001  to the smallest positive        diff +2  zigzag 4      escape
#   proj[5] -3.0   -> +3.0    a sign flip, wraps modulo 2**16 diff -32639  zigzag 65277  escape
#   norm[1] 1.0    -> 0x3F7F  one ULP down                    diff -1  zigzag 1      symbol 0
#   norm[3] 1.0    -> 0x3F7E  two ULPs down                   diff -2  zigzag 3      symbol 2
CHANGES = {
    "model.proj.weight": ([0, 2, 3, 5], [0x3F01, 0x8000, 0x0001, 0x4040]),
    "model.norm.weight": ([1, 3], [0x3F7F, 0x3F7E]),
}


def example_state() -> dict[str, torch.Tensor]:
    return {
        "model.norm.weight": bf16(NORM_BITS),
        "model.proj.weight": bf16(PROJ_BITS).reshape(2, 3),
    }


def example_changes() -> dict[str, F.Change]:
    state = example_state()
    out = {}
    for name, (index, new) in CHANGES.items():
        idx = torch.tensor(index, dtype=torch.int64)
        out[name] = F.Change(index=idx, new=bf16(new), old=state[name].reshape(-1)[idx])
    return out


def example_files() -> dict[str, bytes]:
    """The bucket of the worked example: an anchor, version 1 in each codec, the pointer."""
    state = example_state()
    fp0 = fingerprint(state)
    fp1 = fingerprint(apply(state, example_changes()))
    anchor = F.encode_anchor(state, version=0, fingerprint=fp0)
    common = dict(version=1, anchor=0, total=10, fingerprint=fp1, base_fingerprint=fp0)
    raw = F.encode_delta(example_changes(), codec="raw", **common)
    zstd = F.encode_delta(example_changes(), codec="zstd", **common)
    chain = (
        F.ChainEntry(
            version=0,
            kind="anchor",
            path=F.anchor_path(0),
            nbytes=len(anchor),
            sha256=F.sha256_hex(anchor),
            fingerprint=fp0,
            changed=10,
        ),
        F.ChainEntry(
            version=1,
            kind="delta",
            path=F.delta_path(1),
            nbytes=len(raw),
            sha256=F.sha256_hex(raw),
            fingerprint=fp1,
            changed=6,
        ),
    )
    pointer = F.Pointer.from_chain(version=1, anchor=0, fingerprint=fp1, total=10, chain=chain).to_bytes()
    return {"anchor": anchor, "raw": raw, "zstd": zstd, "pointer": pointer}


def big_gap_changes() -> tuple[dict[str, torch.Tensor], dict[str, F.Change]]:
    """A second example: one 70000-element parameter with gaps that need gap_hi and gap_big."""
    state = {"model.embed.weight": torch.zeros(70000, dtype=torch.bfloat16)}
    idx = torch.tensor([5, 300, 600, 69999])
    new = bf16([0x0001, 0x8001, 0x3C00, 0x0003])
    return state, {"model.embed.weight": F.Change(index=idx, new=new, old=state["model.embed.weight"][idx])}


def stream_table(streams: dict[str, bytes]) -> str:
    return "\n".join(f"{key:<12} {raw.hex(' ') if raw else '(empty)'}" for key, raw in streams.items())


def zstd_streams(data: bytes) -> dict[str, bytes]:
    """The decompressed streams of a zstd delta file."""
    tensors = st_load(data)
    return {
        key: zstandard.ZstdDecompressor().decompress(tensors["zstd:" + key].numpy().tobytes())
        if tensors["zstd:" + key].numel()
        else b""
        for key in Z.STREAMS
    }


def fingerprint_table(state: dict[str, torch.Tensor]) -> str:
    """Test vectors for the fingerprint: every element's key and hash, then the sum."""
    lines = [f"seed({name}) = {ref_seed(name):016x}" for name in state]
    lines.append(f"{'name':<18} {'index':>5}  bits  {'key':<16}  h = mix64(key)")
    for name, tensor in state.items():
        for index, bits in enumerate(bits_of(tensor)):
            key = ((index << 16) | bits) ^ ref_seed(name)
            lines.append(f"{name:<18} {index:>5}  {bits:04x}  {key:016x}  {ref_mix64(key):016x}")
    lines.append(f"sum mod 2**64 = {fingerprint(state)}")
    return "\n".join(lines)


def ref_manifest(entries: list[tuple[str, list[int], str]]) -> str:
    """docs/protocol.md section 3: SHA-256 of the compact JSON list of [name, shape, dtype] in
    name order."""
    import hashlib

    body = json.dumps(sorted([name, shape, dtype] for name, shape, dtype in entries), separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def manifest_files() -> dict[str, bytes]:
    """The worked example as a format 4 writer writes it: every file names the manifest, and so
    does the pointer."""
    from dataclasses import replace

    state = example_state()
    manifest = F.tensors_manifest(state)
    fp0, fp1 = fingerprint(state), fingerprint(apply(state, example_changes()))
    anchor = F.encode_anchor(state, version=0, fingerprint=fp0, manifest=manifest)
    raw = F.encode_delta(example_changes(), codec="raw", version=1, anchor=0, total=10, fingerprint=fp1,
                         base_fingerprint=fp0, manifest=manifest)  # fmt: skip
    entries = (
        F.ChainEntry(version=0, kind="anchor", path=F.anchor_path(0), nbytes=len(anchor),
                     sha256=F.sha256_hex(anchor), fingerprint=fp0, changed=10),  # fmt: skip
        F.ChainEntry(version=1, kind="delta", path=F.delta_path(1), nbytes=len(raw),
                     sha256=F.sha256_hex(raw), fingerprint=fp1, changed=6),  # fmt: skip
    )
    pointer = F.Pointer.from_chain(version=1, anchor=0, fingerprint=fp1, total=10, chain=entries)
    pointer = replace(pointer, manifest=manifest)
    return {"anchor": anchor, "raw": raw, "pointer": pointer.to_bytes()}


EXAMPLE_WRITER = F.WriterRecord(
    host="trainer-0", pid=4242, started_ms=1767225600000, token="0123456789abcdef0123456789abcdef",
    committed_ms=1767225615500, lease_ms=600000,
)


def render_examples() -> dict[str, str]:
    """Every dump docs/protocol.md shows, by the name of its ``<!-- dump: NAME -->`` marker."""
    files = example_files()
    _, changes = big_gap_changes()
    streams, _ = Z.zstd_streams(list(changes.items()))
    return {
        "anchor": hexdump(files["anchor"]),
        "raw-delta": hexdump(files["raw"]),
        "zstd-delta": hexdump(files["zstd"]),
        "zstd-streams": stream_table(zstd_streams(files["zstd"])),
        "big-gap-streams": stream_table(streams),
        "pointer": files["pointer"].decode().rstrip("\n"),
        "manifest": "\n".join([
            json.dumps([["model.norm.weight", [4], "BF16"], ["model.proj.weight", [2, 3], "BF16"]], separators=(",", ":")),
            F.tensors_manifest(example_state()),
        ]),
        "manifest-header": json.dumps(F.read_metadata(manifest_files()["raw"], where="x"), sort_keys=True, separators=(",", ":")),
        "pointer-4": manifest_files()["pointer"].decode().rstrip("\n"),
        "pointer-writer": json.dumps({"writer": EXAMPLE_WRITER.to_json()}, sort_keys=True, indent=1),
        "fingerprint": fingerprint_table(example_state()),
    }


# --------------------------------------------------------------------------- reference definitions
# Plain-Python transcriptions of docs/protocol.md, written from the document, not from the code.


def ref_seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")


def ref_mix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def ref_fingerprint(state: dict[str, torch.Tensor]) -> str:
    total = 0
    for name, tensor in state.items():
        seed = ref_seed(name)
        for index, bits in enumerate(bits_of(tensor)):
            total += ref_mix64((((index << 16) | bits) & MASK64) ^ seed)
    return f"{total & MASK64:016x}"


def ref_ordered(bits: int) -> int:
    return bits if bits < 0x8000 else 0x7FFF - bits


def ref_from_ordered(o: int) -> int:
    o = (o + 0x8000) % 0x10000 - 0x8000
    return o if o >= 0 else 0x7FFF - o


def ref_streams(items: list[tuple[list[int], list[int], list[int]]] | list[tuple[list[int], list[int], list[int], bool]]) -> dict[str, bytes]:
    """(indices, old bits, new bits) per parameter, in ``names`` order -> the seven streams. A
    fourth item ``True`` says the bits are one-byte codes: their lanes are differenced as they
    are, not as ordered bf16 patterns."""
    gaps, zigs = [], []
    for index, old, new, *codes in items:
        previous = -1
        lane = (lambda b: b) if codes and codes[0] else ref_ordered
        for i, o, n in zip(index, old, new, strict=True):
            gaps.append(i - previous - 1)
            previous = i
            d = (lane(n) - lane(o)) % 0x10000
            d = d - 0x10000 if d >= 0x8000 else d
            zigs.append(2 * d if d >= 0 else -2 * d - 1)
    mask = bytearray((len(gaps) + 7) // 8)
    for k, gap in enumerate(gaps):
        if gap >> 8:
            mask[k // 8] |= 1 << (k % 8)
    sym = bytearray((len(zigs) + 3) // 4)
    for k, z in enumerate(zigs):
        sym[k // 4] |= (z - 1 if z <= 3 else 3) << (2 * (k % 4))
    escapes = [z for z in zigs if z > 3]
    return {
        "gap_lo": bytes(g & 0xFF for g in gaps),
        "gap_hi_mask": bytes(mask),
        "gap_hi": bytes(min(g >> 8, 255) for g in gaps if g >> 8),
        "gap_big": b"".join((g >> 8).to_bytes(8, "little") for g in gaps if g >> 8 >= 255),
        "sym": bytes(sym),
        "esc_lo": bytes(z & 0xFF for z in escapes),
        "esc_hi": bytes(z >> 8 for z in escapes),
    }


# --------------------------------------------------------------------------- cases for round trips


def random_bits(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, 0x10000, size=n).tolist()


def make_case(
    numels: dict[str, int],
    index: dict[str, list[int]],
    new: dict[str, list[int]] | None = None,
    base: dict[str, list[int]] | None = None,
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], dict[str, F.Change]]:
    """A base state and changes to it; unspecified bits are random, new bits always differ."""
    rng = np.random.default_rng(seed)
    state = {name: bf16(base[name] if base and name in base else random_bits(rng, n)) for name, n in numels.items()}
    changes = {}
    for name, idx in index.items():
        old = state[name][torch.tensor(idx, dtype=torch.int64)] if idx else bf16([])
        if new and name in new:
            values = new[name]
        else:
            values = [b ^ int(rng.integers(1, 0x10000)) for b in bits_of(old)]
        changes[name] = F.Change(index=torch.tensor(idx, dtype=torch.int64), new=bf16(values), old=old)
    return state, changes


CASES = {
    "one change at index 0": lambda: make_case({"w": 10}, {"w": [0]}),
    "one change at the last index": lambda: make_case({"w": 10}, {"w": [9]}),
    "gaps at the byte boundary": lambda: make_case({"w": 2000}, {"w": [255, 511, 768, 1999]}),
    "gaps of 255*256 and more use gap_big": lambda: make_case({"w": 200000}, {"w": [65280, 130560, 199999]}),
    "changes across zero": lambda: make_case(
        {"w": 8},
        {"w": list(range(8))},
        new={"w": [0x8000, 0x0000, 0x8001, 0x0001, 0xBF80, 0x3F80, 0x0001, 0x8001]},
        base={"w": [0x0000, 0x8000, 0x0001, 0x8001, 0x3F80, 0xBF80, 0x0000, 0x8000]},
    ),
    "NaN and infinity bit patterns": lambda: make_case(
        {"w": 7},
        {"w": list(range(7))},
        new={"w": [0x7FC0, 0x7F80, 0xFF80, 0x7F81, 0xFFFF, 0x7F80, 0x7F80]},
        base={"w": [0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0000, 0x7F7F]},
    ),
    "the largest differences, modulo 2**16": lambda: make_case(
        {"w": 4},
        {"w": [0, 1, 2, 3]},
        new={"w": [0xFFFF, 0x7FFF, 0xFFFF, 0x7FFF]},
        base={"w": [0x0000, 0x0000, 0x7FFF, 0xFFFF]},
    ),
    "every element changed": lambda: make_case({"w": 37}, {"w": list(range(37))}),
    "several parameters, names not sorted": lambda: make_case(
        {"z.weight": 50, "a.bias": 7, "m.weight": 300, "untouched": 5},
        {"z.weight": [3, 4, 49], "a.bias": [6], "m.weight": list(range(0, 300, 7))},
    ),
}


def encode(
    changes: dict[str, F.Change], state: dict[str, torch.Tensor], codec: str, numels: dict | None = None
) -> bytes:
    return F.encode_delta(
        changes,
        version=7,
        anchor=5,
        codec=codec,
        total=sum(t.numel() for t in state.values()),
        fingerprint=fingerprint(apply(state, changes)),
        base_fingerprint=fingerprint(state),
        numels=numels or {name: t.numel() for name, t in state.items()},
    )


# --------------------------------------------------------------------------- the example's files, to be broken by the malformed-input tests


def _raw() -> bytes:
    return example_files()["raw"]


def _zstd() -> bytes:
    return example_files()["zstd"]


def _anchor() -> bytes:
    return example_files()["anchor"]


def _zstd_with(**streams: bytes | torch.Tensor) -> bytes:
    """The example zstd delta with some streams replaced (bytes are compressed, tensors kept)."""
    compressor = zstandard.ZstdCompressor(write_content_size=True)
    tensors = {}
    for key, raw in streams.items():
        if isinstance(raw, torch.Tensor):
            tensors["zstd:" + key] = raw
        else:
            blob = compressor.compress(raw) if raw else b""
            tensors["zstd:" + key] = (
                torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
            )
    return rebuild(_zstd(), tensors=tensors)


def _big_gap_file(gap_big: bytes, gap_hi: bytes = b"\xff", mask: bytes = b"\x01") -> bytes:
    """A one-change zstd delta on model.norm.weight whose gap has an escaped high part."""
    data = rebuild(
        _zstd(),
        meta={"names": '["model.norm.weight"]', "changed": "1", "params": "1"},
        tensors={"zstd:counts": torch.tensor([1], dtype=torch.int64)},
    )
    compressor = zstandard.ZstdCompressor(write_content_size=True)
    streams = {
        "gap_lo": b"\x00",
        "gap_hi_mask": mask,
        "gap_hi": gap_hi,
        "gap_big": gap_big,
        "sym": b"\x01",
        "esc_lo": b"",
        "esc_hi": b"",
    }
    return rebuild(
        data,
        tensors={
            "zstd:" + k: torch.frombuffer(bytearray(compressor.compress(v)), dtype=torch.uint8)
            if v
            else torch.zeros(0, dtype=torch.uint8)
            for k, v in streams.items()
        },
    )


def _rename(data: bytes, old: str, new: str) -> bytes:
    tensors = st_load(data)
    renamed = {key.replace(old, new): t for key, t in tensors.items()}
    return rebuild(data, tensors=renamed, drop=tuple(tensors))


if __name__ == "__main__":
    for name, text in render_examples().items():
        print(f"<!-- dump: {name} -->\n```text\n{text}\n```\n")
