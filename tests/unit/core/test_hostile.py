"""Hostile and corrupt buckets: every input is a refusal or an exact result, never a crash.

Each class of attack found against the read boundary has its cases here: pointers, file
headers, metadata integers, zstd bombs, oversized objects, reshaped or extra tensors, NaN
bit patterns, publisher failures and the retention race. A refusal must be a
``DeltaSyncError`` naming the file and field, must leave the receiver exactly as it was, and
must cost at most a small constant over the legitimate size of what it claims to be.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import struct
import time
import uuid

import numpy as np
import pytest
import torch
import zstandard
from helpers import chain_manifest, replace_file
from safetensors.torch import load as st_load

from deltasync import (
    ConfigError,
    DeltaPublisher,
    DeltaReceiver,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    NotFoundError,
    Pointer,
    StoreError,
    fingerprint,
    open_store,
)
from deltasync import format as F
from deltasync.format.codecs import zstd as Z

MiB = 1 << 20
SHAPES = {"w": (8, 16), "b": (16,)}


# --------------------------------------------------------------------------- helpers


class Tiny(torch.nn.Module):
    """Two bf16 parameters, so tests can write exact bit patterns into them."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(SHAPES["w"], generator=gen).to(torch.bfloat16))
        self.b = torch.nn.Parameter(torch.randn(SHAPES["b"], generator=gen).to(torch.bfloat16))


def set_bits(model: Tiny, name: str, index: int, bits: int) -> None:
    with torch.no_grad():
        model.get_parameter(name).data.view(-1).view(torch.int16)[index] = bits - 0x10000 if bits >= 0x8000 else bits


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.int16)


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(bits_of(a[k]), bits_of(b[k])) for k in a)


def memory_bucket() -> str:
    return f"memory://hostile-{uuid.uuid4().hex}"


@dataclasses.dataclass
class Chain:
    """A bucket at version 2 (anchor 0, deltas 1 and 2), a live receiver at version 1."""

    store: object
    publisher: DeltaPublisher
    model: Tiny
    receiver: DeltaReceiver

    def snapshot(self) -> tuple:
        r = self.receiver
        return r.version, r.fingerprint, {k: v.clone() for k, v in r.state_dict().items()}

    def assert_unchanged(self, before: tuple) -> None:
        version, fp, state = before
        assert (self.receiver.version, self.receiver.fingerprint) == (version, fp)
        assert same_bits(self.receiver.state_dict(), state)
        assert self.receiver.verify()


def make_chain(tmp_path, codec: str = "zstd") -> Chain:
    model = Tiny()
    publisher = DeltaPublisher(tmp_path / "bucket", model, None, codec=codec, anchor_every=100, anchor_bytes_ratio=0)
    publisher.publish()
    set_bits(model, "w", 3, 0x3F80)
    publisher.publish()
    receiver = DeltaReceiver(tmp_path / "bucket")
    assert receiver.sync() == 1
    set_bits(model, "w", 5, 0x4000)
    set_bits(model, "b", 0, 0xBF80)
    publisher.publish()
    return Chain(open_store(tmp_path / "bucket"), publisher, model, receiver)


@pytest.fixture(params=["raw", "zstd"])
def chain(request, tmp_path) -> Chain:
    return make_chain(tmp_path, request.param)


@pytest.fixture
def zchain(tmp_path) -> Chain:
    return make_chain(tmp_path, "zstd")


def st_file(header: dict | bytes, data: bytes = b"") -> bytes:
    """A safetensors container with this header (a dict, or raw JSON bytes) and data section."""
    text = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def refused(chain: Chain, pattern: str, exc: type[DeltaSyncError] = FormatError) -> DeltaSyncError:
    before = chain.snapshot()
    with pytest.raises(DeltaSyncError) as info:
        chain.receiver.sync()
    assert isinstance(info.value, exc), repr(info.value)
    assert re.search(pattern, str(info.value)), str(info.value)
    chain.assert_unchanged(before)
    return info.value


def _hwm_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))


