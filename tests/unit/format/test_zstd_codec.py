"""The zstd codec (deltasync/format/codecs/zstd.py): golden streams and bytes, the documented stream
definitions, the ordered bit-pattern transform, and what its decoder refuses."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load as st_load

from format_example import (
    bf16,
    bits_of,
    rebuild,
    apply,
    decode,
    example_state,
    example_files,
    big_gap_changes,
    zstd_streams,
    ref_ordered,
    ref_from_ordered,
    ref_streams,
    make_case,
    random_bits,
    CASES,
    encode,
    _big_gap_file,
)
from format_golden import (
    ZSTD_GOLDEN_LIBZSTD,
    FP0,
    FP1,
    ZSTD_METADATA_TEXT,
    ZSTD_TENSOR_ORDER,
    ZSTD_COUNTS,
    ZSTD_STREAMS,
    ZSTD_DELTA_SHA256,
    BIG_GAP_STREAMS,
)

from deltasync import FormatError
from deltasync.format import Change
from deltasync import format as F
from deltasync.format.codecs import zstd as Z
from deltasync.format.fingerprint import fingerprint


# --------------------------------------------------------------------------- golden bytes


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


def test_a_delta_file_is_written_from_the_frames_as_zstandard_returned_them() -> None:
    """``delta_pieces`` (what the publisher writes) is ``encode_delta``'s file in pieces: the
    header, then each stream's frame where zstandard left it (no copy), then the counts."""
    _, changes = big_gap_changes()
    kw = dict(version=1, anchor=0, codec="zstd", total=70000, fingerprint=FP1, base_fingerprint=FP0)
    pieces = F.delta_pieces(changes, **kw)
    data = F.encode_delta(changes, **kw)
    assert b"".join(pieces) == data
    frames = [p for p in pieces if isinstance(p.obj, bytes) and bytes(p[:4]) == bytes.fromhex("28b52ffd")]
    assert len(frames) == len(Z.STREAMS)  # every stream of this example is non-empty
    tensors = st_load(data)
    # In the file's order (uint8 tensors by name), each frame is the stream's tensor, uncopied.
    assert [bytes(f) for f in frames] == [tensors[k].numpy().tobytes() for k in sorted(k for k in tensors if k != "zstd:counts")]
    blobs = Z.ZstdCodec().encode_blobs(list(changes.items()), numels=None, level=3)
    assert all(isinstance(blobs["zstd:" + key], bytes) for key in Z.STREAMS)
    assert {k: Z.ZstdCodec().encode(list(changes.items()), numels=None, level=3)[k].numpy().tobytes() for k in blobs} == {
        k: b if isinstance(b, bytes) else b.numpy().tobytes() for k, b in blobs.items()
    }


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


# --------------------------------------------------------------------------- the streams


@pytest.mark.parametrize("chunk", [8, 16, 24, 40])
@pytest.mark.parametrize("case", list(CASES))
def test_zstd_streams_are_the_same_when_transformed_in_chunks(case: str, chunk: int, monkeypatch) -> None:
    """The codec transforms a version's changes a bounded unit at a time (memory), a unit cut
    anywhere in a parameter and holding several; the streams, and so the file bytes, must not
    depend on the unit's size."""
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


@pytest.mark.parametrize("chunk", [8, 1 << 20])
@pytest.mark.parametrize("seed", range(12))
def test_zstd_streams_follow_the_documented_definitions(seed: int, chunk: int, monkeypatch) -> None:
    monkeypatch.setattr(Z, "ENCODE_CHUNK", chunk)
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


@pytest.mark.parametrize("chunk", [8, 16, 1 << 20])
def test_one_byte_codes_beside_bf16_values_in_one_unit_follow_the_definitions(chunk: int, monkeypatch) -> None:
    """A view's delta holds one-byte codes (fp8, int8: their bytes differenced as they are) and
    bf16 scales (ordered patterns) side by side; the encoder transforms a unit's values at once,
    whatever mix of them it holds, spans cut anywhere."""
    monkeypatch.setattr(Z, "ENCODE_CHUNK", chunk)
    rng = np.random.default_rng(5)
    changes: dict[str, Change] = {}
    items = []
    for k, (dtype, n) in enumerate([(torch.float8_e4m3fn, 13), (torch.bfloat16, 5), (torch.int8, 21), (torch.bfloat16, 30),
                                    (torch.float8_e4m3fn, 1), (torch.bfloat16, 2)]):  # fmt: skip
        index = sorted(rng.choice(1000, size=n, replace=False).tolist())
        if dtype == torch.bfloat16:
            old = random_bits(rng, n)
            new = [(b + int(rng.choice([1, -1, 2, 300]))) % 0x10000 for b in old]
            pair = (bf16(old), bf16(new))
        else:
            old = rng.integers(0, 256, size=n).tolist()
            new = [(b + int(rng.choice([1, -1, 2, 200]))) % 256 for b in old]
            pair = tuple(torch.tensor(v, dtype=torch.uint8).view(dtype) for v in (old, new))
        changes[f"p{k}"] = Change(index=torch.tensor(index), new=pair[1], old=pair[0])
        items.append((index, old, new, dtype != torch.bfloat16))
    streams, counts = Z.zstd_streams(list(changes.items()))
    assert streams == ref_streams(items)
    assert counts == [len(i) for i, *_ in items]


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
    flip = Z._flip16(every.view(torch.int16).numpy())
    assert flip.tolist() == [o - 0x10000 if o >= 0x8000 else o for o in (ref_ordered(b) for b in bits)]
    assert Z._flip16(flip).tolist() == every.view(torch.int16).tolist()
    for d in (1, -1, 2, -2, 3, -3, 0x7FFF, -0x8000):
        moved = bits_of(torch.from_numpy(Z._flip16(flip + np.int16(d))).view(torch.bfloat16))
        assert moved == [ref_from_ordered(ref_ordered(b) + d) for b in bits], d


