"""The raw codec (deltasync/format/codecs/raw.py): golden bytes and the width of its indices."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import load as st_load

from format_example import bf16, header_json, example_files
from format_golden import FP0, FP1, RAW_DELTA_HEADER, RAW_DELTA_DATA

from deltasync import FormatError
from deltasync import format as F


def test_raw_delta_golden_bytes() -> None:
    data = example_files()["raw"]
    assert data[:8] == struct.pack("<Q", len(RAW_DELTA_HEADER)) == bytes.fromhex("2802000000000000")
    assert data[8 : 8 + len(RAW_DELTA_HEADER)] == RAW_DELTA_HEADER
    assert data[8 + len(RAW_DELTA_HEADER) :].hex() == RAW_DELTA_DATA


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
