"""The tensors manifest (deltasync/format/manifest.py): its documented digest, and format 4 files and
pointers that name it."""

from __future__ import annotations

import json

import pytest
import torch

from format_example import example_state, ref_manifest, manifest_files

from deltasync import FormatError
from deltasync import format as F


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
