"""The pointer (deltasync/format/pointer.py, pointer_checks.py): golden bytes, format 1 read as format 3,
and malformed pointers."""

from __future__ import annotations

import json

import pytest

from format_example import BUCKET, example_files
from format_golden import FP0, FP1, POINTER_V1_TEXT, POINTER_TEXT
from helpers import old_pointer

from deltasync import FormatError, Pointer
from deltasync import format as F


# --------------------------------------------------------------------------- golden bytes


def test_pointer_golden_bytes() -> None:
    data = example_files()["pointer"]
    assert data.decode() == POINTER_TEXT
    pointer = Pointer.from_bytes(data)
    assert (pointer.version, pointer.anchor, pointer.fingerprint, pointer.total) == (1, 0, FP1, 10)
    assert (pointer.root, pointer.base, pointer.base_fingerprint) == (0, 0, FP0)
    assert pointer.delta(1).sha256 == F.sha256_hex(example_files()["raw"])
    assert pointer.anchors[0].sha256 == F.sha256_hex(example_files()["anchor"])
    assert pointer.to_bytes() == data
    # Canonical form: the same JSON dumped with sorted keys and a one-space indent.
    assert json.dumps(json.loads(data), sort_keys=True, indent=1) + "\n" == data.decode()


def test_format_1_pointer_is_still_read_as_the_same_chain() -> None:
    old = Pointer.from_bytes(POINTER_V1_TEXT.encode())
    assert old == Pointer.from_bytes(POINTER_TEXT.encode())
    assert old.to_bytes().decode() == POINTER_TEXT  # rewritten, it is format 3
    assert old_pointer(old).decode() == POINTER_V1_TEXT  # the tests' writer of old buckets


# --------------------------------------------------------------------------- malformed pointers


def _pointer(**changes: object) -> bytes:
    body = json.loads(POINTER_V1_TEXT)
    for key, value in changes.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return json.dumps(body).encode()


def _chain(k: int, **changes: object) -> list[dict]:
    chain = json.loads(POINTER_V1_TEXT)["chain"]
    chain[k].update(changes)
    return chain


def _pointer3(**changes: object) -> bytes:
    body = json.loads(POINTER_TEXT)
    for key, value in changes.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    return json.dumps(body).encode()


def _entries3(key: str, k: int, **changes: object) -> list[dict]:
    items = json.loads(POINTER_TEXT)[key]
    items[k].update(changes)
    return items


BAD_POINTERS = {
    "not JSON": (lambda: b"{", "not a deltasync pointer (invalid JSON"),
    "not UTF-8": (lambda: b"\xff", "not a deltasync pointer (invalid JSON"),
    "a JSON list": (lambda: b"[]", "not a deltasync pointer (format is not 'deltasync')"),
    "no format": (lambda: _pointer(format=None), "not a deltasync pointer (format is not 'deltasync')"),
    "format_version 5": (
        lambda: _pointer(format_version=5),
        "format_version 5 is not supported (this deltasync reads 1, 2, 3, 4); upgrade deltasync",
    ),
    "format_version as a string": (lambda: _pointer(format_version="1"), "format_version '1' is not supported"),
    "missing total": (lambda: _pointer(total=None), "malformed pointer (KeyError('total'))"),
    "chain entry without sha256": (
        lambda: _pointer(chain=[{k: v for k, v in e.items() if k != "sha256"} for e in _chain(0)]),
        "malformed pointer (KeyError('sha256'))",
    ),
    "a gap in the chain": (
        lambda: _pointer(version=2, chain=[_chain(0)[0], _chain(1, version=2)[1]]),
        "the chain must list versions 0..2 in order, got [0, 2]",
    ),
    "chain out of order": (
        lambda: _pointer(chain=list(reversed(_chain(0)))),
        "the chain must list versions 0..1 in order, got [1, 0]",
    ),
    "chain missing its anchor": (
        lambda: _pointer(chain=_chain(0)[1:]),
        "the chain must list versions 0..1 in order, got [1]",
    ),
    "a delta listed as an anchor": (
        lambda: _pointer(chain=_chain(1, kind="anchor")),
        "version 1 should be a delta, not 'anchor'",
    ),
    "an anchor listed as a delta": (
        lambda: _pointer(chain=_chain(0, kind="delta")),
        "version 0 should be an anchor, not 'delta'",
    ),
    "a path outside the layout": (
        lambda: _pointer(chain=_chain(1, path="../secrets")),
        "version 1 names an invalid path '../secrets'",
    ),
    "a delta under anchors/": (
        lambda: _pointer(chain=_chain(1, path="anchors/00000001.safetensors")),
        "version 1 names an invalid path 'anchors/00000001.safetensors'",
    ),
    "fingerprint disagrees with the chain": (
        lambda: _pointer(fingerprint=FP0),
        "the pointer's fingerprint disagrees with its last chain entry",
    ),
    # Format 3: anchors beside the deltas.
    "3: no anchors": (lambda: _pointer3(anchors=[]), "anchors must be a list of 1 to 1024 entries, got a list of 0"),
    "3: anchors not a list": (lambda: _pointer3(anchors={}), "anchors must be a list of 1 to 1024 entries, got dict"),
    "3: missing base": (lambda: _pointer3(base=None), "malformed pointer (KeyError('base'))"),
    "3: chain not after base": (lambda: _pointer3(base=1), "the chain must list versions 2..1 in order, got [1]"),
    "3: an anchor past the version": (
        lambda: _pointer3(anchors=_entries3("anchors", 0, version=2, path="anchors/00000002.safetensors"), anchor=2),
        "anchors must be distinct ascending versions within 0..1, got [2]",
    ),
    "3: anchor is not the newest": (lambda: _pointer3(anchor=1), "anchor 1 is not the newest of its anchors (0)"),
    "3: a delta in anchors/": (
        lambda: _pointer3(chain=_entries3("chain", 0, path="anchors/00000001.safetensors")),
        "version 1 names an invalid path 'anchors/00000001.safetensors'",
    ),
    "3: an anchor listed as a delta": (
        lambda: _pointer3(anchors=_entries3("anchors", 0, kind="delta")),
        "version 0 should be an anchor, not 'delta'",
    ),
    "3: an anchor whose fingerprint disagrees": (
        lambda: _pointer3(anchors=_entries3("anchors", 0, fingerprint=FP1)),
        "the anchor of version 0 disagrees with the chain's fingerprint",
    ),
    "3: base fingerprint disagrees": (
        lambda: _pointer3(
            base=1, chain=[], base_fingerprint=FP0, anchor=1,
            anchors=_entries3("anchors", 0, version=1, path="anchors/00000001.safetensors", fingerprint=FP0),
        ),
        "the pointer's fingerprint disagrees with its last chain entry",
    ),
    "3: root after base": (lambda: _pointer3(root=1), "root 1, base 0 and version 1 are out of order"),
}


@pytest.mark.parametrize("case", list(BAD_POINTERS))
def test_malformed_pointer_is_refused(case: str) -> None:
    make, message = BAD_POINTERS[case]
    where = f"{BUCKET}/latest.json"
    with pytest.raises(FormatError) as info:
        Pointer.from_bytes(make(), where=where)
    assert str(info.value).startswith(where + ": ")
    assert message in str(info.value)


def test_pointer_with_version_before_its_anchor_is_refused() -> None:
    with pytest.raises(FormatError):
        Pointer.from_bytes(_pointer(version=0, anchor=5, chain=[], fingerprint=FP0))
