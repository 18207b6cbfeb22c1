"""The bytes of a quantized view's files (docs/protocol.md section 20): golden files and fingerprints.

A view's chain uses the bf16 chain's format; what is new is its element dtypes (F8_E4M3 and I8
codes beside BF16 scales) and how one-byte values move (as zero-extended 16-bit lanes).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import torch

from deltasync import format as F
from deltasync.format.fingerprint import fingerprint, fingerprint_update
from deltasync.format import Change
from deltasync.format.dtypes import from_lanes, lanes

# The example of docs/protocol.md section 20 (bit patterns in hex).
FP0, FP1 = "6a229d99e01e5ae6", "1e7ce601b9e06485"
ANCHOR_SHA256 = "3199f7300603b489f210a20445fbf7180910f3fa3015fd6970ab475063533d43"
RAW_SHA256 = "5d3ac6038d800ded1188cc37a4927d75ce204bacdb82db8766143a7a7a39d691"
ANCHOR_DATA = "803f803f803f803f003c803b38b000807efe"
RAW_DATA = "010000000400000001000000813bb17d"


def _fp8(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8).view(torch.float8_e4m3fn)


def _bf16(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - 0x10000 if b >= 0x8000 else b for b in bits], dtype=torch.int16).view(torch.bfloat16)


def example() -> tuple[dict[str, torch.Tensor], dict[str, Change], bytes, bytes]:
    state = {
        "model.norm.weight": _bf16([0x3F80] * 4),
        "model.proj.weight": _fp8([0x38, 0xB0, 0x00, 0x80, 0x7E, 0xFE]).view(2, 3),
        "model.proj.weight_scale": _bf16([0x3C00, 0x3B80]).view(2, 1),
    }
    codes, scales = state["model.proj.weight"].view(-1), state["model.proj.weight_scale"].view(-1)
    changes = {
        "model.proj.weight": Change(torch.tensor([1, 4]), _fp8([0xB1, 0x7D]), codes[torch.tensor([1, 4])]),
        "model.proj.weight_scale": Change(torch.tensor([1]), _bf16([0x3B81]), scales[torch.tensor([1])]),
    }
    metadata = {"x-view": "FP8_DYNAMIC", "x-quantization-config": "{}"}
    anchor = F.encode_anchor(state, version=0, fingerprint=FP0, extra_metadata=metadata)
    raw = F.encode_delta(changes, version=1, anchor=0, codec="raw", total=12, fingerprint=FP1, base_fingerprint=FP0)
    return state, changes, anchor, raw


def test_view_fingerprints_hash_one_byte_codes_by_their_bits() -> None:
    state, changes, _, _ = example()
    assert fingerprint(state) == FP0
    fp = FP0
    for name, change in changes.items():
        fp = fingerprint_update(fp, name, change.index, change.old, change.new)
    assert fp == FP1
    # A code hashes as its byte zero-extended to 16 bits: the bf16 pattern with those bits.
    code = _fp8([0xB0])
    assert fingerprint({"c": code}) == fingerprint({"c": _bf16([0x00B0])})


def test_view_anchor_and_raw_delta_golden_bytes() -> None:
    _, _, anchor, raw = example()
    assert len(anchor) == 514 and F.sha256_hex(anchor) == ANCHOR_SHA256
    assert anchor[-18:].hex() == ANCHOR_DATA
    assert len(raw) == 592 and F.sha256_hex(raw) == RAW_SHA256
    assert raw[-16:].hex() == RAW_DATA
    assert b'"dtype":"F8_E4M3"' in anchor and b'"dtype":"F8_E4M3"' in raw


def test_view_files_decode_back_exactly_with_both_codecs() -> None:
    state, changes, anchor, raw = example()
    header, tensors = F.decode_anchor(anchor, where="anchor")
    assert header.kind == "anchor" and tensors["model.proj.weight"].dtype == torch.float8_e4m3fn
    dtypes = {n: t.dtype for n, t in state.items()}
    numels = {n: t.numel() for n, t in state.items()}

    def base(name: str, index: torch.Tensor) -> torch.Tensor:
        return state[name].reshape(-1)[index]

    zstd = F.encode_delta(changes, version=1, anchor=0, codec="zstd", total=12, fingerprint=FP1, base_fingerprint=FP0)
    for data in (raw, zstd):
        _, decoded = F.decode_delta(data, where="delta", numels=numels, base_values=base, dtypes=dtypes)
        for name, change in changes.items():
            assert decoded[name].new.dtype == change.new.dtype
            assert torch.equal(lanes(decoded[name].new), lanes(change.new))


def test_one_byte_lanes_refuse_bits_above_their_byte() -> None:
    import pytest

    from deltasync import FormatError

    assert torch.equal(from_lanes(torch.tensor([0x7D], dtype=torch.int16), torch.float8_e4m3fn).view(torch.uint8),
                       torch.tensor([0x7D], dtype=torch.uint8))  # fmt: skip
    with pytest.raises(FormatError, match="0x017d do not fit the 8 bits of F8_E4M3"):
        from_lanes(torch.tensor([0x17D], dtype=torch.int16), torch.float8_e4m3fn, what="x")


def test_a_reader_of_some_elements_refuses_only_codes_it_holds_that_leave_their_byte() -> None:
    """A tensor-parallel rank decodes the elements it does not hold against zeros: their lanes may
    leave the byte (meaningless there); only a held element's overflow is refused."""
    import pytest

    from deltasync import FormatError
    from deltasync.reader.chain import Overlay

    state, changes, _, _ = example()
    dtypes = {n: t.dtype for n, t in state.items()}
    numels = {n: t.numel() for n, t in state.items()}
    zstd = F.encode_delta(changes, version=1, anchor=0, codec="zstd", total=12, fingerprint=FP1, base_fingerprint=FP0)
    codes = state["model.proj.weight"].reshape(-1)

    def holding(held: set[int]):
        def read(name: str, index: torch.Tensor):
            if name != "model.proj.weight":
                return None, lanes(state[name].reshape(-1)[index])
            pos = torch.tensor([k for k, i in enumerate(index.tolist()) if i in held], dtype=torch.int64)
            return pos, lanes(codes[index[pos]])

        return Overlay(read, dtypes)

    # Code 1 goes b0 -> b1 (+1); read against zero where not held, 0 + 1 stays in the byte. Code 4
    # goes 7e -> 7d (-1): against zero it is -1, outside the byte.
    overlay = holding({1})
    _, decoded = F.decode_delta(zstd, where="d", numels=numels, base_values=overlay.values, dtypes=dtypes)
    assert decoded["model.proj.weight"].invalid is not None
    moves = overlay.advance(decoded)
    assert moves["model.proj.weight"].index.tolist() == [1]
    assert moves["model.proj.weight"].new.tolist() == [0xB1]
    # A tampered difference that takes a held code out of its byte is refused.
    tampered = {"model.proj.weight": Change(torch.tensor([1, 4]), _fp8([0xB1, 0x7D]), _fp8([0xB0, 0xFF]))}
    bad = F.encode_delta(tampered, version=1, anchor=0, codec="zstd", total=12, fingerprint=FP1, base_fingerprint=FP0)
    full = holding({0, 1, 2, 3, 4, 5})
    _, decoded = F.decode_delta(bad, where="d", numels=numels, base_values=full.values, dtypes=dtypes)
    with pytest.raises(FormatError, match="element 4 leaves the 8 bits"):
        full.advance(decoded)


