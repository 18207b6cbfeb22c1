"""The file names of a bucket (deltasync/format/paths.py)."""

from __future__ import annotations

from deltasync import format as F


def test_file_names() -> None:
    assert F.POINTER_PATH == "latest.json"
    assert F.HISTORY_PATH == "history.jsonl"
    assert F.anchor_path(0) == "anchors/00000000.safetensors"
    assert F.delta_path(42) == "deltas/00000042.safetensors"
    assert F.delta_path(123456789) == "deltas/123456789.safetensors"  # 8 digits at least, never cut
