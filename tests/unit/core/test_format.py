"""The wire format, byte for byte: golden files, round trips, the fingerprint, malformed input.

The example state and changes below are also the worked example of docs/protocol.md, and a
test checks that the dumps printed there are what the code writes. After a deliberate format
change, ``PYTHONPATH=. python tests/unit/core/test_format.py`` prints the new dumps to paste into the document.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from helpers import old_pointer

from deltasync import DeltaReceiver, DeltaSyncError, FormatError, IntegrityError, Pointer, VersionError
from deltasync import format as F
from deltasync.format.codecs import zstd as Z
from deltasync.format.fingerprint import fingerprint, fingerprint_update

DOC = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"
BUCKET = "memory://example"
ANCHOR_WHERE = f"{BUCKET}/anchors/00000000.safetensors (version 0)"
DELTA_WHERE = f"{BUCKET}/deltas/00000001.safetensors (version 1)"
MASK64 = (1 << 64) - 1
ZSTD_GOLDEN_LIBZSTD = (1, 5, 7)


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


def ref_streams(items: list[tuple[list[int], list[int], list[int]]]) -> dict[str, bytes]:
    """(indices, old bits, new bits) per parameter, in ``names`` order -> the seven streams."""
    gaps, zigs = [], []
    for index, old, new in items:
        previous = -1
        for i, o, n in zip(index, old, new, strict=True):
            gaps.append(i - previous - 1)
            previous = i
            d = (ref_ordered(n) - ref_ordered(o)) % 0x10000
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


# --------------------------------------------------------------------------- golden values

FP0 = "11187f76270f9daf"
FP1 = "d4da98557a0e9731"

ANCHOR_HEADER = (
    b'{"__metadata__":{"anchor":"0","base":"none","changed":"10","codec":"raw",'
    b'"fingerprint":"11187f76270f9daf","format":"deltasync","format_version":"1","kind":"anchor",'
    b'"params":"2","total":"10","version":"0"},'
    b'"model.norm.weight":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},'
    b'"model.proj.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[8,20]}}    '
)
ANCHOR_DATA = "803f803f803f803f003f80be00000080004040c0"

RAW_DELTA_HEADER = (
    b'{"__metadata__":{"anchor":"0","base":"0","base_fingerprint":"11187f76270f9daf","changed":"6",'
    b'"codec":"raw","fingerprint":"d4da98557a0e9731","format":"deltasync","format_version":"1",'
    b'"kind":"delta","params":"2","total":"10","version":"1"},'
    b'"model.norm.weight:indices":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},'
    b'"model.proj.weight:indices":{"dtype":"I32","shape":[4],"data_offsets":[8,24]},'
    b'"model.norm.weight:values":{"dtype":"BF16","shape":[2],"data_offsets":[24,28]},'
    b'"model.proj.weight:values":{"dtype":"BF16","shape":[4],"data_offsets":[28,36]}} '
)
RAW_DELTA_DATA = (
    "01000000"
    "03000000"  # model.norm.weight:indices 1 3
    "00000000"
    "02000000"
    "03000000"
    "05000000"  # model.proj.weight:indices 0 2 3 5
    "7f3f"
    "7e3f"  # model.norm.weight:values
    "013f"
    "0080"
    "0100"
    "4040"  # model.proj.weight:values
)

ZSTD_METADATA_TEXT = (
    b'{"anchor":"0","base":"0","base_fingerprint":"11187f76270f9daf","changed":"6","codec":"zstd",'
    b'"fingerprint":"d4da98557a0e9731","format":"deltasync","format_version":"1","kind":"delta",'
    b'"names":"[\\"model.proj.weight\\",\\"model.norm.weight\\"]","params":"2","total":"10","version":"1"}'
)
ZSTD_TENSOR_ORDER = [
    "zstd:counts",
    "zstd:esc_hi",
    "zstd:esc_lo",
    "zstd:gap_big",
    "zstd:gap_hi",
    "zstd:gap_hi_mask",
    "zstd:gap_lo",
    "zstd:sym",
]
ZSTD_COUNTS = "04000000000000000200000000000000"
ZSTD_STREAMS = {
    "gap_lo": "000100010101",
    "gap_hi_mask": "00",
    "gap_hi": "",
    "gap_big": "",
    "sym": "f108",
    "esc_lo": "04fd",
    "esc_hi": "00fe",
}
# The whole zstd file, as libzstd ZSTD_GOLDEN_LIBZSTD compresses its streams at level 3.
ZSTD_DELTA_SHA256 = "9251deaacb8d1dd6c76e4bc82421114c807e4287393851a08071994764d918d2"

BIG_GAP_STREAMS = {
    "gap_lo": "05262b16",
    "gap_hi_mask": "0e",
    "gap_hi": "0101ff",
    "gap_big": "0f01000000000000",
    "sym": "f9",
    "esc_lo": "0006",
    "esc_hi": "7800",
}

POINTER_V1_TEXT = """\
{
 "anchor": 0,
 "chain": [
  {
   "changed": 10,
   "fingerprint": "11187f76270f9daf",
   "kind": "anchor",
   "nbytes": 380,
   "path": "anchors/00000000.safetensors",
   "sha256": "deb5a3f8e553c8bd880b37efe7b588496c0bf915080367f7b4fd56ebb33742b8",
   "version": 0
  },
  {
   "changed": 6,
   "fingerprint": "d4da98557a0e9731",
   "kind": "delta",
   "nbytes": 596,
   "path": "deltas/00000001.safetensors",
   "sha256": "fe97a7f238a842097ed4e5de5339ecb61cfde25deb86a5dfe2d436faefdccfd7",
   "version": 1
  }
 ],
 "fingerprint": "d4da98557a0e9731",
 "format": "deltasync",
 "format_version": 1,
 "total": 10,
 "version": 1
}
"""

# The same chain as a format 3 pointer (anchors beside deltas): what a writer writes now.
POINTER_TEXT = """\
{
 "anchor": 0,
 "anchors": [
  {
   "changed": 10,
   "fingerprint": "11187f76270f9daf",
   "kind": "anchor",
   "nbytes": 380,
   "path": "anchors/00000000.safetensors",
   "sha256": "deb5a3f8e553c8bd880b37efe7b588496c0bf915080367f7b4fd56ebb33742b8",
   "version": 0
  }
 ],
 "base": 0,
 "base_fingerprint": "11187f76270f9daf",
 "chain": [
  {
   "changed": 6,
   "fingerprint": "d4da98557a0e9731",
   "kind": "delta",
   "nbytes": 596,
   "path": "deltas/00000001.safetensors",
   "sha256": "fe97a7f238a842097ed4e5de5339ecb61cfde25deb86a5dfe2d436faefdccfd7",
   "version": 1
  }
 ],
 "fingerprint": "d4da98557a0e9731",
 "format": "deltasync",
 "format_version": 3,
 "root": 0,
 "total": 10,
 "version": 1
}
"""


# --------------------------------------------------------------------------- golden bytes


def test_file_names() -> None:
    assert F.POINTER_PATH == "latest.json"
    assert F.HISTORY_PATH == "history.jsonl"
    assert F.anchor_path(0) == "anchors/00000000.safetensors"
    assert F.delta_path(42) == "deltas/00000042.safetensors"
    assert F.delta_path(123456789) == "deltas/123456789.safetensors"  # 8 digits at least, never cut


def test_anchor_golden_bytes() -> None:
    data = example_files()["anchor"]
    assert data[:8] == struct.pack("<Q", len(ANCHOR_HEADER)) == bytes.fromhex("6001000000000000")
    assert data[8 : 8 + len(ANCHOR_HEADER)] == ANCHOR_HEADER
    assert data[8 + len(ANCHOR_HEADER) :].hex() == ANCHOR_DATA
    assert len(data) == 380


def test_raw_delta_golden_bytes() -> None:
    data = example_files()["raw"]
    assert data[:8] == struct.pack("<Q", len(RAW_DELTA_HEADER)) == bytes.fromhex("2802000000000000")
    assert data[8 : 8 + len(RAW_DELTA_HEADER)] == RAW_DELTA_HEADER
    assert data[8 + len(RAW_DELTA_HEADER) :].hex() == RAW_DELTA_DATA


def test_zstd_delta_golden_header_and_streams() -> None:
    data = example_files()["zstd"]
    tensors = st_load(data)
    # The header is exactly what the layout rules give; only the compressed sizes are free.
    entries, offset = [], 0
    for key in ZSTD_TENSOR_ORDER:
        size = tensors[key].numel() * tensors[key].element_size()
        dtype = "I64" if key == "zstd:counts" else "U8"
        shape = tensors[key].numel()
        entries.append(f'"{key}":{{"dtype":"{dtype}","shape":[{shape}],"data_offsets":[{offset},{offset + size}]}}')
        offset += size
    text = b'{"__metadata__":' + ZSTD_METADATA_TEXT + b"," + ",".join(entries).encode() + b"}"
    text += b" " * (-len(text) % 8)
    assert data[:8] == struct.pack("<Q", len(text))
    assert data[8 : 8 + len(text)] == text
    assert len(data) == 8 + len(text) + offset
    assert tensors["zstd:counts"].numpy().tobytes().hex() == ZSTD_COUNTS
    assert {key: raw.hex() for key, raw in zstd_streams(data).items()} == ZSTD_STREAMS
    assert tensors["zstd:gap_hi"].shape == tensors["zstd:gap_big"].shape == (0,)  # empty streams: no frame


@pytest.mark.skipif(
    zstandard.ZSTD_VERSION != ZSTD_GOLDEN_LIBZSTD,
    reason=f"compressed bytes are pinned for libzstd {ZSTD_GOLDEN_LIBZSTD}, this is {zstandard.ZSTD_VERSION}",
)
def test_zstd_delta_golden_file_bytes() -> None:
    assert F.sha256_hex(example_files()["zstd"]) == ZSTD_DELTA_SHA256


def test_zstd_streams_are_single_frames_with_content_size() -> None:
    _, changes = big_gap_changes()
    data = F.encode_delta(
        changes, version=1, anchor=0, codec="zstd", total=70000, fingerprint=FP1, base_fingerprint=FP0
    )
    tensors = st_load(data)
    for key in Z.STREAMS:
        blob = tensors["zstd:" + key].numpy().tobytes()
        assert blob[:4] == bytes.fromhex("28b52ffd")  # every stream of this example is non-empty
        params = zstandard.get_frame_parameters(blob)
        assert params.content_size == len(bytes.fromhex(BIG_GAP_STREAMS[key]))


def test_big_gaps_golden_streams() -> None:
    state, changes = big_gap_changes()
    streams, counts = Z.zstd_streams(list(changes.items()))
    assert counts == [4]
    assert {key: raw.hex() for key, raw in streams.items()} == BIG_GAP_STREAMS
    data = F.encode_delta(
        changes, version=1, anchor=0, codec="zstd", total=70000, fingerprint=FP1, base_fingerprint=FP0
    )
    _, decoded = decode(data, state)
    assert decoded["model.embed.weight"].index.tolist() == [5, 300, 600, 69999]
    assert bits_of(decoded["model.embed.weight"].new) == [0x0001, 0x8001, 0x3C00, 0x0003]


def test_pointer_golden_bytes() -> None:
    data = example_files()["pointer"]
    assert data.decode() == POINTER_TEXT
    pointer = Pointer.from_bytes(data)
    assert (pointer.version, pointer.anchor, pointer.fingerprint, pointer.total) == (1, 0, FP1, 10)
    assert (pointer.root, pointer.base, pointer.base_fingerprint) == (0, 0, FP0)
    assert pointer.delta(1).sha256 == F.sha256_hex(example_files()["raw"])
    assert pointer.anchors[0].sha256 == F.sha256_hex(example_files()["anchor"])
    assert pointer.to_bytes() == data
    # Canonical form: the same JSON dumped with sorted keys and a one-space indent.
    assert json.dumps(json.loads(data), sort_keys=True, indent=1) + "\n" == data.decode()


def test_format_1_pointer_is_still_read_as_the_same_chain() -> None:
    old = Pointer.from_bytes(POINTER_V1_TEXT.encode())
    assert old == Pointer.from_bytes(POINTER_TEXT.encode())
    assert old.to_bytes().decode() == POINTER_TEXT  # rewritten, it is format 3
    assert old_pointer(old).decode() == POINTER_V1_TEXT  # the tests' writer of old buckets


def test_fingerprint_golden() -> None:
    state = example_state()
    assert fingerprint(state) == FP0
    assert fingerprint(apply(state, example_changes())) == FP1
    assert ref_seed("model.norm.weight") == 0x3BBD05D3E6D4D252
    assert ref_seed("model.proj.weight") == 0x45D35D8BF4389C77
    # mix64 is SplitMix64's output function: its first output from seed 0 is a known value.
    assert ref_mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_manifest_digest_matches_the_documented_rule() -> None:
    state = example_state()
    want = ref_manifest([("model.proj.weight", [2, 3], "BF16"), ("model.norm.weight", [4], "BF16")])
    assert F.tensors_manifest(state) == want == F.manifest_digest(
        [("model.proj.weight", (2, 3), torch.bfloat16), ("model.norm.weight", (4,), torch.bfloat16)]
    )
    # Shapes, names and dtypes all count; the order of the entries does not.
    assert F.manifest_digest([("model.norm.weight", (1, 4), torch.bfloat16), ("model.proj.weight", (2, 3), torch.bfloat16)]) != want
    assert F.manifest_digest([("model.norm.weight", (4,), torch.bfloat16), ("model.proj.weight", (3, 2), torch.bfloat16)]) != want
    assert F.manifest_digest([("model.norm.weight", (4,), torch.int8), ("model.proj.weight", (2, 3), torch.bfloat16)]) != want
    assert F.tensors_manifest({**state, "extra": torch.zeros(0, dtype=torch.bfloat16)}) != want
    with pytest.raises(ValueError, match="each parameter once"):
        F.manifest_digest([("a", (1,), torch.bfloat16), ("a", (1,), torch.bfloat16)])


def test_format_4_files_and_pointer_name_the_manifest() -> None:
    files, manifest = manifest_files(), F.tensors_manifest(example_state())
    pointer = F.Pointer.from_bytes(files["pointer"])
    assert json.loads(files["pointer"])["format_version"] == 4 and pointer.manifest == manifest
    for key in ("anchor", "raw"):
        assert F.read_header(files[key], where=key).manifest == manifest
    # A format 4 pointer without its manifest, or with a malformed one, is refused by name.
    body = json.loads(files["pointer"])
    del body["manifest"]
    with pytest.raises(FormatError, match="a format_version 4 pointer must name its manifest"):
        F.Pointer.from_bytes(json.dumps(body).encode())
    body["manifest"] = "ABC"
    with pytest.raises(FormatError, match="manifest must be 64 lower-case hex digits, got 'ABC'"):
        F.Pointer.from_bytes(json.dumps(body).encode())


def test_protocol_doc_shows_the_bytes_the_code_writes() -> None:
    doc = DOC.read_text()
    for name, text in render_examples().items():
        match = re.search(rf"<!-- dump: {re.escape(name)} -->\n```text\n(.*?)\n```", doc, re.S)
        assert match, f"docs/protocol.md has no <!-- dump: {name} --> block"
        if name == "zstd-delta" and zstandard.ZSTD_VERSION != ZSTD_GOLDEN_LIBZSTD:
            continue  # compressed bytes depend on the libzstd version
        assert match.group(1) == text, f"docs/protocol.md: dump {name!r} is stale; run python tests/unit/core/test_format.py"


# --------------------------------------------------------------------------- the container


def _mixed_tensors() -> dict[str, torch.Tensor]:
    return {
        "z.bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "a.bf16": torch.tensor([1.5], dtype=torch.bfloat16),
        "f64": torch.tensor([1.0, -2.0], dtype=torch.float64),
        "i64": torch.tensor([2**40], dtype=torch.int64),
        "f32": torch.ones(3, dtype=torch.float32),
        "i32": torch.tensor([-1, 7], dtype=torch.int32),
        "f16": torch.tensor([0.25], dtype=torch.float16),
        "i16": torch.tensor([-3], dtype=torch.int16),
        "u8": torch.tensor([255, 0, 1], dtype=torch.uint8),
        "i8": torch.tensor([-128], dtype=torch.int8),
        "bool": torch.tensor([True, False]),
        "empty": torch.zeros(0, dtype=torch.uint8),
        "scalar": torch.tensor(3.0, dtype=torch.float32),
    }


def _our_tensor_sets() -> dict[str, dict[str, torch.Tensor]]:
    """Tensor sets like the ones deltasync writes: at most one dtype per element size."""
    wide = {"huge:indices": torch.tensor([2**31 + 1], dtype=torch.int64), "huge:values": bf16([7])}
    return {
        "anchor": example_state(),
        "raw delta": st_load(example_files()["raw"]),
        "raw delta with int64 indices": {**st_load(example_files()["raw"]), **wide},
        "zstd delta": st_load(example_files()["zstd"]),
        "no tensors": {},
        "one dtype per size": {
            "d": torch.ones(2, dtype=torch.float64),
            "c": torch.ones(3),
            "b": bf16([1]),
            "a": torch.zeros(0, dtype=torch.uint8),
            "s": torch.tensor(2.0),
        },
    }


@pytest.mark.parametrize("name", list(_our_tensor_sets()))
def test_container_equals_safetensors_save(name: str) -> None:
    tensors = _our_tensor_sets()[name]
    # With one metadata key the library's random metadata order cannot differ from ours.
    assert F.safetensors_bytes(tensors, {"format": "deltasync"}) == st_save(tensors, metadata={"format": "deltasync"})


def test_container_layout_rules() -> None:
    # Every dtype here, though deltasync itself writes only I64, I32, BF16 and U8.
    data = F.safetensors_bytes(_mixed_tensors(), {"b": "2", "a": "1", "c": "3"})
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    text = data[8 : 8 + n].decode()
    body = text.rstrip(" ")
    assert len(text) - len(body) < 8 and body.endswith("}")
    header = json.loads(body)
    assert json.dumps(header, separators=(",", ":")) == body  # compact, in the written order
    assert list(header) == [
        "__metadata__",
        "f64",
        "i64",
        "f32",
        "i32",
        "scalar",
        "a.bf16",
        "f16",
        "i16",
        "z.bf16",
        "bool",
        "empty",
        "i8",
        "u8",
    ]  # element size descending, then name (the library breaks ties between same-size dtypes otherwise)
    assert list(header["__metadata__"]) == ["a", "b", "c"]
    offset = 0
    for key in list(header)[1:]:
        start, end = header[key]["data_offsets"]
        assert start == offset
        offset = end
    assert len(data) == 8 + n + offset
    begin, end = header["empty"]["data_offsets"]
    assert begin == end  # an empty tensor has no data bytes
    assert header["scalar"]["shape"] == []


def test_safe_open_reads_anchor_and_raw_delta(tmp_path: Path) -> None:
    files = example_files()
    for name in ("anchor", "raw"):
        (tmp_path / name).write_bytes(files[name])
    with safe_open(tmp_path / "anchor", framework="pt") as f:
        assert f.metadata()["kind"] == "anchor"
        assert sorted(f.keys()) == ["model.norm.weight", "model.proj.weight"]
        assert bits_of(f.get_tensor("model.proj.weight")) == PROJ_BITS
        assert f.get_tensor("model.proj.weight").shape == (2, 3)
    with safe_open(tmp_path / "raw", framework="pt") as f:
        assert f.metadata()["codec"] == "raw"
        assert f.metadata()["base_fingerprint"] == FP0
        assert f.get_tensor("model.proj.weight:indices").tolist() == [0, 2, 3, 5]
        assert f.get_tensor("model.proj.weight:indices").dtype == torch.int32
        assert bits_of(f.get_tensor("model.norm.weight:values")) == [0x3F7F, 0x3F7E]


def test_decode_anchor() -> None:
    header, tensors = F.decode_anchor(example_files()["anchor"], where=ANCHOR_WHERE)
    assert (header.kind, header.version, header.base, header.anchor, header.codec) == ("anchor", 0, None, 0, "raw")
    assert (header.params, header.changed, header.total, header.fingerprint) == (2, 10, 10, FP0)
    assert fingerprint(tensors) == FP0
    assert tensors["model.proj.weight"].shape == (2, 3)


# --------------------------------------------------------------------------- round trips


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


def check_round_trip(state: dict[str, torch.Tensor], changes: dict[str, F.Change], codec: str) -> F.FileHeader:
    data = encode(changes, state, codec)
    header, decoded = decode(data, state, where="case")
    kept = {name: c for name, c in changes.items() if c.index.numel()}
    assert (header.kind, header.version, header.base, header.anchor, header.codec) == ("delta", 7, 6, 5, codec)
    assert header.params == len(kept)
    assert header.changed == sum(c.index.numel() for c in kept.values())
    assert header.names == (tuple(kept) if codec == "zstd" else None)
    assert list(decoded) == (list(kept) if codec == "zstd" else sorted(kept))
    for name, change in kept.items():
        assert decoded[name].index.dtype == torch.int64
        assert decoded[name].index.tolist() == change.index.tolist()
        assert bits_of(decoded[name].new) == bits_of(change.new)
    assert header.fingerprint == fingerprint(apply(state, decoded))
    return header


@pytest.mark.parametrize("codec", F.CODECS)
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(case: str, codec: str) -> None:
    state, changes = CASES[case]()
    check_round_trip(state, changes, codec)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("case", list(CASES))
def test_zstd_streams_are_the_same_when_transformed_in_chunks(case: str, chunk: int, monkeypatch) -> None:
    """The codec transforms each parameter's changes a bounded chunk at a time (memory); the
    streams, and so the file bytes, must not depend on the chunk."""
    state, changes = CASES[case]()
    whole = encode(changes, state, "zstd")
    monkeypatch.setattr(Z, "ENCODE_CHUNK", chunk)
    assert encode(changes, state, "zstd") == whole


def test_gap_big_is_used_from_255_times_256() -> None:
    _state, changes = CASES["gaps of 255*256 and more use gap_big"]()
    streams, _ = Z.zstd_streams(list(changes.items()))
    # gaps 65280 (high part 255: escaped), 65279 (high part 254), 69438 (high part 271: escaped)
    assert streams["gap_hi_mask"] == bytes([0b111])
    assert streams["gap_hi"] == bytes([255, 254, 255])
    assert streams["gap_big"] == (255).to_bytes(8, "little") + (271).to_bytes(8, "little")


@pytest.mark.parametrize("codec", F.CODECS)
@pytest.mark.parametrize("seed", range(12))
def test_round_trip_random(seed: int, codec: str) -> None:
    rng = np.random.default_rng(seed)
    numels = {f"p{k}": int(rng.integers(1, 3000)) for k in range(int(rng.integers(1, 5)))}
    index = {}
    for name, n in numels.items():
        density = rng.choice([0.001, 0.05, 0.5, 1.0])
        chosen = np.flatnonzero(rng.random(n) < density).tolist()
        if chosen:
            index[name] = chosen
    state, changes = make_case(numels, index, seed=seed)
    check_round_trip(state, changes, codec)


@pytest.mark.parametrize("seed", range(12))
def test_zstd_streams_follow_the_documented_definitions(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    numels = {"a": int(rng.integers(1, 400000)), "b": int(rng.integers(1, 50))}
    index = {
        name: sorted(set(rng.integers(0, n, size=int(rng.integers(1, 40))).tolist())) for name, n in numels.items()
    }
    _state, changes = make_case(numels, index, seed=seed)
    streams, counts = Z.zstd_streams(list(changes.items()))
    items = [(c.index.tolist(), bits_of(c.old), bits_of(c.new)) for c in changes.values()]
    assert streams == ref_streams(items)
    assert counts == [len(i) for i, _, _ in items]


def test_ordered_bit_pattern_transform() -> None:
    every = torch.arange(-0x8000, 0x8000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    ordered = Z.ordered(every)
    bits = bits_of(every)
    assert ordered.tolist() == [ref_ordered(b) for b in bits]
    assert sorted(ordered.tolist()) == list(range(-0x8000, 0x8000))  # a bijection onto int16
    assert bits_of(Z.from_ordered(ordered)) == bits
    assert bits_of(Z.from_ordered(ordered + 0x10000)) == bits  # taken modulo 2**16
    assert Z.ordered(bf16([0x0000, 0x8000, 0x0001, 0x8001, 0x7FFF, 0xFFFF])).tolist() == [0, -1, 1, -2, 32767, -32768]
    finite = torch.tensor([-3.0, -1.0, -1e-30, 0.0, 1e-30, 2.0, float("inf")], dtype=torch.bfloat16)
    assert Z.ordered(finite).tolist() == sorted(Z.ordered(finite).tolist())  # monotone in the value
    assert all(ref_from_ordered(ref_ordered(b)) == b for b in range(0x10000))
    # The decoder's int16 form of both: the same map on every pattern, and (ordered + d) taken
    # back for every pattern at every difference the symbols code (1-3 each way) and at the extremes.
    flip = Z._flip16(every.view(torch.int16))
    assert flip.tolist() == [o - 0x10000 if o >= 0x8000 else o for o in (ref_ordered(b) for b in bits)]
    assert Z._flip16(flip).tolist() == every.view(torch.int16).tolist()
    for d in (1, -1, 2, -2, 3, -3, 0x7FFF, -0x8000):
        moved = bits_of(Z._flip16(flip + torch.tensor(d, dtype=torch.int16)).view(torch.bfloat16))
        assert moved == [ref_from_ordered(ref_ordered(b) + d) for b in bits], d


@pytest.mark.parametrize("codec", F.CODECS)
@pytest.mark.parametrize("empty", ["no parameters", "a parameter with no index"])
def test_no_changes(codec: str, empty: str) -> None:
    state, changes = make_case({"w": 5}, {"w": []} if empty == "a parameter with no index" else {})
    data = encode(changes, state, codec)
    header, decoded = decode(data, state)
    assert decoded == {}
    assert (header.params, header.changed, header.fingerprint) == (0, 0, fingerprint(state))
    tensors = st_load(data)
    if codec == "raw":
        assert tensors == {}
    else:
        assert header.names == ()
        assert header_json(data)["__metadata__"]["names"] == "[]"
        assert tensors["zstd:counts"].shape == (0,) and tensors["zstd:counts"].dtype == torch.int64
        assert all(tensors["zstd:" + key].shape == (0,) for key in Z.STREAMS)


@pytest.mark.parametrize(("numel", "dtype"), [(2**31 - 1, torch.int32), (2**31, torch.int64), (2**40, torch.int64)])
def test_raw_indices_are_int64_only_over_int32_range(numel: int, dtype: torch.dtype) -> None:
    changes = {"huge": F.Change(index=torch.tensor([0, 3]), new=bf16([0x3F80, 0x4000]))}
    data = F.encode_delta(
        changes,
        version=1,
        anchor=0,
        codec="raw",
        total=numel,
        fingerprint=FP1,
        base_fingerprint=FP0,
        numels={"huge": numel},
    )
    assert st_load(data)["huge:indices"].dtype == dtype
    expected = "I32" if dtype == torch.int32 else "I64"
    assert header_json(data)["huge:indices"]["dtype"] == expected
    _, decoded = F.decode_delta(data, where="f", numels={"huge": numel}, base_values=None)  # type: ignore[arg-type]
    assert decoded["huge"].index.tolist() == [0, 3]


@pytest.mark.parametrize("codec", F.CODECS)
def test_indices_beyond_int32(codec: str) -> None:
    numel = 2**34
    index = [5, 2**31 - 1, 2**31, 2**31 + 7, 2**33 + 1, numel - 1]
    old = bf16([0] * len(index))
    changes = {"huge": F.Change(index=torch.tensor(index), new=bf16([1, 2, 3, 0x8000, 0x8001, 0x3F80]), old=old)}
    data = F.encode_delta(
        changes,
        version=1,
        anchor=0,
        codec=codec,
        total=numel,
        fingerprint=FP1,
        base_fingerprint=FP0,
        numels={"huge": numel},
    )
    _, decoded = F.decode_delta(
        data,
        where="f",
        numels={"huge": numel},
        base_values=lambda name, i: torch.zeros(i.numel(), dtype=torch.bfloat16),
    )
    assert decoded["huge"].index.tolist() == index
    assert bits_of(decoded["huge"].new) == [1, 2, 3, 0x8000, 0x8001, 0x3F80]


def test_zstd_values_are_relative_to_the_receivers_state() -> None:
    data = example_files()["zstd"]
    shifted = {name: bf16([b + 1 for b in bits_of(t)]) for name, t in example_state().items()}
    _, decoded = decode(data, shifted)
    assert bits_of(decoded["model.norm.weight"].new) == [0x3F80, 0x3F7F]  # each one pattern higher
    # ... which the fingerprint then catches: the result is not the state the file names.
    assert fingerprint(apply(shifted, decoded)) != FP1


# --------------------------------------------------------------------------- the fingerprint


def random_state(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {name: bf16(random_bits(rng, int(np.prod(shape)))).reshape(shape) for name, shape in shapes.items()}


SHAPES = {"embed.weight": (64, 8), "layers.0.mlp.weight": (16, 16), "norm.weight": (8,), "tiny": (1,)}


def test_fingerprint_matches_its_definition() -> None:
    for state in (example_state(), random_state(0, SHAPES)):
        assert fingerprint(state) == ref_fingerprint(state)


def test_fingerprint_does_not_depend_on_order() -> None:
    state = random_state(1, SHAPES)
    forward = fingerprint(state)
    assert fingerprint(dict(reversed(list(state.items())))) == forward
    halves = [dict(list(state.items())[:2]), dict(list(state.items())[2:])]
    total = (int(fingerprint(halves[0]), 16) + int(fingerprint(halves[1]), 16)) % 2**64
    assert f"{total:016x}" == forward


def test_fingerprint_incremental_update_equals_full_recompute() -> None:
    state = random_state(2, SHAPES)
    value = fingerprint(state)
    rng = np.random.default_rng(2)
    for _ in range(5):
        for name in reversed(list(state)):
            flat = state[name].view(-1)
            index = torch.from_numpy(np.flatnonzero(rng.random(flat.numel()) < 0.3))
            new = bf16(random_bits(rng, index.numel()))
            value = fingerprint_update(value, name, index, flat[index].clone(), new)
            flat[index] = new
            assert value == fingerprint(state)
    assert fingerprint_update(value, "norm.weight", torch.tensor([], dtype=torch.int64), bf16([]), bf16([])) == value


def test_fingerprint_is_bit_exact() -> None:
    plus = {"w": bf16([0x0000, 0x3F80])}
    minus = {"w": bf16([0x8000, 0x3F80])}
    assert fingerprint(plus) != fingerprint(minus)  # +0.0 == -0.0 as numbers, not as bits
    assert fingerprint({"w": bf16([0x7FC0])}) != fingerprint({"w": bf16([0x7FC1])})  # NaN payloads
    assert fingerprint({"w": bf16([1, 2])}) != fingerprint({"w": bf16([2, 1])})  # positions
    assert fingerprint({"w": bf16([1])}) != fingerprint({"v": bf16([1])})  # names
    assert fingerprint({"w": bf16([0])}) != fingerprint({})  # a zero element still counts
    assert fingerprint({}) == "0000000000000000"


def test_fingerprint_hashes_other_dtypes_as_their_bf16_rounding() -> None:
    fp32 = torch.tensor([1.0 + 2**-9, -3.14159, 1e-40])
    assert fingerprint({"w": fp32}) == fingerprint({"w": fp32.to(torch.bfloat16)})
    assert fingerprint({"w": fp32.reshape(3, 1)}) == fingerprint({"w": fp32})  # shapes are not hashed


# --------------------------------------------------------------------------- malformed files


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


BAD_DELTAS = {
    # metadata
    "no format key": (
        lambda: rebuild(_raw(), meta={"format": None}),
        "not a deltasync file (its metadata has no format='deltasync')",
    ),
    "no metadata at all": (lambda: st_save({"x": torch.zeros(1)}), "not a deltasync file"),
    "format_version 3": (
        # Pointers are format 3 now; files keep 1 and 2.
        lambda: rebuild(_raw(), meta={"format_version": "3"}),
        "format_version '3' is not supported (this deltasync reads files of 1, 2); upgrade deltasync",
    ),
    "format_version 2 without part keys": (
        lambda: rebuild(_raw(), meta={"format_version": "2"}),
        "metadata lacks the key 'part'",
    ),
    "missing version": (lambda: rebuild(_raw(), meta={"version": None}), "metadata lacks the key 'version'"),
    "missing kind": (
        lambda: rebuild(_raw(), meta={"kind": None}),
        "metadata lacks the key 'kind'",
    ),
    "unknown kind": (
        lambda: rebuild(_raw(), meta={"kind": "patch"}),
        "invalid metadata (kind 'patch' is neither 'anchor' nor 'delta')",
    ),
    "unknown codec": (
        lambda: rebuild(_raw(), meta={"codec": "lz4"}),
        "invalid metadata (codec 'lz4' is unknown (known: raw, zstd))",
    ),
    "version not a number": (
        lambda: rebuild(_raw(), meta={"version": "one"}),
        "invalid metadata (version='one' is not a plain decimal integer",
    ),
    "wrong base": (lambda: rebuild(_raw(), meta={"base": "5"}), "delta 1 names base 5, expected 0"),
    "names not a list": (
        lambda: rebuild(_zstd(), meta={"names": '{"a": 1}'}),
        "invalid metadata ('names' is not a JSON list of strings)",
    ),
    "an anchor where a delta is expected": (_anchor, "expected a delta, found an anchor"),
    # the container
    "truncated before the header length": (
        lambda: _raw()[:5],
        "truncated (5 bytes; a safetensors file has at least 8)",
    ),
    "truncated header": (lambda: _raw()[:100], "truncated (header says 552 bytes, file has 92 after it)"),
    "truncated data": (lambda: _raw()[:-2], "not a readable safetensors file"),
    "header is not JSON": (lambda: _raw()[:8] + b"\xff" + _raw()[9:], "unreadable safetensors header"),
    # raw tensors
    "values not bf16": (
        lambda: rebuild(_raw(), tensors={"model.norm.weight:values": torch.tensor([1.0, 2.0], dtype=torch.float16)}),
        "values of parameter 'model.norm.weight' must be a 1-D bfloat16 tensor, got torch.float16 (2,)",
    ),
    "indices not integers": (
        lambda: rebuild(_raw(), tensors={"model.norm.weight:indices": torch.tensor([1.0, 3.0])}),
        "indices of parameter 'model.norm.weight' must be a 1-D int32/int64 tensor, got torch.float32 (2,)",
    ),
    "indices not 1-D": (
        lambda: rebuild(_raw(), tensors={"model.norm.weight:indices": torch.tensor([[1, 3]], dtype=torch.int32)}),
        "indices of parameter 'model.norm.weight' must be a 1-D int32/int64 tensor, got torch.int32 (1, 2)",
    ),
    "more values than indices": (
        lambda: rebuild(_raw(), tensors={"model.norm.weight:values": bf16([1, 2, 3])}),
        "parameter 'model.norm.weight' has 2 indices but 3 values",
    ),
    "index past the end": (
        lambda: rebuild(_raw(), tensors={"model.norm.weight:indices": torch.tensor([1, 4], dtype=torch.int32)}),
        "index 4 of parameter 'model.norm.weight' is out of range (it has 4 elements)",
    ),
    "negative index": (
        lambda: rebuild(_raw(), tensors={"model.norm.weight:indices": torch.tensor([-1, 3], dtype=torch.int32)}),
        "index -1 of parameter 'model.norm.weight' is out of range (it has 4 elements)",
    ),
    "decreasing indices": (
        lambda: rebuild(_raw(), tensors={"model.norm.weight:indices": torch.tensor([3, 1], dtype=torch.int32)}),
        "indices of parameter 'model.norm.weight' are not strictly increasing",
    ),
    "repeated index": (
        lambda: rebuild(_raw(), tensors={"model.norm.weight:indices": torch.tensor([1, 1], dtype=torch.int32)}),
        "indices of parameter 'model.norm.weight' are not strictly increasing",
    ),
    "unknown parameter (raw)": (
        lambda: _rename(_raw(), "model.norm.weight", "model.gone.weight"),
        "unknown parameter 'model.gone.weight' (not in the receiver's state)",
    ),
    "values without indices": (
        lambda: rebuild(_raw(), drop=("model.norm.weight:indices",)),
        "parameter 'model.norm.weight' has values but no indices",
    ),
    "indices without values": (
        lambda: rebuild(_raw(), drop=("model.norm.weight:values",)),
        "parameter 'model.norm.weight' has indices but no values",
    ),
    "extra tensor (raw)": (
        lambda: rebuild(_raw(), tensors={"junk": torch.zeros(1)}),
        "unexpected tensor 'junk' in a raw delta",
    ),
    "changed count mismatch (raw)": (
        lambda: rebuild(_raw(), meta={"changed": "7"}),
        "holds 2 parameters / 6 changed elements, its metadata says 2 / 7",
    ),
    "params count mismatch (raw)": (
        lambda: rebuild(_raw(), meta={"params": "3"}),
        "holds 2 parameters / 6 changed elements, its metadata says 3 / 6",
    ),
    # zstd tensors
    "no names (zstd)": (lambda: rebuild(_zstd(), meta={"names": None}), "a zstd delta needs the metadata key 'names'"),
    "extra tensor (zstd)": (
        lambda: rebuild(_zstd(), tensors={"junk": torch.zeros(1)}),
        "zstd delta has unexpected tensors ['junk'] / lacks []",
    ),
    "missing stream": (
        lambda: rebuild(_zstd(), drop=("zstd:sym",)),
        "zstd delta has unexpected tensors [] / lacks ['zstd:sym']",
    ),
    "unknown parameter (zstd)": (
        lambda: rebuild(_zstd(), meta={"names": '["model.gone.weight","model.norm.weight"]'}),
        "unknown parameter 'model.gone.weight' (not in the receiver's state)",
    ),
    "counts not int64": (
        lambda: rebuild(_zstd(), tensors={"zstd:counts": torch.tensor([4, 2], dtype=torch.int32)}),
        "'zstd:counts' must be int64 with one entry per name (2)",
    ),
    "counts shorter than names": (
        lambda: rebuild(_zstd(), tensors={"zstd:counts": torch.tensor([6])}),
        "'zstd:counts' must be int64 with one entry per name (2)",
    ),
    "counts disagree with changed": (
        lambda: rebuild(_zstd(), tensors={"zstd:counts": torch.tensor([3, 2])}),
        "counts add up to 5, metadata says 6 changed",
    ),
    "count over the parameter size": (
        lambda: rebuild(_zstd(), tensors={"zstd:counts": torch.tensor([7, 2])}),
        "parameter 'model.proj.weight' claims 7 changes (it has 6 elements)",
    ),
    "zero count": (
        lambda: rebuild(_zstd(), tensors={"zstd:counts": torch.tensor([6, 0])}),
        "parameter 'model.norm.weight' claims 0 changes (it has 4 elements)",
    ),
    "a name twice": (
        lambda: rebuild(_zstd(), meta={"names": '["model.norm.weight","model.norm.weight"]'}),
        "a parameter is listed twice in 'names'",
    ),
    "params count mismatch (zstd)": (
        lambda: rebuild(_zstd(), meta={"params": "3"}),
        "holds 2 parameters / 6 changed elements, its metadata says 3 / 6",
    ),
    "truncated zstd stream": (
        lambda: rebuild(_zstd(), tensors={"zstd:gap_lo": st_load(_zstd())["zstd:gap_lo"][:-1].clone()}),
        "stream 'gap_lo' is not valid zstd data",
    ),
    "stream not zstd at all": (
        lambda: _zstd_with(gap_lo=torch.tensor([0, 1, 0, 1, 1, 1], dtype=torch.uint8)),
        "stream 'gap_lo' is not valid zstd data",
    ),
    "stream of the wrong length": (
        lambda: _zstd_with(gap_lo=bytes(5)),
        "stream 'gap_lo' decodes to 5 bytes, expected 6",
    ),
    "stream not uint8": (
        lambda: _zstd_with(gap_lo=torch.zeros(3, dtype=torch.int8)),
        "stream 'gap_lo' must be a 1-D uint8 tensor",
    ),
    "stream that should be empty": (lambda: _zstd_with(gap_hi=b"\x01"), "stream 'gap_hi' should be empty"),
    "index past the end (zstd)": (
        lambda: _zstd_with(gap_lo=bytes([0, 1, 0, 1, 1, 2])),
        "index 4 of parameter 'model.norm.weight' is out of range (it has 4 elements)",
    ),
    "gap_big below 255": (lambda: _big_gap_file((7).to_bytes(8, "little")), "stream 'gap_big' holds a value outside 255..2**55-1"),
    "gap over 63 bits": (lambda: _big_gap_file((2**55).to_bytes(8, "little")), "stream 'gap_big' holds a value outside 255..2**55-1"),
    "escape with its own symbol": (
        lambda: _zstd_with(esc_lo=bytes([2, 0xFD])),
        "the escape streams hold a value that has its own symbol",
    ),
}


@pytest.mark.parametrize("case", list(BAD_DELTAS))
def test_malformed_delta_is_refused(case: str) -> None:
    make, message = BAD_DELTAS[case]
    with pytest.raises(FormatError) as info:
        decode(make())
    assert str(info.value).startswith(DELTA_WHERE + ": ")
    assert message in str(info.value)


BAD_ANCHORS = {
    "a delta where an anchor is expected": (_raw, "expected an anchor, found a delta"),
    "tensor not bf16": (
        lambda: rebuild(_anchor(), tensors={"model.norm.weight": torch.ones(4)}),
        "parameter 'model.norm.weight' is torch.float32, anchors hold bfloat16",
    ),
    "params mismatch": (
        lambda: rebuild(_anchor(), meta={"params": "3"}),
        "holds 2 parameters / 10 elements, its metadata says 3 / 10",
    ),
    "total mismatch": (
        lambda: rebuild(_anchor(), meta={"total": "11"}),
        "holds 2 parameters / 10 elements, its metadata says 2 / 11",
    ),
    "anchor names another anchor": (
        lambda: rebuild(_anchor(), meta={"anchor": "3"}),
        "anchor 0 must name itself as anchor and no base",
    ),
    "anchor with a base": (
        lambda: rebuild(_anchor(), meta={"base": "0"}),
        "anchor 0 must name itself as anchor and no base",
    ),
    "format_version 0": (
        lambda: rebuild(_anchor(), meta={"format_version": "0"}),
        "format_version '0' is not supported",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ANCHORS))
def test_malformed_anchor_is_refused(case: str) -> None:
    make, message = BAD_ANCHORS[case]
    with pytest.raises(FormatError) as info:
        F.decode_anchor(make(), where=ANCHOR_WHERE)
    assert str(info.value).startswith(ANCHOR_WHERE + ": ")
    assert message in str(info.value)


def _pointer(**changes: object) -> bytes:
    body = json.loads(POINTER_V1_TEXT)
    for key, value in changes.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return json.dumps(body).encode()


def _chain(k: int, **changes: object) -> list[dict]:
    chain = json.loads(POINTER_V1_TEXT)["chain"]
    chain[k].update(changes)
    return chain


def _pointer3(**changes: object) -> bytes:
    body = json.loads(POINTER_TEXT)
    for key, value in changes.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return json.dumps(body).encode()


def _entries3(key: str, k: int, **changes: object) -> list[dict]:
    items = json.loads(POINTER_TEXT)[key]
    items[k].update(changes)
    return items


BAD_POINTERS = {
    "not JSON": (lambda: b"{", "not a deltasync pointer (invalid JSON"),
    "not UTF-8": (lambda: b"\xff", "not a deltasync pointer (invalid JSON"),
    "a JSON list": (lambda: b"[]", "not a deltasync pointer (format is not 'deltasync')"),
    "no format": (lambda: _pointer(format=None), "not a deltasync pointer (format is not 'deltasync')"),
    "format_version 5": (
        lambda: _pointer(format_version=5),
        "format_version 5 is not supported (this deltasync reads 1, 2, 3, 4); upgrade deltasync",
    ),
    "format_version as a string": (lambda: _pointer(format_version="1"), "format_version '1' is not supported"),
    "missing total": (lambda: _pointer(total=None), "malformed pointer (KeyError('total'))"),
    "chain entry without sha256": (
        lambda: _pointer(chain=[{k: v for k, v in e.items() if k != "sha256"} for e in _chain(0)]),
        "malformed pointer (KeyError('sha256'))",
    ),
    "a gap in the chain": (
        lambda: _pointer(version=2, chain=[_chain(0)[0], _chain(1, version=2)[1]]),
        "the chain must list versions 0..2 in order, got [0, 2]",
    ),
    "chain out of order": (
        lambda: _pointer(chain=list(reversed(_chain(0)))),
        "the chain must list versions 0..1 in order, got [1, 0]",
    ),
    "chain missing its anchor": (
        lambda: _pointer(chain=_chain(0)[1:]),
        "the chain must list versions 0..1 in order, got [1]",
    ),
    "a delta listed as an anchor": (
        lambda: _pointer(chain=_chain(1, kind="anchor")),
        "version 1 should be a delta, not 'anchor'",
    ),
    "an anchor listed as a delta": (
        lambda: _pointer(chain=_chain(0, kind="delta")),
        "version 0 should be an anchor, not 'delta'",
    ),
    "a path outside the layout": (
        lambda: _pointer(chain=_chain(1, path="../secrets")),
        "version 1 names an invalid path '../secrets'",
    ),
    "a delta under anchors/": (
        lambda: _pointer(chain=_chain(1, path="anchors/00000001.safetensors")),
        "version 1 names an invalid path 'anchors/00000001.safetensors'",
    ),
    "fingerprint disagrees with the chain": (
        lambda: _pointer(fingerprint=FP0),
        "the pointer's fingerprint disagrees with its last chain entry",
    ),
    # Format 3: anchors beside the deltas.
    "3: no anchors": (lambda: _pointer3(anchors=[]), "anchors must be a list of 1 to 1024 entries, got a list of 0"),
    "3: anchors not a list": (lambda: _pointer3(anchors={}), "anchors must be a list of 1 to 1024 entries, got dict"),
    "3: missing base": (lambda: _pointer3(base=None), "malformed pointer (KeyError('base'))"),
    "3: chain not after base": (lambda: _pointer3(base=1), "the chain must list versions 2..1 in order, got [1]"),
    "3: an anchor past the version": (
        lambda: _pointer3(anchors=_entries3("anchors", 0, version=2, path="anchors/00000002.safetensors"), anchor=2),
        "anchors must be distinct ascending versions within 0..1, got [2]",
    ),
    "3: anchor is not the newest": (lambda: _pointer3(anchor=1), "anchor 1 is not the newest of its anchors (0)"),
    "3: a delta in anchors/": (
        lambda: _pointer3(chain=_entries3("chain", 0, path="anchors/00000001.safetensors")),
        "version 1 names an invalid path 'anchors/00000001.safetensors'",
    ),
    "3: an anchor listed as a delta": (
        lambda: _pointer3(anchors=_entries3("anchors", 0, kind="delta")),
        "version 0 should be an anchor, not 'delta'",
    ),
    "3: an anchor whose fingerprint disagrees": (
        lambda: _pointer3(anchors=_entries3("anchors", 0, fingerprint=FP1)),
        "the anchor of version 0 disagrees with the chain's fingerprint",
    ),
    "3: base fingerprint disagrees": (
        lambda: _pointer3(
            base=1, chain=[], base_fingerprint=FP0, anchor=1,
            anchors=_entries3("anchors", 0, version=1, path="anchors/00000001.safetensors", fingerprint=FP0),
        ),
        "the pointer's fingerprint disagrees with its last chain entry",
    ),
    "3: root after base": (lambda: _pointer3(root=1), "root 1, base 0 and version 1 are out of order"),
}


@pytest.mark.parametrize("case", list(BAD_POINTERS))
def test_malformed_pointer_is_refused(case: str) -> None:
    make, message = BAD_POINTERS[case]
    where = f"{BUCKET}/latest.json"
    with pytest.raises(FormatError) as info:
        Pointer.from_bytes(make(), where=where)
    assert str(info.value).startswith(where + ": ")
    assert message in str(info.value)


def test_encoder_refuses_what_it_cannot_write() -> None:
    _state, changes = make_case({"w": 4}, {"w": [1]})
    with pytest.raises(FormatError, match="unknown codec 'lz4' \\(known: raw, zstd\\)"):
        F.encode_delta(changes, version=1, anchor=0, codec="lz4", total=4, fingerprint=FP1, base_fingerprint=FP0)
    no_old = {"w": F.Change(index=torch.tensor([1]), new=bf16([5]))}
    with pytest.raises(FormatError, match="parameter 'w': the zstd codec needs the previous values"):
        F.encode_delta(no_old, version=1, anchor=0, codec="zstd", total=4, fingerprint=FP1, base_fingerprint=FP0)
    with pytest.raises(FormatError, match="anchor 3: parameter 'w' is torch.float32, anchors hold bfloat16"):
        F.encode_anchor({"w": torch.zeros(2)}, version=3, fingerprint=FP0)


# --------------------------------------------------------------------------- a reader, end to end


def write_bucket(root: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)


def example_bucket(
    root: Path, *, codec: str = "raw", delta: bytes | None = None, entry: dict | None = None, pointer_format: int = 3
) -> None:
    """The worked example as a bucket, written from the format alone (no publisher), with a
    pointer of format 3 (what writers write) or 1 (an old bucket)."""
    files = example_files()
    data = files[codec] if delta is None else delta
    pointer = json.loads(POINTER_TEXT if pointer_format == 3 else POINTER_V1_TEXT)
    assert pointer["format_version"] == pointer_format
    item = pointer["chain"][-1]  # the delta of version 1
    item.update(nbytes=len(data), sha256=F.sha256_hex(data))
    item.update(entry or {})
    pointer.update(fingerprint=item["fingerprint"])
    write_bucket(
        root,
        {
            "anchors/00000000.safetensors": files["anchor"],
            "deltas/00000001.safetensors": data,
            "latest.json": json.dumps(pointer).encode(),
        },
    )


@pytest.mark.parametrize("pointer_format", [1, 3])
@pytest.mark.parametrize("codec", F.CODECS)
def test_a_bucket_written_from_the_document_is_readable(tmp_path: Path, codec: str, pointer_format: int) -> None:
    example_bucket(tmp_path, codec=codec, pointer_format=pointer_format)
    receiver = DeltaReceiver(tmp_path)
    assert receiver.sync(0) == 0
    assert receiver.fingerprint == FP0
    assert receiver.sync() == 1
    assert receiver.fingerprint == FP1
    state = receiver.state_dict()
    assert bits_of(state["model.proj.weight"]) == [0x3F01, 0xBE80, 0x8000, 0x0001, 0x4000, 0x4040]
    assert bits_of(state["model.norm.weight"]) == [0x3F80, 0x3F7F, 0x3F80, 0x3F7E]
    fresh = DeltaReceiver(tmp_path)
    assert fresh.sync() == 1 and fresh.fingerprint == FP1  # catch-up: the anchor, then the delta


def _tampered_delta(meta: dict) -> bytes:
    return rebuild(_raw(), meta=meta)


READER_FAILURES = {
    "bytes differ from the pointer's sha256": (
        dict(delta=_raw()[:-1] + b"\x41", entry={"sha256": F.sha256_hex(_raw())}),
        IntegrityError,
        "does not match the pointer's",
    ),
    "size differs from the pointer's": (dict(entry={"nbytes": 597}), IntegrityError, "596 bytes, the pointer says 597"),
    "values that do not give the fingerprint": (
        dict(delta=rebuild(_raw(), tensors={"model.norm.weight:values": bf16([0x3F7F, 0x3F7D])})),
        IntegrityError,
        "applying it gives fingerprint",
    ),
    "a base fingerprint of another state": (
        dict(delta=_tampered_delta({"base_fingerprint": "0123456789abcdef"})),
        IntegrityError,
        f"applies to a state with fingerprint 0123456789abcdef, but the state at version 0 has {FP0}",
    ),
    "file version differs from the pointer's": (
        dict(delta=_tampered_delta({"version": "2", "base": "1"})),
        VersionError,
        "the file is version 2, the pointer lists it as 1",
    ),
    "file descends from another anchor": (
        dict(delta=_tampered_delta({"anchor": "9"})),
        VersionError,
        "descends from anchor 9, the pointer's chain grew from 0",
    ),
    "file total differs from the pointer's": (
        dict(delta=_tampered_delta({"total": "11"})),
        FormatError,
        "says the state has 11 elements, the pointer says 10",
    ),
    "file fingerprint differs from the pointer's": (
        dict(delta=_tampered_delta({"fingerprint": "0123456789abcdef"})),
        IntegrityError,
        f"fingerprint 0123456789abcdef in the file, {FP1} in the pointer",
    ),
}


@pytest.mark.parametrize("pointer_format", [1, 3])
@pytest.mark.parametrize("case", list(READER_FAILURES))
def test_a_reader_refuses_and_keeps_its_state(tmp_path: Path, case: str, pointer_format: int) -> None:
    kwargs, error, message = READER_FAILURES[case]
    example_bucket(tmp_path, pointer_format=pointer_format, **kwargs)
    receiver = DeltaReceiver(tmp_path)
    receiver.sync(0)
    before = {name: bits_of(t) for name, t in receiver.state_dict().items()}
    with pytest.raises(error) as info:
        receiver.sync()
    assert isinstance(info.value, DeltaSyncError)
    assert "deltas/00000001.safetensors (version 1): " in str(info.value)
    assert message in str(info.value)
    assert (receiver.version, receiver.fingerprint) == (0, FP0)
    assert {name: bits_of(t) for name, t in receiver.state_dict().items()} == before


# --------------------------------------------------------------------------- known gaps in the core
# Each of these states what the format should do and fails today; see the report to the lead.


def test_zstd_encoder_handles_an_unchanged_element() -> None:
    old = bf16([0x3F80, 0x3F80])
    changes = {"w": F.Change(index=torch.tensor([0, 1]), new=bf16([0x3F80, 0x4000]), old=old)}
    try:
        data = F.encode_delta(
            changes, version=1, anchor=0, codec="zstd", total=2, fingerprint=FP1, base_fingerprint=FP0
        )
    except FormatError:
        return  # refusing is fine too
    _, decoded = decode(data, {"w": old})
    assert bits_of(decoded["w"].new) == [0x3F80, 0x4000]


def test_gap_big_that_wraps_is_refused() -> None:
    with pytest.raises(FormatError, match="gap"):
        decode(_big_gap_file((2**56).to_bytes(8, "little")))


def test_indices_that_overflow_are_a_format_error() -> None:
    data = rebuild(
        _big_gap_file((2**54).to_bytes(8, "little")),
        meta={"changed": "2", "params": "1"},
        tensors={"zstd:counts": torch.tensor([2], dtype=torch.int64)},
    )
    data = rebuild(
        data,
        tensors={
            "zstd:" + k: torch.frombuffer(
                bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(v)), dtype=torch.uint8
            )
            for k, v in {
                "gap_lo": b"\x00\x00",
                "gap_hi_mask": b"\x03",
                "gap_hi": b"\xff\xff",
                "gap_big": (2**54).to_bytes(8, "little") * 2,
                "sym": b"\x05",
            }.items()
        },
    )
    with pytest.raises(FormatError):
        decode(data)


def test_pointer_with_version_before_its_anchor_is_refused() -> None:
    with pytest.raises(FormatError):
        Pointer.from_bytes(_pointer(version=0, anchor=5, chain=[], fingerprint=FP0))


def test_raw_encoder_never_narrows_indices_silently() -> None:
    changes = {"w": F.Change(index=torch.tensor([2**31 + 5]), new=bf16([1]))}
    try:
        data = F.encode_delta(
            changes, version=1, anchor=0, codec="raw", total=2**32, fingerprint=FP1, base_fingerprint=FP0
        )
    except FormatError:
        return
    _, decoded = F.decode_delta(data, where="f", numels={"w": 2**32}, base_values=None)  # type: ignore[arg-type]
    assert decoded["w"].index.tolist() == [2**31 + 5]


if __name__ == "__main__":
    for name, text in render_examples().items():
        print(f"<!-- dump: {name} -->\n```text\n{text}\n```\n")