def peak_growth_mib(fn) -> float:
    """Peak resident memory while ``fn`` runs, above the resident memory before it (MiB)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak to the current resident size
    except OSError:
        pytest.skip("this kernel cannot reset the peak resident size")
    before = _hwm_kib()
    fn()
    return (_hwm_kib() - before) / 1024


# --------------------------------------------------------------------------- NaN and other bit patterns

PATTERNS = {
    "nan-0xffff": 0xFFFF,
    "nan-0x7fc1": 0x7FC1,
    "snan-0xff81": 0xFF81,
    "+inf": 0x7F80,
    "-inf": 0xFF80,
    "-0": 0x8000,
    "+0": 0x0000,
    "subnormal": 0x0001,
}


@pytest.mark.parametrize("codec", F.CODECS)
@pytest.mark.parametrize("first", ["nan-0xffff", "snan-0xff81", "-0"])
def test_every_bit_pattern_survives_detection_codecs_and_replay(codec, first) -> None:
    """A weight becomes NaN (or -0, ...), then changes again: live and replaying receivers stay exact."""
    model = Tiny()
    bucket = memory_bucket()
    publisher = DeltaPublisher(bucket, model, None, codec=codec, anchor_every=100, anchor_bytes_ratio=0)
    publisher.publish()
    live = DeltaReceiver(bucket)
    live.sync()
    steps = [
        [("w", 3, PATTERNS[first])],  # exactly one index changes: the scalar-fill case
        [("w", 3, PATTERNS["nan-0x7fc1"]), ("w", 4, PATTERNS[first])],
        [("w", 3, PATTERNS["+inf"]), ("b", 0, PATTERNS["nan-0xffff"])],
        [("w", 4, PATTERNS["-inf"]), ("b", 0, PATTERNS["snan-0xff81"]), ("w", 3, PATTERNS["subnormal"])],
    ]
    for step in steps:
        for name, index, bits in step:
            set_bits(model, name, index, bits)
        result = publisher.publish()
        assert result.kind == "delta" and result.changed == len(step)
        live.sync()
    expected = {name: p.detach() for name, p in model.named_parameters()}
    fresh = DeltaReceiver(bucket)  # replays all four deltas in one sync
    assert fresh.sync() == live.version == 4
    for receiver in (live, fresh):
        assert same_bits(receiver.state_dict(), expected)
        assert receiver.fingerprint == publisher.fingerprint == fingerprint(expected)
        assert receiver.verify()


def test_a_staged_update_hands_out_exact_bit_patterns() -> None:
    model = Tiny()
    bucket = memory_bucket()
    publisher = DeltaPublisher(bucket, model, None, anchor_every=100, anchor_bytes_ratio=0)
    publisher.publish()
    receiver = DeltaReceiver(bucket)
    receiver.sync()
    set_bits(model, "w", 7, 0xFFFF)
    publisher.publish()
    set_bits(model, "w", 8, 0xFF81)
    publisher.publish()
    staged = receiver.stage()
    assert torch.equal(bits_of(staged.tensor("w")), bits_of(model.w))


# --------------------------------------------------------------------------- the pointer


def pointer_with(store, key: str, raw: str) -> bytes:
    """The committed pointer with one top-level value replaced by raw JSON text."""
    body = json.loads(store.read_bytes(F.POINTER_PATH))
    body[key] = "@@"
    return json.dumps(body, indent=1).replace('"@@"', raw).encode()


POINTER_VALUES = {
    "Infinity": ("version", "Infinity", r"Infinity is not JSON"),
    "-Infinity": ("version", "-Infinity", r"-Infinity is not JSON"),
    "NaN": ("anchor", "NaN", r"NaN is not JSON"),
    "1e999": ("version", "1e999", r"fractional number \(1e999\)"),
    "2.0": ("version", "2.0", r"fractional number \(2.0\)"),
    "5000 digits": ("version", "9" * 5000, r"an integer of 5000 digits"),
    "10**30": ("version", str(10**30), r"an integer of 31 digits"),
    "10**9": ("version", str(10**9), r"the chain must list versions 1..1000000000 in order, got \[1, 2\]"),
    "negative": ("anchor", "-1", r"anchor must be an integer in 0..\d+, got -1"),
    "a string": ("version", '"2"', r"version must be an integer in 0\.\.\d+, got '2'"),
    "a bool": ("version", "true", r"version must be an integer in 0\.\.\d+, got True"),
    "chain not a list": ("chain", '{"0": 1}', r"chain must be a list, got dict"),
    "chain of ints": ("chain", "[1, 2]", r"chain\[0\] must be an object, got int"),
    "chain too long": ("chain", "[1, 2, 3]", r"the chain must list versions 1..2 in order, got \[None, None, None\]"),
    # Format 3's own fields.
    "base 10**9": ("base", str(10**9), r"the chain must list versions 1000000001..2 in order, got \[1, 2\]"),
    "negative base": ("base", "-1", r"base must be an integer in 0..\d+, got -1"),
    "root 10**30": ("root", str(10**30), r"an integer of 31 digits"),
    "root after base": ("root", "1", r"root 1, base 0 and version 2 are out of order"),
    "anchors of ints": ("anchors", "[1]", r"anchors\[0\] must be an object, got int"),
    "anchors not a list": ("anchors", '"anchors/00000000.safetensors"', r"anchors must be a list of 1 to 1024 entries, got str"),
    # Objects of real entries' size: a pointer of empty ones is refused before parsing (below).
    "anchors too many": ("anchors", "[" + ", ".join(['{"x": "' + "0" * 160 + '"}'] * 1025) + "]", r"anchors must be a list of 1 to 1024 entries, got a list of 1025"),
    "bad base fingerprint": ("base_fingerprint", '"0123456789ABCDEF"', r"base_fingerprint must be 16 lower-case hex digits"),
    "bad fingerprint": ("fingerprint", '"ABCDEF0123456789"', r"fingerprint must be 16 lower-case hex digits"),
}


@pytest.mark.parametrize("case", list(POINTER_VALUES))
def test_hostile_pointer_values_are_refused(zchain, case) -> None:
    key, raw, pattern = POINTER_VALUES[case]
    zchain.store.write_bytes(F.POINTER_PATH, pointer_with(zchain.store, key, raw))
    error = refused(zchain, pattern)
    assert "latest.json" in str(error)
    with pytest.raises(FormatError, match=pattern):  # a restarted publisher refuses it as well
        DeltaPublisher(zchain.store, Tiny(), None)


def test_a_huge_version_allocates_nothing(zchain) -> None:
    zchain.store.write_bytes(F.POINTER_PATH, pointer_with(zchain.store, "version", str(10**15)))
    growth = peak_growth_mib(lambda: refused(zchain, r"the chain must list versions"))
    assert growth < 16, f"refusing a 10**15 version grew memory by {growth:.0f} MiB"


POINTER_TEXTS = {
    # Padded: without the spaces, so many brackets in so few bytes are refused by counting first.
    "deep arrays": (b"[" * 1000 + b" " * 100_000, r"the pointer nests more than 8 levels deep"),
    "deep objects": (b'{"a":' * 500 + b"1" + b"}" * 500 + b" " * 50_000, r"nests more than 8 levels deep"),
    "dense deep arrays": (b"[" * 100_000, r"not a deltasync pointer \(100000 objects and arrays .* in 100000 bytes"),
    "not UTF-8": (b'{"format": "\xff"}', r"invalid JSON: .*can't decode"),
    "duplicate key": (b'{"format": "deltasync", "format": "deltasync"}', r"the key 'format' appears twice"),
    "too large": (b" " * (F.MAX_POINTER_BYTES + 1), r"more than the 33554432 a reader accepts"),
    "an array": (b"[1, 2]", r"not a deltasync pointer \(format is not 'deltasync'\)"),
}


@pytest.mark.parametrize("case", list(POINTER_TEXTS))
def test_hostile_pointer_texts_are_refused(zchain, case) -> None:
    text, pattern = POINTER_TEXTS[case]
    zchain.store.write_bytes(F.POINTER_PATH, text)
    refused(zchain, pattern)


# Values per entry: ``{field}`` is the entry's field in the pointer, ``{dir}`` its directory,
# ``{v}`` its version, ``{n}`` another version.
CHAIN_ENTRY_VALUES = {
    "sha256 not hex": ("sha256", "z" * 64, r"{field}\.sha256 must be 64 lower-case hex digits"),
    "nbytes 10**20": ("nbytes", 10**16 - 1, r"{field}\.nbytes must be an integer in 0\.\.\d+"),
    "path of another version": ("path", "{dir}/0000000{n}.safetensors", r"version {v} names an invalid path"),
    "unicode digits": ("path", "{dir}/٠٠٠٠٠٠٠{v}.safetensors", r"{field}\.path must be an ASCII string"),
    "kind not a string": ("kind", 7, r"{field}\.kind must be an ASCII string"),
    "a 5000-digit file name": ("path", "{dir}/" + "0" * 5000 + "{v}.safetensors", r"version {v} names an invalid path"),
}
# The delta of version 2, and the anchor of version 0 (a live receiver at 1 never reads it,
# but the pointer naming it is refused all the same).
ENTRIES = {"delta 2": ("chain", 1, "deltas", 2, 1), "anchor 0": ("anchors", 0, "anchors", 0, 1)}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("case", list(CHAIN_ENTRY_VALUES))
def test_hostile_chain_entries_are_refused(zchain, case, entry) -> None:
    key, value, pattern = CHAIN_ENTRY_VALUES[case]
    items, index, folder, version, other = ENTRIES[entry]
    names = dict(field=rf"{items}\[{index}\]", dir=folder, v=version, n=other)
    body = json.loads(zchain.store.read_bytes(F.POINTER_PATH))
    assert body["format_version"] == 4 and body[items][index]["version"] == version
    body[items][index][key] = value.format(**names) if isinstance(value, str) else value
    zchain.store.write_bytes(F.POINTER_PATH, json.dumps(body).encode())
    refused(zchain, pattern.format(**names))


# --------------------------------------------------------------------------- file headers and metadata


def rewrite_header(chain: Chain, version: int, edit) -> None:
    """Let ``edit`` change the parsed header of ``version``'s file; commit the result."""
    entry = Pointer.from_bytes(chain.store.read_bytes(F.POINTER_PATH)).entry(version)
    header, data = split(chain.store.read_bytes(entry.path))
    new = edit(header)
    replace_file(chain.store, version, st_file(header if new is None else new, data))


