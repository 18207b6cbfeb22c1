"""The golden values of the format: what the worked example of docs/protocol.md (tests/format_example.py)
must give, byte for byte."""

from __future__ import annotations


ZSTD_GOLDEN_LIBZSTD = (1, 5, 7)


FP0 = "11187f76270f9daf"
FP1 = "d4da98557a0e9731"


ANCHOR_HEADER = (
    b'{"__metadata__":{"anchor":"0","base":"none","changed":"10","codec":"raw",'
    b'"fingerprint":"11187f76270f9daf","format":"deltasync","format_version":"1","kind":"anchor",'
    b'"params":"2","total":"10","version":"0"},'
    b'"model.norm.weight":{"dtype":"BF16","shape":[4],"data_offsets":[0,8]},'
    b'"model.proj.weight":{"dtype":"BF16","shape":[2,3],"data_offsets":[8,20]}}    '
)

ANCHOR_DATA = "803f803f803f803f003f80be00000080004040c0"

RAW_DELTA_HEADER = (
    b'{"__metadata__":{"anchor":"0","base":"0","base_fingerprint":"11187f76270f9daf","changed":"6",'
    b'"codec":"raw","fingerprint":"d4da98557a0e9731","format":"deltasync","format_version":"1",'
    b'"kind":"delta","params":"2","total":"10","version":"1"},'
    b'"model.norm.weight:indices":{"dtype":"I32","shape":[2],"data_offsets":[0,8]},'
    b'"model.proj.weight:indices":{"dtype":"I32","shape":[4],"data_offsets":[8,24]},'
    b'"model.norm.weight:values":{"dtype":"BF16","shape":[2],"data_offsets":[24,28]},'
    b'"model.proj.weight:values":{"dtype":"BF16","shape":[4],"data_offsets":[28,36]}} '
)

RAW_DELTA_DATA = (
    "01000000"
    "03000000"  # model.norm.weight:indices 1 3
    "00000000"
    "02000000"
    "03000000"
    "05000000"  # model.proj.weight:indices 0 2 3 5
    "7f3f"
    "7e3f"  # model.norm.weight:values
    "013f"
    "0080"
    "0100"
    "4040"  # model.proj.weight:values
)

ZSTD_METADATA_TEXT = (
    b'{"anchor":"0","base":"0","base_fingerprint":"11187f76270f9daf","changed":"6","codec":"zstd",'
    b'"fingerprint":"d4da98557a0e9731","format":"deltasync","format_version":"1","kind":"delta",'
    b'"names":"[\\"model.proj.weight\\",\\"model.norm.weight\\"]","params":"2","total":"10","version":"1"}'
)

ZSTD_TENSOR_ORDER = [
    "zstd:counts",
    "zstd:esc_hi",
    "zstd:esc_lo",
    "zstd:gap_big",
    "zstd:gap_hi",
    "zstd:gap_hi_mask",
    "zstd:gap_lo",
    "zstd:sym",
]

ZSTD_COUNTS = "04000000000000000200000000000000"

ZSTD_STREAMS = {
    "gap_lo": "000100010101",
    "gap_hi_mask": "00",
    "gap_hi": "",
    "gap_big": "",
    "sym": "f108",
    "esc_lo": "04fd",
    "esc_hi": "00fe",
}

# The whole zstd file, as libzstd ZSTD_GOLDEN_LIBZSTD compresses its streams at level 3.
ZSTD_DELTA_SHA256 = "9251deaacb8d1dd6c76e4bc82421114c807e4287393851a08071994764d918d2"

BIG_GAP_STREAMS = {
    "gap_lo": "05262b16",
    "gap_hi_mask": "0e",
    "gap_hi": "0101ff",
    "gap_big": "0f01000000000000",
    "sym": "f9",
    "esc_lo": "0006",
    "esc_hi": "7800",
}

POINTER_V1_TEXT = """\
{
 "anchor": 0,
 "chain": [
  {
   "changed": 10,
   "fingerprint": "11187f76270f9daf",
   "kind": "anchor",
   "nbytes": 380,
   "path": "anchors/00000000.safetensors",
   "sha256": "deb5a3f8e553c8bd880b37efe7b588496c0bf915080367f7b4fd56ebb33742b8",
   "version": 0
  },
  {
   "changed": 6,
   "fingerprint": "d4da98557a0e9731",
   "kind": "delta",
   "nbytes": 596,
   "path": "deltas/00000001.safetensors",
   "sha256": "fe97a7f238a842097ed4e5de5339ecb61cfde25deb86a5dfe2d436faefdccfd7",
   "version": 1
  }
 ],
 "fingerprint": "d4da98557a0e9731",
 "format": "deltasync",
 "format_version": 1,
 "total": 10,
 "version": 1
}
"""

# The same chain as a format 3 pointer (anchors beside deltas): what a writer writes now.
POINTER_TEXT = """\
{
 "anchor": 0,
 "anchors": [
  {
   "changed": 10,
   "fingerprint": "11187f76270f9daf",
   "kind": "anchor",
   "nbytes": 380,
   "path": "anchors/00000000.safetensors",
   "sha256": "deb5a3f8e553c8bd880b37efe7b588496c0bf915080367f7b4fd56ebb33742b8",
   "version": 0
  }
 ],
 "base": 0,
 "base_fingerprint": "11187f76270f9daf",
 "chain": [
  {
   "changed": 6,
   "fingerprint": "d4da98557a0e9731",
   "kind": "delta",
   "nbytes": 596,
   "path": "deltas/00000001.safetensors",
   "sha256": "fe97a7f238a842097ed4e5de5339ecb61cfde25deb86a5dfe2d436faefdccfd7",
   "version": 1
  }
 ],
 "fingerprint": "d4da98557a0e9731",
 "format": "deltasync",
 "format_version": 3,
 "root": 0,
 "total": 10,
 "version": 1
}
"""
