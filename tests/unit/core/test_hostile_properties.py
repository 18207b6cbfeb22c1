"""Property-based tests of the read boundary (hypothesis), with a fixed example budget.

Whatever bytes a pointer, a file header, its metadata or a codec stream hold, a reader either
accepts them with checked values or refuses them with a ``DeltaSyncError``; and every bf16 bit
pattern survives both codecs and the receiver's replay exactly. ``scripts/fuzz.py`` runs the
same kind of mutations for as long as one likes; these run in CI, derandomized so that a
failure reproduces.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from helpers import old_pointer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load as st_load

from deltasync import DeltaSyncError, FormatError, Pointer
from deltasync import format as F
from deltasync.format.fingerprint import fingerprint, fingerprint_update
from deltasync.reader.chain import Patch

BUDGET = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
WHERE = "memory://p/deltas/00000001.safetensors (version 1)"
NUMEL = {"a": 40, "b": 7}

# Raw JSON text, hostile on purpose: huge and fractional numbers, constants JSON does not have,
# deep nesting, strings that look like integers.
json_scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.sampled_from(["Infinity", "-Infinity", "NaN", "1e999", "2.0", "-0", "true", "false", "null"]),
    st.integers(min_value=17, max_value=6000).map(lambda n: "9" * n),
    st.integers(min_value=4, max_value=20_000).map(lambda n: "[" * n + "]" * n),
    st.sampled_from(["+1", " 1", "1_0", "٣", "１", "01", "-1", "", "none", "0" * 16, "f" * 64]).map(json.dumps),
    st.text(max_size=20).map(json.dumps),
)
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]"), max_leaves=6
)


def bf16(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in bits], dtype=torch.int16).view(torch.bfloat16)


def u16(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFF for b in t.reshape(-1).view(torch.int16).tolist()]


def state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: torch.randn(n, generator=gen).to(torch.bfloat16) for name, n in NUMEL.items()}


def good_delta(codec: str) -> bytes:
    base = state()
    index = torch.tensor([1, 5, 39])
    changes = {"a": F.Change(index=index, new=bf16([0xFFFF, 0x8000, 0x7F80]), old=base["a"][index])}
    fp0 = fingerprint(base)
    fp1 = fingerprint_update(fp0, "a", index, base["a"][index], changes["a"].new)
    return F.encode_delta(changes, version=1, anchor=0, codec=codec, total=47, fingerprint=fp1, base_fingerprint=fp0)


GOOD = {codec: good_delta(codec) for codec in F.CODECS}


def decode(data: bytes) -> dict[str, F.Change]:
    base = state()
    _header, changes = F.decode_delta(data, where=WHERE, numels=NUMEL, base_values=lambda n, i: base[n][i])
    return changes


def check_decoded(changes: dict[str, F.Change]) -> None:
    """What a decoder returns is always in range, sorted and bf16 (the receiver then checks the fingerprint)."""
    for name, change in changes.items():
        index = change.index
        assert name in NUMEL and change.new.dtype == torch.bfloat16 and change.new.numel() == index.numel()
        assert index.numel() == 0 or (int(index[0]) >= 0 and int(index[-1]) < NUMEL[name])
        assert bool((index[1:] > index[:-1]).all())


def split(data: bytes) -> tuple[str, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + n].decode(), data[8 + n :]


def join(header: str, rest: bytes) -> bytes:
    raw = header.encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + rest


def json_paths(node, path=()):  # noqa: ANN001, ANN201
    if isinstance(node, dict):
        for key, value in node.items():
            yield (*path, key)
            yield from json_paths(value, (*path, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield (*path, i)
            yield from json_paths(value, (*path, i))


def with_value(text: str, choose: int, raw: str) -> str:
    """``text`` (JSON) with the value at the ``choose``-th path replaced by raw JSON text."""
    obj = json.loads(text)
    paths = list(json_paths(obj))
    path = paths[choose % len(paths)]
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = "@@MARK@@"
    return json.dumps(obj, separators=(",", ":")).replace('"@@MARK@@"', raw, 1)


POINTER = Pointer.from_chain(
    version=2,
    anchor=0,
    fingerprint="0123456789abcdef",
    total=47,
    chain=tuple(
        F.ChainEntry(version=v, kind="anchor" if v == 0 else "delta",
                     path=F.anchor_path(v) if v == 0 else F.delta_path(v), nbytes=100 + v,
                     sha256=f"{v:064x}", fingerprint="0123456789abcdef" if v == 2 else f"{v:016x}", changed=3)
        for v in range(3)
    ),
).to_bytes()  # fmt: skip
# What writers write (format 3), and the same chain as an old bucket's pointer (format 1).
POINTERS = {3: POINTER, 1: old_pointer(Pointer.from_bytes(POINTER), 1)}


# --------------------------------------------------------------------------- the pointer


@pytest.mark.parametrize("pointer_format", list(POINTERS))
@BUDGET
@given(choose=st.integers(min_value=0), raw=json_values)
def test_any_pointer_value_is_checked_or_refused(pointer_format: int, choose: int, raw: str) -> None:
    text = with_value(POINTERS[pointer_format].decode(), choose, raw)
    try:
        pointer = Pointer.from_bytes(text.encode())
    except DeltaSyncError:
        return
    numbers = (pointer.version, pointer.anchor, pointer.root, pointer.base, pointer.total)
    for value in (*numbers, *(e.nbytes for e in (*pointer.anchors, *pointer.chain))):
        assert type(value) is int and 0 <= value <= F.MAX_COUNT
    assert pointer.root <= pointer.base <= min(a.version for a in pointer.anchors) <= pointer.anchor <= pointer.version
    assert [e.version for e in pointer.chain] == list(range(pointer.base + 1, pointer.version + 1))


@pytest.mark.parametrize("pointer_format", list(POINTERS))
@BUDGET
@given(at=st.integers(min_value=0), insert=st.binary(max_size=64) | json_scalars.map(str.encode), cut=st.integers(0, 8))
def test_any_pointer_bytes_are_parsed_or_refused(pointer_format: int, at: int, insert: bytes, cut: int) -> None:
    text = POINTERS[pointer_format]
    at %= len(text) + 1
    data = text[:at] + insert + text[at + cut :]
    try:
        Pointer.from_bytes(data)
    except DeltaSyncError:
        pass


# --------------------------------------------------------------------------- headers and metadata


@BUDGET
@given(codec=st.sampled_from(F.CODECS), choose=st.integers(min_value=0), raw=json_values)
def test_any_header_value_is_checked_or_refused(codec: str, choose: int, raw: str) -> None:
    header, rest = split(GOOD[codec])
    try:
        changes = decode(join(with_value(header, choose, raw), rest))
    except DeltaSyncError:
        return
    check_decoded(changes)


INT_KEYS = ("version", "anchor", "params", "changed", "total", "base")


@BUDGET
@given(codec=st.sampled_from(F.CODECS), key=st.sampled_from(INT_KEYS), value=st.text(max_size=24) | json_scalars)
def test_metadata_integers_are_canonical_ascii_decimals(codec: str, key: str, value: str) -> None:
    header, rest = split(GOOD[codec])
    obj = json.loads(header)
    obj["__metadata__"][key] = value
    data = join(json.dumps(obj, separators=(",", ":")), rest)
    try:
        F.read_header(data, where=WHERE)
    except FormatError:
        return
    # Accepted: then it is exactly what the writer would have written for some integer.
    assert value.isascii() and value.isdigit() and str(int(value)) == value and len(value) <= 16


# --------------------------------------------------------------------------- codec streams


STREAM_KEYS = ("gap_lo", "gap_hi_mask", "gap_hi", "gap_big", "sym", "esc_lo", "esc_hi")


@BUDGET
@given(key=st.sampled_from(STREAM_KEYS), blob=st.binary(max_size=300), declared=st.none() | st.integers(0, 2**60))
def test_any_codec_stream_is_decoded_within_bounds_or_refused(key: str, blob: bytes, declared: int | None) -> None:
    if declared is not None:  # a real frame whose header claims any size
        frame = __import__("zstandard").ZstdCompressor(write_content_size=False).compress(blob)
        blob = frame[:4] + bytes([frame[4] | 0xC0]) + frame[5:6] + struct.pack("<Q", declared) + frame[6:]
    data = GOOD["zstd"]
    header = F.read_header(data, where=WHERE)
    tensors = st_load(data)
    tensors["zstd:" + key] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.zeros(0, dtype=torch.uint8)
    try:
        changes = decode(F.safetensors_bytes(tensors, header.to_metadata()))
    except DeltaSyncError:
        return
    check_decoded(changes)


@BUDGET
@given(counts=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), min_size=0, max_size=3))
def test_any_counts_are_checked(counts: list[int]) -> None:
    data = GOOD["zstd"]
    header = F.read_header(data, where=WHERE)
    tensors = st_load(data)
    tensors["zstd:counts"] = torch.tensor(counts, dtype=torch.int64)
    try:
        changes = decode(F.safetensors_bytes(tensors, header.to_metadata()))
    except DeltaSyncError:
        return
    check_decoded(changes)


# --------------------------------------------------------------------------- every bit pattern, exactly

bit_patterns = st.one_of(
    st.integers(0, 0xFFFF), st.sampled_from([0xFFFF, 0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x8000, 0x0000, 0x0001, 0x7F81])
)


@BUDGET
@given(
    codec=st.sampled_from(F.CODECS),
    edits=st.dictionaries(st.integers(0, NUMEL["a"] - 1), bit_patterns, min_size=1, max_size=NUMEL["a"]),
    start=st.lists(bit_patterns, min_size=NUMEL["a"], max_size=NUMEL["a"]),
)
def test_every_bit_pattern_round_trips_through_both_codecs(codec: str, edits: dict[int, int], start: list[int]) -> None:
    old = bf16(start)
    edits = {i: b for i, b in edits.items() if b != start[i]}
    if not edits:
        return
    index = torch.tensor(sorted(edits))
    new = bf16([edits[i] for i in sorted(edits)])
    data = F.encode_delta(
        {"a": F.Change(index=index, new=new, old=old[index])},
        version=1, anchor=0, codec=codec, total=NUMEL["a"], fingerprint="0" * 16, base_fingerprint="1" * 16,
    )  # fmt: skip
    _, changes = F.decode_delta(data, where=WHERE, numels={"a": NUMEL["a"]}, base_values=lambda n, i: old[i])
    assert torch.equal(changes["a"].index, index)
    assert u16(changes["a"].new) == u16(new)


@BUDGET
@given(
    steps=st.lists(
        st.dictionaries(st.integers(0, 63), bit_patterns, min_size=1, max_size=6), min_size=1, max_size=5
    ),
    probes=st.lists(st.integers(0, 63), min_size=1, max_size=8, unique=True),
)
def test_replay_merges_and_looks_up_exact_bit_patterns(steps: list[dict[int, int]], probes: list[int]) -> None:
    base = bf16([0x3F80] * 64)
    expected = u16(base)
    patch = Patch()
    for step in steps:
        index = torch.tensor(sorted(step))
        values = bf16([step[i] for i in sorted(step)])
        for i, bits in step.items():
            expected[i] = bits
        patch.merge(index, values.view(torch.int16))
    probe = torch.tensor(sorted(probes))
    assert u16(patch.lookup(base, probe)) == [expected[i] for i in sorted(probes)]