# --------------------------------------------------------------------------- what identifies a view

DOC = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def identified_files() -> dict[str, bytes]:
    """The example as a writer writes it now (format 4): the view's identity in the pointer and
    in every file's metadata, beside the manifest digest."""
    from deltasync.views.identity import ViewIdentity

    identity = ViewIdentity.of("FP8_DYNAMIC")
    state, changes, _, _ = example()
    manifest = F.tensors_manifest(state)
    anchor = F.encode_anchor(state, version=0, fingerprint=FP0, manifest=manifest,
                             extra_metadata={**identity.metadata(), "x-quantization-config": "{}"})  # fmt: skip
    raw = F.encode_delta(changes, version=1, anchor=0, codec="raw", total=12, fingerprint=FP1, base_fingerprint=FP0,
                         manifest=manifest, extra_metadata=identity.metadata())  # fmt: skip
    first = F.ChainEntry(version=0, kind="anchor", path=F.anchor_path(0), nbytes=len(anchor),
                         sha256=F.sha256_hex(anchor), fingerprint=FP0, changed=12)  # fmt: skip
    delta = F.ChainEntry(version=1, kind="delta", path=F.delta_path(1), nbytes=len(raw), sha256=F.sha256_hex(raw),
                         fingerprint=FP1, changed=3)  # fmt: skip
    pointer = replace(F.Pointer.start(first, total=12, manifest=manifest, view=identity.to_json()), version=1,
                      fingerprint=FP1, chain=(delta,))  # fmt: skip
    return {"anchor": anchor, "raw": raw, "pointer": pointer.to_bytes()}


def render_view_dumps() -> dict[str, str]:
    """The dumps of docs/protocol.md section 20, by the name of their ``<!-- dump: NAME -->`` marker."""
    files = identified_files()
    return {
        "view-pointer": files["pointer"].decode().rstrip("\n"),
        "view-delta-metadata": json.dumps(F.read_metadata(files["raw"], where="x"), sort_keys=True, separators=(",", ":")),
    }


def test_protocol_doc_shows_the_view_identity_the_code_writes() -> None:
    doc = DOC.read_text()
    for name, text in render_view_dumps().items():
        match = re.search(rf"<!-- dump: {re.escape(name)} -->\n```text\n(.*?)\n```", doc, re.S)
        assert match, f"docs/protocol.md has no <!-- dump: {name} --> block"
        assert match.group(1) == text, f"docs/protocol.md: dump {name!r} is stale; run python tests/unit/core/test_view_format.py"


def test_the_identified_example_reads_as_its_view_and_as_nothing_else(tmp_path) -> None:
    import pytest

    from deltasync import DeltaReceiver, FormatError

    folder = tmp_path / "bucket" / "views" / "FP8_DYNAMIC"
    for name, path in (("anchor", F.anchor_path(0)), ("raw", F.delta_path(1)), ("pointer", F.POINTER_PATH)):
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(identified_files()[name])
    receiver = DeltaReceiver(tmp_path / "bucket", view="FP8_DYNAMIC")
    assert receiver.sync() == 1 and receiver.fingerprint == FP1
    import shutil

    shutil.copytree(folder, folder.parent / "W8A8")  # another scheme's chain under W8A8's name
    with pytest.raises(FormatError, match=r"view W8A8 \(I8 codes, BF16 scales, channel scale layout\) was asked for, "
                       r"the pointer names view FP8_DYNAMIC \(F8_E4M3 codes"):  # fmt: skip
        DeltaReceiver(tmp_path / "bucket", view="W8A8").sync()
    with pytest.raises(FormatError, match="the bf16 chain was asked for, the pointer names view FP8_DYNAMIC"):
        DeltaReceiver(folder).sync()


if __name__ == "__main__":
    for key, value in render_view_dumps().items():
        print(f"<!-- dump: {key} -->\n```text\n{value}\n```\n")
