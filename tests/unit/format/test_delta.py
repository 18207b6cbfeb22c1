"""Delta files (deltasync/format/delta.py) in every codec: round trips, no changes, indices past int32,
what the encoder refuses, and malformed deltas (header, container, tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from format_example import (
    DELTA_WHERE,
    bf16,
    bits_of,
    header_json,
    rebuild,
    apply,
    decode,
    make_case,
    CASES,
    encode,
    _raw,
    _zstd,
    _anchor,
    _zstd_with,
    _big_gap_file,
    _rename,
)
from format_golden import FP0, FP1

from deltasync import FormatError
from deltasync import format as F
from deltasync.format.codecs import zstd as Z
from deltasync.format.fingerprint import fingerprint


# --------------------------------------------------------------------------- round trips


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


def test_encoder_refuses_what_it_cannot_write() -> None:
    _state, changes = make_case({"w": 4}, {"w": [1]})
    with pytest.raises(FormatError, match="unknown codec 'lz4' \\(known: raw, zstd\\)"):
        F.encode_delta(changes, version=1, anchor=0, codec="lz4", total=4, fingerprint=FP1, base_fingerprint=FP0)
    no_old = {"w": F.Change(index=torch.tensor([1]), new=bf16([5]))}
    with pytest.raises(FormatError, match="parameter 'w': the zstd codec needs the previous values"):
        F.encode_delta(no_old, version=1, anchor=0, codec="zstd", total=4, fingerprint=FP1, base_fingerprint=FP0)
    with pytest.raises(FormatError, match="anchor 3: parameter 'w' is torch.float32, anchors hold bfloat16"):
        F.encode_anchor({"w": torch.zeros(2)}, version=3, fingerprint=FP0)


# --------------------------------------------------------------------------- malformed files


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