def first_tensor(header: dict) -> str:
    return next(k for k in sorted(header) if k != "__metadata__")


HEADER_EDITS = {
    "__metadata__ is a list": (lambda h: h.update(__metadata__=[1, 2]), r"__metadata__ is not an object of strings"),
    "__metadata__ holds a number": (lambda h: h["__metadata__"].update(version=2), r"__metadata__ is not an object of strings"),
    "deep JSON": (lambda h: json.dumps(h, separators=(",", ":")).encode()[:-1] + b',"x":' + b"[" * 5000 + b"]" * 5000 + b"}", r"the safetensors header nests more than 3 levels deep"),
    "huge offsets": (lambda h: json.dumps(h, separators=(",", ":")).encode().replace(b'"data_offsets":[0,', b'"data_offsets":[' + b"9" * 4400 + b",", 1), r"an integer of 4400 digits"),
    "2**63 dims": (lambda h: h[first_tensor(h)].update(shape=[0, 2**63, 2**63]), r"an integer of 19 digits"),
    "2**50 dims": (lambda h: h[first_tensor(h)].update(shape=[2**25, 2**25, 2]), r"claims more than \d+ elements"),
    "negative dim": (lambda h: h[first_tensor(h)].update(shape=[-1]), r"shape must be an integer in 0\.\.\d+, got -1"),
    "offsets past the end": (lambda h: h[first_tensor(h)].update(data_offsets=[0, 10**9]), r"data_offsets \[0, 1000000000\] do not fit"),
    "unknown dtype": (lambda h: h[first_tensor(h)].update(dtype="F8_E5M2"), r"unsupported dtype 'F8_E5M2'"),
    "tensor not an object": (lambda h: h.update(x=[1]), r"tensor 'x' must be an object"),
    "header not an object": (lambda h: b"[]", r"not a JSON object"),
}


