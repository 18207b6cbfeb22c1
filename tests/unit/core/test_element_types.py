"""The one table of element types (deltasync.format.dtypes): what each type is, how its values
move as lanes, how the fingerprint hashes them, and that no other module lists them."""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest
import torch

from deltasync.errors import FormatError
from deltasync.format.container import safetensors_bytes
from deltasync.format.dtypes import (
    ELEMENT_DTYPES,
    ELEMENT_TYPES,
    ElementType,
    dtype_code,
    dtype_from_code,
    element_type,
    find_element_type,
    from_lanes,
    holds_byte_lanes,
    is_one_byte,
    lane_bits,
    lanes,
    one_byte_dtypes,
    read_lanes,
    write_lanes,
)
from deltasync.format.fingerprint import DeviceHasher, fingerprint, fingerprint_share
from deltasync.views import check_codes

REPO = Path(__file__).resolve().parents[3]


def _every_pattern(kind: ElementType) -> torch.Tensor:
    """Every bit pattern of ``kind`` once, as elements of its dtype."""
    if kind.one_byte:
        return torch.arange(256, dtype=torch.int16).to(torch.uint8).view(kind.dtype)
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(kind.dtype)


def test_the_table_is_bf16_and_the_one_byte_code_types() -> None:
    assert [(t.dtype, t.code, t.lane_bits) for t in ELEMENT_TYPES] == [
        (torch.bfloat16, "BF16", 16),
        (torch.float8_e4m3fn, "F8_E4M3", 8),
        (torch.int8, "I8", 8),
    ]
    # Everything else is derived from it.
    assert {t.dtype: t.code for t in ELEMENT_TYPES} == ELEMENT_DTYPES
    assert one_byte_dtypes() == (torch.float8_e4m3fn, torch.int8)
    assert [is_one_byte(d) for d in (torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8, torch.float32)] == [
        False, True, True, False, False,
    ]  # fmt: skip
    assert [holds_byte_lanes(d) for d in (torch.float8_e4m3fn, torch.int8, torch.uint8, torch.bfloat16)] == [
        True, True, True, False,
    ]  # fmt: skip
    for kind in ELEMENT_TYPES:
        assert element_type(kind.dtype) is kind is find_element_type(kind.dtype)
        assert dtype_code(kind.dtype) == kind.code and dtype_from_code(kind.code, where="x") == kind.dtype
        assert lane_bits(kind.dtype) == kind.lane_bits
    assert find_element_type(torch.float32) is None
    with pytest.raises(FormatError, match=r"dtype torch.float32 cannot be held by a chain \(it holds BF16, F8_E4M3, I8\)"):
        element_type(torch.float32)
    with pytest.raises(FormatError, match=r"here: dtype 'F32' is not one a chain holds \(BF16, F8_E4M3, I8\)"):
        dtype_from_code("F32", where="here")


def test_each_type_is_written_to_files_under_its_code() -> None:
    """A file's header names an element by the table's code (the safetensors container agrees)."""
    for kind in ELEMENT_TYPES:
        data = safetensors_bytes({"t": _every_pattern(kind)[:4]}, {})
        (size,) = struct.unpack("<Q", data[:8])
        assert json.loads(data[8 : 8 + size])["t"]["dtype"] == kind.code


