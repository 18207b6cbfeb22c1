"""A reader, end to end, on the worked example of docs/protocol.md written as a bucket from the format
alone (no publisher): it reads it, and refuses each tampered file while keeping its state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from format_example import bf16, bits_of, rebuild, example_files, _raw
from format_golden import FP0, FP1, POINTER_V1_TEXT, POINTER_TEXT

from deltasync import DeltaReceiver, DeltaSyncError, FormatError, IntegrityError, VersionError
from deltasync import format as F


def write_bucket(root: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)


def example_bucket(
    root: Path, *, codec: str = "raw", delta: bytes | None = None, entry: dict | None = None, pointer_format: int = 3
) -> None:
    """The worked example as a bucket, written from the format alone (no publisher), with a
    pointer of format 3 (what writers write) or 1 (an old bucket)."""
    files = example_files()
    data = files[codec] if delta is None else delta
    pointer = json.loads(POINTER_TEXT if pointer_format == 3 else POINTER_V1_TEXT)
    assert pointer["format_version"] == pointer_format
    item = pointer["chain"][-1]  # the delta of version 1
    item.update(nbytes=len(data), sha256=F.sha256_hex(data))
    item.update(entry or {})
    pointer.update(fingerprint=item["fingerprint"])
    write_bucket(
        root,
        {
            "anchors/00000000.safetensors": files["anchor"],
            "deltas/00000001.safetensors": data,
            "latest.json": json.dumps(pointer).encode(),
        },
    )


@pytest.mark.parametrize("pointer_format", [1, 3])
@pytest.mark.parametrize("codec", F.CODECS)
def test_a_bucket_written_from_the_document_is_readable(tmp_path: Path, codec: str, pointer_format: int) -> None:
    example_bucket(tmp_path, codec=codec, pointer_format=pointer_format)
    receiver = DeltaReceiver(tmp_path)
    assert receiver.sync(0) == 0
    assert receiver.fingerprint == FP0
    assert receiver.sync() == 1
    assert receiver.fingerprint == FP1
    state = receiver.state_dict()
    assert bits_of(state["model.proj.weight"]) == [0x3F01, 0xBE80, 0x8000, 0x0001, 0x4000, 0x4040]
    assert bits_of(state["model.norm.weight"]) == [0x3F80, 0x3F7F, 0x3F80, 0x3F7E]
    fresh = DeltaReceiver(tmp_path)
    assert fresh.sync() == 1 and fresh.fingerprint == FP1  # catch-up: the anchor, then the delta


def _tampered_delta(meta: dict) -> bytes:
    return rebuild(_raw(), meta=meta)


READER_FAILURES = {
    "bytes differ from the pointer's sha256": (
        dict(delta=_raw()[:-1] + b"\x41", entry={"sha256": F.sha256_hex(_raw())}),
        IntegrityError,
        "does not match the pointer's",
    ),
    "size differs from the pointer's": (dict(entry={"nbytes": 597}), IntegrityError, "596 bytes, the pointer says 597"),
    "values that do not give the fingerprint": (
        dict(delta=rebuild(_raw(), tensors={"model.norm.weight:values": bf16([0x3F7F, 0x3F7D])})),
        IntegrityError,
        "applying it gives fingerprint",
    ),
    "a base fingerprint of another state": (
        dict(delta=_tampered_delta({"base_fingerprint": "0123456789abcdef"})),
        IntegrityError,
        f"applies to a state with fingerprint 0123456789abcdef, but the state at version 0 has {FP0}",
    ),
    "file version differs from the pointer's": (
        dict(delta=_tampered_delta({"version": "2", "base": "1"})),
        VersionError,
        "the file is version 2, the pointer lists it as 1",
    ),
    "file descends from another anchor": (
        dict(delta=_tampered_delta({"anchor": "9"})),
        VersionError,
        "descends from anchor 9, the pointer's chain grew from 0",
    ),
    "file total differs from the pointer's": (
        dict(delta=_tampered_delta({"total": "11"})),
        FormatError,
        "says the state has 11 elements, the pointer says 10",
    ),
    "file fingerprint differs from the pointer's": (
        dict(delta=_tampered_delta({"fingerprint": "0123456789abcdef"})),
        IntegrityError,
        f"fingerprint 0123456789abcdef in the file, {FP1} in the pointer",
    ),
}


@pytest.mark.parametrize("pointer_format", [1, 3])
@pytest.mark.parametrize("case", list(READER_FAILURES))
def test_a_reader_refuses_and_keeps_its_state(tmp_path: Path, case: str, pointer_format: int) -> None:
    kwargs, error, message = READER_FAILURES[case]
    example_bucket(tmp_path, pointer_format=pointer_format, **kwargs)
    receiver = DeltaReceiver(tmp_path)
    receiver.sync(0)
    before = {name: bits_of(t) for name, t in receiver.state_dict().items()}
    with pytest.raises(error) as info:
        receiver.sync()
    assert isinstance(info.value, DeltaSyncError)
    assert "deltas/00000001.safetensors (version 1): " in str(info.value)
    assert message in str(info.value)
    assert (receiver.version, receiver.fingerprint) == (0, FP0)
    assert {name: bits_of(t) for name, t in receiver.state_dict().items()} == before