@pytest.mark.parametrize("case", list(HEADER_EDITS))
def test_hostile_headers_are_refused(chain, case) -> None:
    edit, pattern = HEADER_EDITS[case]
    rewrite_header(chain, 2, edit)
    error = refused(chain, pattern)
    assert "deltas/00000002.safetensors (version 2)" in str(error)


METADATA_VALUES = {
    "+1": ("version", "+2"),
    "leading space": ("version", " 2"),
    "underscore": ("changed", "1_0"),
    "arabic digits": ("version", "٢"),
    "fullwidth digits": ("total", "１４４"),
    "leading zero": ("anchor", "00"),
    "negative": ("changed", "-1"),
    "17 digits": ("total", "1" * 17),
}


@pytest.mark.parametrize("case", list(METADATA_VALUES))
def test_metadata_integers_are_plain_ascii_decimals(chain, case) -> None:
    key, value = METADATA_VALUES[case]
    rewrite_header(chain, 2, lambda h: h["__metadata__"].update({key: value}))
    refused(chain, rf"invalid metadata \({key}={re.escape(repr(value))} is not a plain decimal integer")


@pytest.mark.parametrize("names", ["[" * 50_000, '["w", ["b"]]', '{"w": 1}', "[" + "1" * 5000 + "]"])
def test_hostile_zstd_names_are_refused(zchain, names) -> None:
    rewrite_header(zchain, 2, lambda h: h["__metadata__"].update(names=names))
    refused(zchain, r"metadata names|'names' is not a JSON list of strings")


def test_hostile_fingerprint_in_metadata_is_refused(chain) -> None:
    rewrite_header(chain, 2, lambda h: h["__metadata__"].update(fingerprint="x" * 16))
    refused(chain, r"metadata fingerprint must be 16 lower-case hex digits")


# --------------------------------------------------------------------------- zstd bombs


def declares(size: int) -> bytes:
    """A 26-byte zstd frame that holds 1000 zero bytes but declares ``size`` in its header."""
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1000))
    return frame[:4] + bytes([frame[4] | 0xC0]) + frame[5:6] + struct.pack("<Q", size) + frame[6:]


def rle_bomb(size: int, *, content_size: bool) -> bytes:
    """A real frame of ``size`` zero bytes (a few KB per GB)."""
    cobj = zstandard.ZstdCompressor(level=1, write_content_size=content_size).compressobj(size=size if content_size else -1)
    chunk = bytes(16 * MiB)
    out = [cobj.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join(out) + cobj.flush()


def replace_stream(chain: Chain, version: int, key: str, blob: bytes) -> None:
    entry = Pointer.from_bytes(chain.store.read_bytes(F.POINTER_PATH)).entry(version)
    data = chain.store.read_bytes(entry.path)
    header = F.read_header(data, where=entry.path)
    tensors = st_load(data)
    tensors["zstd:" + key] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    replace_file(chain.store, version, F.safetensors_bytes(tensors, header.to_metadata()))


BOMBS = {
    "declares 2**40 bytes": (lambda: declares(2**40), r"stream 'gap_lo' decodes to 1099511627776 bytes, expected 2"),
    "RLE frame of 512 MiB, declared": (lambda: rle_bomb(512 * MiB, content_size=True), r"decodes to 536870912 bytes, expected 2"),
    "RLE frame of 512 MiB, undeclared": (lambda: rle_bomb(512 * MiB, content_size=False), r"is not valid zstd data \(it decodes to more than 2 bytes"),
    "not zstd at all": (lambda: b"\x00" * 64, r"stream 'gap_lo' is not valid zstd data"),
}


@pytest.mark.parametrize("case", list(BOMBS))
def test_zstd_bombs_are_refused_within_bounded_memory(zchain, case) -> None:
    make, pattern = BOMBS[case]
    blob = make()
    assert len(blob) < 64 * 1024
    replace_stream(zchain, 2, "gap_lo", blob)
    growth = peak_growth_mib(lambda: refused(zchain, pattern))
    assert growth < 32, f"refusing a {len(blob)}-byte bomb grew memory by {growth:.0f} MiB"


def test_bounded_decompress_reads_one_byte_past_the_promise() -> None:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"abcdef" * 1000)
    assert Z.bounded_decompress(frame, 6000) == b"abcdef" * 1000
    assert len(Z.bounded_decompress(frame, 10)) == 11
    assert Z.bounded_decompress(frame, 7000) == b"abcdef" * 1000  # short: the caller refuses it
    # Any buffer is read in place (a stream's NumPy view, a memoryview), into one buffer.
    for source in (np.frombuffer(frame, dtype=np.uint8), memoryview(frame)):
        assert Z.bounded_decompress(source, 6000) == b"abcdef" * 1000


# --------------------------------------------------------------------------- oversized objects