@pytest.mark.parametrize("kind", ELEMENT_TYPES, ids=lambda k: k.code)
def test_every_bit_pattern_moves_through_its_lanes_exactly(kind: ElementType) -> None:
    values = _every_pattern(kind)
    lane = lanes(values)
    assert lane.dtype == torch.int16
    # A lane is the bit pattern zero-extended: 16 bits, or the byte in the low 8 bits.
    want = values.view(kind.raw).to(torch.int32) & ((1 << kind.lane_bits) - 1)
    assert torch.equal(lane.to(torch.int32) & 0xFFFF, want)
    back = from_lanes(lane, kind.dtype)
    assert back.dtype == kind.dtype and torch.equal(back.view(kind.raw), values.view(kind.raw))
    # Written into and read from a flat tensor of the type, at any index, as bits.
    index = torch.randperm(values.numel(), generator=torch.Generator().manual_seed(0))
    flat = torch.zeros(values.numel(), dtype=kind.dtype)
    write_lanes(flat, index, lane)
    assert torch.equal(flat[index].view(kind.raw), values.view(kind.raw))
    assert torch.equal(read_lanes(flat, index), lane)
    if kind.one_byte:  # a lane that does not fit the byte is refused, naming the code
        with pytest.raises(FormatError, match=rf"codes: value bits 0x0100 do not fit the 8 bits of {kind.code}"):
            from_lanes(torch.tensor([1, 256], dtype=torch.int16), kind.dtype, what="codes")


@pytest.mark.parametrize("kind", ELEMENT_TYPES, ids=lambda k: k.code)
def test_the_fingerprint_hashes_an_element_as_its_lane(kind: ElementType) -> None:
    """One element hashes as the bf16 whose bits are its lane; on the host and on a device
    (the device hasher, here on the CPU) alike, and a one-byte type's raw bytes as its elements."""
    values = _every_pattern(kind)
    as_lanes = lanes(values).view(torch.bfloat16)
    assert fingerprint({"t": values}) == fingerprint({"t": as_lanes})
    index = torch.arange(values.numel())
    hasher = DeviceHasher(torch.device("cpu"), chunk=1000)
    hasher.add("t", index, values)
    assert hasher.value() == fingerprint_share("t", index, values) == fingerprint_share("t", index, as_lanes)
    if kind.one_byte:
        raw = values.view(kind.raw)
        assert fingerprint({"t": raw}) == fingerprint({"t": values})


def test_a_views_codes_are_checked_by_their_types_nan_bits() -> None:
    for kind in ELEMENT_TYPES:
        if not kind.one_byte:
            with pytest.raises(FormatError, match=r"w: codes are torch.bfloat16; a view's codes are float8_e4m3fn or int8"):
                check_codes("w", _every_pattern(kind))
            continue
        values = _every_pattern(kind)
        bits = values.view(torch.uint8).to(torch.int32)
        nan = torch.zeros(256, dtype=torch.bool) if kind.nan_bits is None else (bits & kind.nan_bits) == kind.nan_bits
        assert int(nan.sum()) == (0 if kind.dtype == torch.int8 else 2)  # e4m3fn: 0x7F and 0xFF
        assert bool(torch.isnan(values.float())[nan].all()) and not bool(torch.isnan(values.float())[~nan].any())
        check_codes("w", values[~nan])
        for at in nan.nonzero().reshape(-1).tolist():
            with pytest.raises(FormatError, match=rf"w: {kind.label} code at flat index {at} is NaN \(0x{at:02X}\)"):
                check_codes("w", values)
            values = values.clone()
            values.view(torch.uint8)[at] = 0


_TABLE_HOLDERS = {
    Path("deltasync/format/dtypes.py"),  # the table
    Path("deltasync/format/container.py"),  # safetensors' own dtype codes (the file format's)
}
_SCHEMES = Path("deltasync/views/schemes")


def test_no_module_lists_the_code_types_but_the_table() -> None:
    """Only the table names the one-byte code dtypes; a scheme module names its own codes' dtype
    (one each), and nothing else in deltasync or vllm_ext does."""
    names = {str(d).removeprefix("torch.") for d in one_byte_dtypes()}
    found = []
    for package in ("deltasync", "vllm_ext", "benchmarks"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO)
            if rel in _TABLE_HOLDERS:
                continue
            named = [
                node.attr
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.Attribute) and node.attr in names
                and isinstance(node.value, ast.Name) and node.value.id == "torch"
            ]  # fmt: skip
            if rel.parent == _SCHEMES and len(named) <= 1:
                continue
            if named:
                found.append(f"{rel}: {', '.join(named)}")
    assert not found, found
