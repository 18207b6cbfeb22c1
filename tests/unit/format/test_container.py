"""The safetensors container (deltasync/format/container.py): the same bytes as the safetensors library
writes, and the layout rules docs/protocol.md states."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from format_example import bf16, bits_of, PROJ_BITS, example_state, example_files
from format_golden import FP0

from deltasync import format as F


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