def test_an_oversized_local_file_is_read_only_up_to_its_promised_size(zchain) -> None:
    path = zchain.store.root / "deltas" / "00000002.safetensors"
    nbytes = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(2 << 30)  # a sparse 2 GiB file where the pointer promises a few hundred bytes
    growth = peak_growth_mib(
        lambda: refused(zchain, rf"version 2\): more than {nbytes} bytes, the pointer says {nbytes}", IntegrityError)
    )
    assert growth < 32, f"refusing a 2 GiB file grew memory by {growth:.0f} MiB"


def test_an_oversized_object_store_file_is_read_only_up_to_its_promised_size() -> None:
    bucket = memory_bucket()
    model = Tiny()
    publisher = DeltaPublisher(bucket, model, None)
    publisher.publish()
    receiver = DeltaReceiver(bucket)
    store = open_store(bucket)
    nbytes = len(store.read_bytes("anchors/00000000.safetensors"))
    store.write_bytes("anchors/00000000.safetensors", bytes(64 * MiB))
    with pytest.raises(IntegrityError, match=rf"more than {nbytes} bytes, the pointer says {nbytes}"):
        receiver.sync()
    assert receiver.version is None and receiver.state_dict() == {}


def test_an_oversized_pointer_is_refused_without_reading_it_whole(zchain) -> None:
    path = zchain.store.root / "latest.json"
    with open(path, "r+b") as f:
        f.truncate(2 << 30)
    growth = peak_growth_mib(lambda: refused(zchain, r"latest.json: .* more than the 33554432 a reader accepts"))
    assert growth < 3 * F.MAX_POINTER_BYTES / MiB