@pytest.mark.parametrize("size", [0, 1, Z._FLIP_CHUNK, 3 * Z._FLIP_CHUNK + 5])
def test_the_flip_and_the_decodes_move_are_the_same_a_chunk_at_a_time(size: int) -> None:
    """:func:`_flip16` runs a cache-sized chunk at a time: over several chunks and a partial last
    one it is the involution of the whole array, in place or not, and with ``add`` it is the flip
    of (the flip + the differences), modulo 2**16."""
    rng = np.random.default_rng(size)
    bits = rng.integers(-0x8000, 0x8000, size=size, dtype=np.int16)
    diff = rng.integers(-0x8000, 0x8000, size=size, dtype=np.int16)
    want = bits ^ ((bits >> 15) & 0x7FFF)
    assert Z._flip16(bits).tolist() == want.tolist()
    moved = want + diff  # int16: wraps modulo 2**16
    assert Z._flip16(bits, add=diff).tolist() == (moved ^ ((moved >> 15) & 0x7FFF)).tolist()
    again = bits.copy()
    assert Z._flip16(again, out=again) is again and again.tolist() == want.tolist()


def test_a_byte_of_packed_symbols_stands_for_its_four_differences() -> None:
    """The decode's lookup of a packed byte: its four symbols, lowest bits first, each the
    difference it codes, and 0 (no symbol's difference) only for the escape."""
    table = Z._PACKED_DIFF.view(np.int16).reshape(256, 4)
    for byte in range(256):
        symbols = [(byte >> (2 * k)) & 3 for k in range(4)]
        assert table[byte].tolist() == [{0: -1, 1: 1, 2: -2, 3: 0}[s] for s in symbols], byte


def test_zstd_values_are_relative_to_the_receivers_state() -> None:
    data = example_files()["zstd"]
    shifted = {name: bf16([b + 1 for b in bits_of(t)]) for name, t in example_state().items()}
    _, decoded = decode(data, shifted)
    assert bits_of(decoded["model.norm.weight"].new) == [0x3F80, 0x3F7F]  # each one pattern higher
    # ... which the fingerprint then catches: the result is not the state the file names.
    assert fingerprint(apply(shifted, decoded)) != FP1


def test_zstd_encoder_refuses_an_unchanged_element() -> None:
    """A zstd delta codes differences, and a zero difference has no symbol: the encoder names it."""
    old = bf16([0x3F80, 0x3F80])
    fine = F.Change(index=torch.tensor([0, 1]), new=bf16([0x3F81, 0x4000]), old=old)
    changes = {"a": fine, "w": F.Change(index=torch.tensor([0, 1]), new=bf16([0x4000, 0x3F80]), old=old), "z": fine}
    with pytest.raises(FormatError, match="parameter 'w': .*new value equals its old one"):
        F.encode_delta(changes, version=1, anchor=0, codec="zstd", total=2, fingerprint=FP1, base_fingerprint=FP0)


@pytest.mark.parametrize("new, old", [([1], [5, 6, 7]), ([1, 2, 3], [5, 6]), ([1, 2, 3, 4], [5, 6, 7])])
def test_zstd_encoder_refuses_values_that_do_not_match_the_indices(new, old) -> None:
    changes = {"w": F.Change(index=torch.tensor([0, 2, 4]), new=bf16(new), old=bf16(old))}
    with pytest.raises(FormatError, match=f"parameter 'w': 3 indices, {len(new)} new and {len(old)} old values"):
        F.encode_delta(changes, version=1, anchor=0, codec="zstd", total=9, fingerprint=FP1, base_fingerprint=FP0)


@pytest.mark.parametrize("chunk", [8, 1 << 20])
@pytest.mark.parametrize("index", [[0, 2, 2, 5], [0, 3, 1, 5], [-1, 2, 3, 5]], ids=["repeated", "decreasing", "negative"])
def test_zstd_encoder_refuses_indices_that_are_not_strictly_increasing(index, chunk, monkeypatch) -> None:
    """Gaps are coded as unsigned: an index out of order would be written as a huge gap. The
    encoder refuses it, also where it falls on a chunk's first element."""
    monkeypatch.setattr(Z, "ENCODE_CHUNK", chunk)
    # With units of 8, the 6 changes of "a" put the third of "w" first in the second unit.
    fine = F.Change(index=torch.arange(0, 12, 2), new=bf16([1, 2, 3, 4, 5, 6]), old=bf16([7, 8, 9, 10, 11, 12]))
    changes = {"a": fine, "w": F.Change(index=torch.tensor(index), new=bf16([1, 2, 3, 4]), old=bf16([5, 6, 7, 8])), "z": fine}
    with pytest.raises(FormatError, match="parameter 'w': .*strictly increasing"):
        F.encode_delta(changes, version=1, anchor=0, codec="zstd", total=9, fingerprint=FP1, base_fingerprint=FP0)


# --------------------------------------------------------------------------- malformed streams


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
