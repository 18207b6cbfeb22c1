"""Anchor files (deltasync/format/anchors.py): golden bytes, decoding, malformed anchors."""

from __future__ import annotations

import struct

import pytest
import torch

from format_example import ANCHOR_WHERE, rebuild, example_files, _raw, _anchor
from format_golden import FP0, ANCHOR_HEADER, ANCHOR_DATA

from deltasync import FormatError
from deltasync import format as F
from deltasync.format.fingerprint import fingerprint


def test_anchor_golden_bytes() -> None:
    data = example_files()["anchor"]
    assert data[:8] == struct.pack("<Q", len(ANCHOR_HEADER)) == bytes.fromhex("6001000000000000")
    assert data[8 : 8 + len(ANCHOR_HEADER)] == ANCHOR_HEADER
    assert data[8 + len(ANCHOR_HEADER) :].hex() == ANCHOR_DATA
    assert len(data) == 380


def test_decode_anchor() -> None:
    header, tensors = F.decode_anchor(example_files()["anchor"], where=ANCHOR_WHERE)
    assert (header.kind, header.version, header.base, header.anchor, header.codec) == ("anchor", 0, None, 0, "raw")
    assert (header.params, header.changed, header.total, header.fingerprint) == (2, 10, 10, FP0)
    assert fingerprint(tensors) == FP0
    assert tensors["model.proj.weight"].shape == (2, 3)


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