@pytest.mark.parametrize("filling", [b"{}", b"[]", b"0", b'""'])
def test_a_pointer_filled_with_empty_values_is_refused_before_parsing(zchain, monkeypatch, filling) -> None:
    """A pointer at the size cap filled with the cheapest JSON values (three bytes apiece) is
    refused by counting, before any of them becomes a Python object: nothing is parsed, and the
    reader's peak memory grows by less than twice the file's size (the read, and a copy).
    Parsed, such a pointer cost 25 times its size (benchmarks/hostile_pointer.py)."""
    from deltasync.format import pointer as pointer_module

    head = b'{"format": "deltasync", "format_version": 2, "version": 1, "chain": ['
    count = (F.MAX_POINTER_BYTES - len(head) - 2) // (len(filling) + 1)
    data = head + b",".join([filling] * count) + b"]}"
    assert len(data) <= F.MAX_POINTER_BYTES
    (zchain.store.root / "latest.json").write_bytes(data)
    del data

    def never(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the pointer was parsed")

    monkeypatch.setattr(pointer_module, "parse_json", never)
    what = "commas" if filling in (b"0", b'""') else "objects and arrays"
    growth = peak_growth_mib(lambda: refused(zchain, rf"latest.json: not a deltasync pointer \(\d+ {re.escape(what)}.* in \d+ bytes, more than the \d+ a pointer of that size can hold"))
    assert growth < 2 * F.MAX_POINTER_BYTES / MiB


@pytest.mark.parametrize("indent", [1, None])
def test_a_long_honest_pointer_passes_the_counts(indent) -> None:
    """The counts before parsing leave room for real pointers: a long chain of multi-part
    versions with small numbers, written without whitespace too, parses."""
    def part(version: int, number: int) -> F.PartEntry:
        return F.PartEntry(path=f"deltas/{version:08d}.part{number}.safetensors", nbytes=1, sha256="a" * 64, changed=0)

    chain = tuple(F.ChainEntry(version=v, kind="delta", path="", nbytes=8, sha256="", fingerprint=f"{v:016x}",
                               changed=0, parts=tuple(part(v, p) for p in range(8))) for v in range(1, 401))  # fmt: skip
    anchor = F.ChainEntry(version=0, kind="anchor", path="anchors/00000000.safetensors", nbytes=1, sha256="a" * 64,
                          fingerprint=f"{0:016x}", changed=0)  # fmt: skip
    honest = Pointer(version=400, fingerprint=f"{400:016x}", total=1, root=0, base=0, base_fingerprint=f"{0:016x}",
                     anchors=(anchor,), chain=chain)  # fmt: skip
    data = honest.to_bytes()
    if indent is None:
        data = json.dumps(json.loads(data), separators=(",", ":")).encode()
    pointer = Pointer.from_bytes(data)
    assert pointer == honest


# --------------------------------------------------------------------------- shapes and names


def anchor_past_the_receiver(chain: Chain) -> int:
    """Publish two versions with an anchor beside each: the deltas kept then start at the
    first of them, past the live receiver's version 1, so its next sync must load the anchor
    of the second. Returns that version."""
    for _ in range(2):
        result = chain.publisher.publish(anchor=True)
        assert result.kind == "delta" and result.anchor_scheduled
        chain.publisher.flush()
    pointer = Pointer.from_bytes(chain.store.read_bytes(F.POINTER_PATH))
    assert [a.version for a in pointer.anchors] == [result.version] and pointer.base == result.version - 1
    assert not pointer.replays_from(chain.receiver.version, chain.receiver.fingerprint)
    return result.version


def forge_anchor(chain: Chain, edit, *, rewrite_manifest: bool) -> int:
    """Publish an honest anchor the receiver must load, then rewrite it with ``edit(state)``
    (same fingerprint) and the pointer to its size and SHA-256; with ``rewrite_manifest`` the
    file and the pointer also name the forged state's manifest, else the honest one."""
    version = anchor_past_the_receiver(chain)
    fp = chain.publisher.fingerprint
    state = {n: p.detach().clone() for n, p in chain.model.named_parameters()}
    state = edit(state)
    assert fingerprint(state) == fp  # the fingerprint hashes flat elements only
    manifest = F.tensors_manifest(state) if rewrite_manifest else chain_manifest(chain.store)
    assert manifest is not None and (manifest != chain_manifest(chain.store)) == rewrite_manifest
    data = F.encode_anchor(state, version=version, fingerprint=fp, manifest=manifest)
    replace_file(chain.store, version, data, kind="anchor", manifest=manifest)
    return version


ANCHOR_EDITS = {
    "reshaped": (lambda s: {**s, "w": s["w"].reshape(-1)}, r"parameter 'w' has shape \[128\], the receiver serves \[8, 16\]"),
    "transposed shape": (lambda s: {**s, "w": s["w"].reshape(16, 8)}, r"parameter 'w' has shape \[16, 8\]"),
    "extra 0-element tensor": (lambda s: {**s, "extra": torch.zeros(0, 3, dtype=torch.bfloat16)}, r"holds 1 unexpected parameter\(s\) \(e.g. 'extra'\)"),
}


@pytest.mark.parametrize("case", list(ANCHOR_EDITS))
def test_a_reshaped_or_extra_tensor_is_refused_by_every_receiver_through_the_manifest_digest(zchain, case) -> None:
    """The fingerprint hashes element bits only; the pointer's manifest digest binds names,
    shapes and dtypes: a forged anchor that keeps it is refused even by a receiver that was told
    nothing (a fresh one)."""
    edit, _ = ANCHOR_EDITS[case]
    version = forge_anchor(zchain, edit, rewrite_manifest=False)
    pattern = rf"anchors/{version:08d}.safetensors \(version {version}\): the anchor's parameters \(names, shapes, dtypes\) have manifest [0-9a-f]{{64}}, the pointer says"
    refused(zchain, pattern, IntegrityError)
    fresh = DeltaReceiver(zchain.store)
    with pytest.raises(IntegrityError, match=pattern):
        fresh.sync()
    assert fresh.version is None and fresh.state_dict() == {}


@pytest.mark.parametrize("case", list(ANCHOR_EDITS))
def test_a_reshaped_or_extra_tensor_is_refused_by_a_receiver_that_knows_the_model(zchain, case) -> None:
    """A forger who rewrites the manifest digest too (file and pointer) still meets the shapes a
    receiver serves (and a chain's files would all have to be rewritten)."""
    edit, pattern = ANCHOR_EDITS[case]
    assert zchain.receiver.manifest == SHAPES  # learned from the first anchor it loaded
    version = forge_anchor(zchain, edit, rewrite_manifest=True)
    refused(zchain, rf"anchors/{version:08d}.safetensors \(version {version}\): {pattern}")
    # A new receiver told what to serve refuses it too; one that is not takes the bucket's word.
    told = DeltaReceiver(zchain.store, expected={n: p.shape for n, p in zchain.model.named_parameters()})
    with pytest.raises(FormatError, match=pattern):
        told.sync()
    assert told.version is None and told.state_dict() == {}


@pytest.mark.parametrize("files", ["kept", "renamed"])
def test_a_pointer_with_another_manifest_is_refused_and_changes_nothing(zchain, files) -> None:
    """The pointer's manifest digest rewritten (alone, or with every file naming it too): the
    receiver's state has another manifest, and its anchor's tensors another still."""
    forged = "ab" * 32
    pointer = Pointer.from_bytes(zchain.store.read_bytes(F.POINTER_PATH))
    assert pointer.manifest == F.tensors_manifest(zchain.receiver.state_dict()) != forged
    if files == "renamed":  # an attacker who rewrites every file's metadata (and the pointer's SHA-256s)
        for entry in (*pointer.anchors, *pointer.chain):
            table, data = split(zchain.store.read_bytes(entry.path))
            table["__metadata__"]["manifest"] = forged
            replace_file(zchain.store, entry.version, st_file(table, data), kind=entry.kind)
        pattern = r"anchors/00000000.safetensors \(version 0\): the anchor's parameters \(names, shapes, dtypes\) have manifest"
    else:
        zchain.store.write_bytes(F.POINTER_PATH, dataclasses.replace(pointer, manifest=forged).to_bytes())
        pattern = rf"anchors/00000000.safetensors \(version 0\): manifest {pointer.manifest} in the file, {forged} in the pointer"
    if files == "renamed":
        zchain.store.write_bytes(
            F.POINTER_PATH,
            dataclasses.replace(Pointer.from_bytes(zchain.store.read_bytes(F.POINTER_PATH)), manifest=forged).to_bytes(),
        )
    # Replaying on its own state is refused first (its manifest is not the pointer's); the
    # rebuild from the anchor that follows is refused by the anchor's checks.
    refused(zchain, pattern, IntegrityError)


def test_an_expected_manifest_must_be_names_and_shapes(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"expected: 'w' -> \(8, -1\) is not a parameter name -> shape"):
        DeltaReceiver(tmp_path, expected={"w": (8, -1)})


def test_a_missing_parameter_is_refused(zchain) -> None:
    """Dropping a parameter changes the fingerprint too; the manifest names what is missing first."""
    version = anchor_past_the_receiver(zchain)
    state = {n: p.detach().clone() for n, p in zchain.model.named_parameters() if n != "b"}
    replace_file(zchain.store, version, F.encode_anchor(state, version=version, fingerprint=fingerprint(state)), kind="anchor")
    refused(zchain, r"lacks 1 expected parameter\(s\) \(e.g. 'b'\)|fingerprint", DeltaSyncError)


# --------------------------------------------------------------------------- the publisher


class FlakyStore:
    """A store that fails the operations it is told to fail (once each)."""

    def __init__(self, inner, *, fail_delete: bool = False, fail_write: tuple[str, ...] = ()) -> None:
        self.inner = inner
        self.url = inner.url
        self.fail_delete = fail_delete
        self.fail_write = list(fail_write)

    def read_bytes(self, path, limit=None):
        return self.inner.read_bytes(path, limit=limit)

    def write_bytes(self, path, data):
        if path in self.fail_write:
            self.fail_write.remove(path)
            raise StoreError(f"cannot write {path!r}: the disk says no")
        self.inner.write_bytes(path, data)

    def exists(self, path):
        return self.inner.exists(path)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, paths):
        if self.fail_delete:
            raise StoreError("cannot delete: permission denied")
        self.inner.delete(paths)


def test_a_retention_failure_after_the_commit_is_reported_not_raised(tmp_path, caplog) -> None:
    store = FlakyStore(open_store(tmp_path), fail_delete=True)
    model = Tiny()
    publisher = DeltaPublisher(store, model, None, anchor_every=100, anchor_bytes_ratio=0)
    publisher.publish()
    set_bits(model, "w", 0, 0x4000)
    warning = "retention after the anchor of version 1 failed, old files are left: cannot delete: permission denied"
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        result = publisher.publish(anchor=True)  # anchor 1 beside delta 1 retires anchor 0
        assert result.version == 1 and result.kind == "delta" and result.anchor_scheduled
        assert publisher.flush() == [warning]  # the background anchor's warning, once it ended
    assert warning in caplog.text
    assert [a.version for a in publisher.pointer.anchors] == [1]  # committed all the same
    assert (tmp_path / "anchors/00000000.safetensors").exists()  # left behind
    set_bits(model, "w", 1, 0x4000)
    later = publisher.publish()  # and the next result carries it
    assert later.version == 2 and later.warnings == (warning,)
    set_bits(model, "w", 2, 0x4000)
    assert publisher.publish(anchor=True).anchor_scheduled  # anchor 3 cannot retire anchor 0 either
    while not publisher._anchor_inflight.done():  # its warning exists once it is done
        time.sleep(0.01)
    set_bits(model, "w", 3, 0x4000)
    later = publisher.publish()  # without a flush, the warning comes with the next result
    assert later.version == 4 and later.warnings == (warning.replace("version 1", "version 3"),)
    receiver = DeltaReceiver(tmp_path)
    assert receiver.sync() == 4 and receiver.fingerprint == later.fingerprint
    assert "warnings" not in json.loads((tmp_path / "history.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("failing", ["deltas/00000001.safetensors", "history.jsonl", "latest.json"])
def test_a_failed_publish_commits_nothing_and_the_next_one_carries_its_changes(tmp_path, failing) -> None:
    store = FlakyStore(open_store(tmp_path))
    model = Tiny()
    publisher = DeltaPublisher(store, model, None, anchor_bytes_ratio=0)
    publisher.publish()
    store.fail_write.append(failing)
    pointer = (tmp_path / "latest.json").read_bytes()
    set_bits(model, "w", 0, 0xFFFF)
    with pytest.raises(StoreError, match="the disk says no"):
        publisher.publish()
    assert (tmp_path / "latest.json").read_bytes() == pointer and publisher.version == 0
    set_bits(model, "w", 1, 0x8000)
    result = publisher.publish()
    assert (result.version, result.changed) == (1, 2)
    receiver = DeltaReceiver(tmp_path)
    assert receiver.sync() == 1
    assert same_bits(receiver.state_dict(), {n: p.detach() for n, p in model.named_parameters()})


def test_corrupt_history_lines_are_skipped_with_a_warning(tmp_path, caplog) -> None:
    model = Tiny()
    DeltaPublisher(tmp_path, model, None).publish()
    good = (tmp_path / "history.jsonl").read_text().strip()
    bad = ["Infinity", '{"version": 1e999}', "[" * 100_000, '{"version": "0"}', '{"version": ' + "9" * 5000 + "}", "\xff"]
    (tmp_path / "history.jsonl").write_text("\n".join([*bad, good]) + "\n")
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        publisher = DeltaPublisher(tmp_path, model, None)
    assert list(publisher._history) == [0]
    assert caplog.text.count("skipping a corrupt history line") == len(bad)
    assert publisher.publish().version == 1


def test_retention_deletes_only_the_names_it_writes(tmp_path) -> None:
    model = Tiny()
    publisher = DeltaPublisher(tmp_path, model, None, anchor_every=2, anchor_bytes_ratio=0)
    publisher.publish()
    for i in range(3):  # anchors beside versions 2 (and 4, below)
        set_bits(model, "w", i, 0x4000)
        publisher.publish()
        publisher.flush()
    foreign = [
        "anchors/00000000.safetensors.bak",
        "anchors/00000000.safetensors~",
        "anchors/notes.txt",
        "deltas/sub/00000000.safetensors",
        "deltas/00000001.safetensors.orig",
        "anchors/0.safetensors",
        "deltas/" + "0" * 200 + "1.safetensors",  # as long as a file name may be
    ]
    for name in foreign:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"not ours")
    set_bits(model, "w", 3, 0x4000)
    result = publisher.publish()
    assert result.version == 4 and result.anchor_scheduled
    publisher.flush()  # anchor 4 commits: retention retires anchors 0 and 2 and deltas 1 and 2
    assert (publisher.pointer.base, [a.version for a in publisher.pointer.anchors]) == (2, [4])
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    kept = ["anchors/00000004.safetensors", "deltas/00000003.safetensors", "deltas/00000004.safetensors"]
    # (and the lock files of the pointer's and the claim's conditional writes, hidden from listings)
    assert left == sorted([*foreign, *kept, "history.jsonl", "latest.json", ".latest.json.lock", ".writer.json.lock"])


def test_stale_temporary_files_of_killed_writes_are_cleaned(tmp_path) -> None:
    model = Tiny()
    DeltaPublisher(tmp_path, model, None).publish()
    stale = tmp_path / "deltas" / ".00000001.safetensors.4242.0123456789ab.tmp"
    fresh = tmp_path / "deltas" / ".00000002.safetensors.4243.0123456789ab.tmp"
    lookalike = tmp_path / "deltas" / ".notes.tmp"
    for path in (stale, fresh, lookalike):
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"half a file")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    os.utime(lookalike, (old, old))
    DeltaPublisher(tmp_path, model, None)  # a restarted trainer cleans up
    assert not stale.exists() and fresh.exists() and lookalike.exists()


# --------------------------------------------------------------------------- the retention race


class RacingStore:
    """Each of the first ``races`` data-file reads lets the trainer publish two more versions first.

    With an anchor every two versions and one anchor kept, each race retires the anchor the
    reader's pointer names: a reader must start over from the newest pointer every time.
    """

    def __init__(self, inner, race, races: int) -> None:
        self.inner, self.url, self.race, self.races = inner, inner.url, race, races

    def read_bytes(self, path, limit=None):
        if path != F.POINTER_PATH and self.races > 0:
            self.races -= 1
            self.race()
        return self.inner.read_bytes(path, limit=limit)

    def write_bytes(self, path, data):
        self.inner.write_bytes(path, data)

    def exists(self, path):
        return self.inner.exists(path)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, paths):
        self.inner.delete(paths)


@pytest.mark.parametrize(("races", "succeeds"), [(3, True), (8, False)])
def test_a_slow_reader_retries_from_the_newest_pointer_within_a_bound(tmp_path, races, succeeds) -> None:
    model = Tiny()
    publisher = DeltaPublisher(tmp_path, model, None, anchor_every=2, anchor_bytes_ratio=0, keep_anchors=1)
    publisher.publish()
    step = iter(range(1000))

    def race() -> None:
        for _ in range(2):
            set_bits(model, "w", next(step), 0x4000)
            publisher.publish()
            publisher.flush()  # the anchor beside the second commits, and retention runs

    receiver = DeltaReceiver(RacingStore(open_store(tmp_path), race, races))
    if succeeds:
        assert receiver.sync() == publisher.version == 2 * races
        assert receiver.fingerprint == publisher.fingerprint and receiver.verify()
    else:
        with pytest.raises(NotFoundError):
            receiver.sync()
        assert receiver.version is None and receiver.state_dict() == {}


def test_a_pointer_promising_a_petabyte_allocates_nothing(zchain) -> None:
    body = json.loads(zchain.store.read_bytes(F.POINTER_PATH))
    body["chain"][1]["nbytes"] = 10**15
    zchain.store.write_bytes(F.POINTER_PATH, json.dumps(body).encode())
    growth = peak_growth_mib(lambda: refused(zchain, r"version 2\): \d+ bytes, the pointer says 1000000000000000", IntegrityError))
    assert growth < 16


def test_a_custom_store_without_bounded_reads_still_works(tmp_path) -> None:
    """Stores written before ``read_bytes(path, limit)`` existed are read whole, as before."""
    inner = open_store(tmp_path)

    class OldStore:
        url = inner.url

        def read_bytes(self, path):  # noqa: ANN001, ANN202
            return inner.read_bytes(path)

        def write_bytes(self, path, data):  # noqa: ANN001, ANN202
            inner.write_bytes(path, data)

        def exists(self, path):  # noqa: ANN001, ANN202
            return inner.exists(path)

        def list(self, prefix=""):  # noqa: ANN001, ANN202
            return inner.list(prefix)

        def delete(self, paths):  # noqa: ANN001, ANN202
            inner.delete(paths)

    model = Tiny()
    publisher = DeltaPublisher(OldStore(), model, None)
    publisher.publish()
    receiver = DeltaReceiver(OldStore())
    assert receiver.sync() == 0 and receiver.fingerprint == publisher.fingerprint


def test_a_pointer_claiming_another_model_size_is_refused_before_any_download(zchain) -> None:
    body = json.loads(zchain.store.read_bytes(F.POINTER_PATH))
    body["total"] = 10**12
    zchain.store.write_bytes(F.POINTER_PATH, json.dumps(body).encode())
    zchain.store.delete([e["path"] for e in body["chain"]])  # nothing is read: a missing file would say so
    refused(zchain, r"latest.json: the bucket's state has 1000000000000 elements, the receiver serves 144")
