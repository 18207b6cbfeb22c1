"""A chain is what its name says: a view reader reads that view's chain and nothing else.

The bucket: a tiny Qwen2, 8 versions published with views FP8_DYNAMIC and W8A8, raw codec,
``anchor_every=4``, ``keep_anchors=2`` (anchors at 0 and 4). Each test copies it and rewrites it the way an attacker
or a careless script would (another scheme's folder under the view's name, the bf16 chain under
it, codes relabelled, a scale reshaped), with sizes, SHA-256 and manifest digests made to match,
and checks the refusal: it names the view asked for, the one found and the file, and a receiver
already synced keeps its version and every bit of its state. Buckets written before views named
themselves (no ``view`` in the pointer, only ``x-view`` in anchors) still read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from helpers import small_transformer, train_step

from deltasync import DeltaPublisher, DeltaReceiver, FormatError
from deltasync.cli import main as cli
from deltasync.format import POINTER_PATH, Pointer, sha256_hex, view_prefix
from deltasync.views.identity import METADATA_KEYS, ViewIdentity

FP8, W8A8 = "FP8_DYNAMIC", "W8A8"
CODES = "model.layers.0.mlp.down_proj.weight"
SCALE = CODES + "_scale"
VERSIONS = 8


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> Path:
    """The bucket, written once per module; tests work on copies (:func:`_copy`)."""
    bucket = tmp_path_factory.mktemp("identity") / "bucket"
    model = small_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DeltaPublisher(bucket, model, optimizer, views=(FP8, W8A8), codec="raw", anchor_every=4, keep_anchors=2,
                        anchor_bytes_ratio=0) as pub:
        for step in range(VERSIONS):
            if step:
                train_step(model, optimizer, step)
            pub.publish()
    return bucket


def _copy(honest: Path, tmp_path: Path) -> Path:
    bucket = tmp_path / "bucket"
    shutil.copytree(honest, bucket)
    return bucket


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16).clone()


def _snapshot(receiver: DeltaReceiver) -> tuple[int | None, str | None, dict[str, torch.Tensor]]:
    return receiver.version, receiver.fingerprint, {n: _bits(t) for n, t in receiver.state_dict().items()}


def _unchanged(receiver: DeltaReceiver, before) -> bool:
    version, fp, state = before
    now = receiver.state_dict()
    return (
        receiver.version == version and receiver.fingerprint == fp and set(now) == set(state)
        and all(torch.equal(_bits(now[n]), state[n]) for n in state)
    )  # fmt: skip


def _synced(bucket: Path, view: str | None, version: int) -> DeltaReceiver:
    receiver = DeltaReceiver(bucket, view=view)
    receiver.sync(version)
    return receiver


def _folder(bucket: Path, view: str | None) -> Path:
    return bucket if view is None else bucket / view_prefix(view)


def _swap(bucket: Path, view: str, source: Path) -> None:
    """Replace ``view``'s folder by the chain (pointer, anchors, deltas) found in ``source``."""
    folder = _folder(bucket, view)
    chain = bucket.parent / "swapped"
    for name in ("anchors", "deltas"):
        shutil.copytree(source / name, chain / name)
    shutil.copy(source / POINTER_PATH, chain / POINTER_PATH)
    for name in ("anchors", "deltas", POINTER_PATH):
        target = folder / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        shutil.move(chain / name, target)
    chain.rmdir()


# --------------------------------------------------------------------------- rewriting a chain


def _split(data: bytes) -> tuple[dict, bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _join(header: dict, body: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _manifest(header: dict) -> str:
    """docs/protocol.md section 3, from an anchor's tensor table."""
    entries = sorted([name, t["shape"], t["dtype"]] for name, t in header.items() if name != "__metadata__")
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def _rewrite(folder: Path, *, tensors=None, metadata=None, pointer_view: object = "keep") -> None:
    """Rewrite every file a chain's pointer names, as someone who can write the bucket would:
    ``tensors(table)`` edits an anchor's tensor table, ``metadata(meta, kind)`` any file's
    metadata; each file's size and SHA-256, and (when tensors change) the manifest digest in every
    file and the pointer, are made to match. ``pointer_view``: the pointer's new ``view``."""
    pointer = Pointer.from_bytes((folder / POINTER_PATH).read_bytes())
    headers = {}
    for entry in (*pointer.anchors, *pointer.chain):
        header, body = _split((folder / entry.path).read_bytes())
        if tensors is not None and entry.kind == "anchor":
            tensors(header)
        if metadata is not None:
            metadata(header["__metadata__"], entry.kind)
        headers[entry.path] = (header, body)
    manifest = pointer.manifest
    if tensors is not None:
        (manifest,) = {_manifest(h) for h, _ in headers.values() if h["__metadata__"]["kind"] == "anchor"}
    fixed = {}
    for path, (header, body) in headers.items():
        header["__metadata__"]["manifest"] = manifest
        data = _join(header, body)
        (folder / path).write_bytes(data)
        fixed[path] = (len(data), sha256_hex(data))

    def fix(entry):
        nbytes, sha = fixed[entry.path]
        return dataclasses.replace(entry, nbytes=nbytes, sha256=sha)

    changes: dict = {"anchors": tuple(map(fix, pointer.anchors)), "chain": tuple(map(fix, pointer.chain)), "manifest": manifest}
    if pointer_view != "keep":
        changes["view"] = pointer_view
    (folder / POINTER_PATH).write_bytes(dataclasses.replace(pointer, **changes).to_bytes())


def _as_before_identity(folder: Path) -> None:
    """A view's chain as deltasync wrote it before views named themselves: no ``view`` in the
    pointer, no identity in deltas, only ``x-view`` (and the config) in anchors."""

    def strip(meta: dict, kind: str) -> None:
        for key in METADATA_KEYS.values():
            if key != "x-view" or kind == "delta":
                meta.pop(key, None)

    _rewrite(folder, metadata=strip, pointer_view=None)


# --------------------------------------------------------------------------- the honest bucket


def test_each_view_names_itself_in_its_pointer_and_in_every_file(honest):
    for view in (FP8, W8A8):
        folder = _folder(honest, view)
        pointer = Pointer.from_bytes((folder / POINTER_PATH).read_bytes())
        assert pointer.view == ViewIdentity.of(view).to_json()
        assert pointer.view["codes"] == {"FP8_DYNAMIC": "F8_E4M3", "W8A8": "I8"}[view]
        for entry in (*pointer.anchors, *pointer.chain):
            meta = _split((folder / entry.path).read_bytes())[0]["__metadata__"]
            assert {k: meta[k] for k in METADATA_KEYS.values()} == ViewIdentity.of(view).metadata(), entry.path
    root = Pointer.from_bytes((honest / POINTER_PATH).read_bytes())
    assert root.view is None
    assert "view" not in json.loads((honest / POINTER_PATH).read_text())


def test_a_bucket_written_before_views_named_themselves_still_reads(honest, tmp_path):
    bucket = _copy(honest, tmp_path)
    for view in (FP8, W8A8):
        _as_before_identity(_folder(bucket, view))
        assert "view" not in json.loads((_folder(bucket, view) / POINTER_PATH).read_text())
        want = _synced(honest, view, VERSIONS - 1).state_dict()
        follower = _synced(bucket, view, 5)  # from an anchor, then by deltas
        follower.sync()
        late = _synced(bucket, view, VERSIONS - 1)
        for receiver in (follower, late):
            got = receiver.state_dict()
            assert set(got) == set(want) and all(torch.equal(_bits(got[n]), _bits(want[n])) for n in want)
            assert receiver.verify()


# --------------------------------------------------------------------------- 1. another scheme's chain


@pytest.mark.parametrize("written", ["now", "before identity"])
def test_another_schemes_chain_under_the_views_name_is_refused(honest, tmp_path, capsys, written):
    bucket = _copy(honest, tmp_path)
    synced = _synced(bucket, FP8, 5)
    before = _snapshot(synced)
    if written == "before identity":
        for view in (FP8, W8A8):
            _as_before_identity(_folder(bucket, view))
    _swap(bucket, FP8, _folder(bucket, W8A8))
    # The file named: the pointer (it names W8A8), or, in an older bucket, the anchor (x-view W8A8).
    found = "views/FP8_DYNAMIC/latest.json" if written == "now" else "views/FP8_DYNAMIC/anchors/00000004.safetensors"
    for receiver in (synced, DeltaReceiver(bucket, view=FP8)):
        state = _snapshot(receiver)
        with pytest.raises(FormatError) as info:
            receiver.sync()
        message = str(info.value)
        assert "view FP8_DYNAMIC (F8_E4M3 codes" in message and "was asked for" in message, message
        assert "view W8A8" in message and found in message, message
        assert _unchanged(receiver, state)
    assert _unchanged(synced, before) and synced.version == 5
    out = tmp_path / "export"
    assert cli(["export", str(bucket), str(out), "--view", FP8]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "view W8A8" in err and "Traceback" not in err
    assert not out.exists()


def test_verify_of_a_view_reads_it_and_refuses_another_schemes_chain(honest, tmp_path, capsys):
    bucket = _copy(honest, tmp_path)
    assert cli(["verify", str(bucket), "--view", FP8]) == 0
    assert "ok:" in capsys.readouterr().out
    _swap(bucket, FP8, _folder(bucket, W8A8))
    assert cli(["verify", str(bucket), "--view", FP8]) == 1
    out = capsys.readouterr()
    assert "view W8A8" in out.out + out.err and "views/FP8_DYNAMIC/latest.json" in out.out + out.err


# --------------------------------------------------------------------------- 2. the bf16 chain


@pytest.mark.parametrize("written", ["now", "before identity"])
def test_the_bf16_chain_under_a_views_name_is_refused(honest, tmp_path, written):
    bucket = _copy(honest, tmp_path)
    synced = _synced(bucket, FP8, 5)
    before = _snapshot(synced)
    if written == "before identity":
        _as_before_identity(_folder(bucket, FP8))
    _swap(bucket, FP8, bucket)
    fresh = DeltaReceiver(bucket, view=FP8)
    with pytest.raises(FormatError) as info:
        fresh.sync()
    message = str(info.value)
    assert "view FP8_DYNAMIC (F8_E4M3 codes" in message and "the bf16 chain's (it names no view)" in message, message
    assert "views/FP8_DYNAMIC/anchors/00000004.safetensors" in message, message
    assert fresh.version is None and not fresh.state_dict()
    # A receiver already synced knows its state's size: it refuses the pointer at once.
    with pytest.raises(FormatError, match=r"views/FP8_DYNAMIC/latest.json: the bucket's state has 90688 elements, the "
                       r"receiver serves \d+ \(view FP8_DYNAMIC was asked for, the pointer names no view \(the bf16 chain"):  # fmt: skip
        synced.sync()
    assert _unchanged(synced, before)


def test_an_unnamed_bf16_anchor_under_a_views_name_is_refused_by_its_tensors(honest, tmp_path):
    """Even with ``x-view`` written into the bf16 chain's anchors, its tensors are not the view's."""
    bucket = _copy(honest, tmp_path)
    _swap(bucket, FP8, bucket)
    _rewrite(_folder(bucket, FP8), metadata=lambda meta, kind: meta.update({"x-view": FP8}) if kind == "anchor" else None)
    with pytest.raises(FormatError, match=r"view FP8_DYNAMIC was asked for, the anchor holds no quantized weight"):
        DeltaReceiver(bucket, view=FP8).sync()


@pytest.mark.parametrize("written", ["now", "before identity", "unnamed"])
def test_a_view_chain_at_the_bucket_root_is_refused_by_a_bf16_reader(honest, tmp_path, written):
    bucket = _copy(honest, tmp_path)
    synced = _synced(bucket, None, 5)
    before = _snapshot(synced)
    if written != "now":
        _as_before_identity(_folder(bucket, FP8))
    if written == "unnamed":  # not even x-view: the dtypes give it away
        _rewrite(_folder(bucket, FP8), metadata=lambda meta, kind: meta.pop("x-view", None))
    _swap(bucket, None, _folder(bucket, FP8))  # type: ignore[arg-type]
    expected = {
        "now": "latest.json: the bf16 chain was asked for, the pointer names view FP8_DYNAMIC",
        "before identity": r"anchors/00000004.safetensors \(version 4\): the bf16 chain was asked for, the file is of view FP8_DYNAMIC",
        "unnamed": r"anchors/00000004.safetensors \(version 4\): the bf16 chain was asked for, parameter " + f"{CODES!r}" + " holds F8_E4M3",
    }[written]
    fresh = DeltaReceiver(bucket)
    with pytest.raises(FormatError, match=expected):
        fresh.sync()
    assert fresh.version is None and not fresh.state_dict()
    # A receiver already synced refuses the pointer: it names the view, or holds another state's size.
    if written != "now":
        expected = "latest.json: the bucket's state has 91712 elements, the receiver serves 90688"
    with pytest.raises(FormatError, match=expected):
        synced.sync()
    assert _unchanged(synced, before)


# --------------------------------------------------------------------------- 3. codes relabelled


def _relabel(table: dict) -> None:
    assert table[CODES]["dtype"] == "F8_E4M3"
    table[CODES]["dtype"] = "I8"


def _reshape_scale(table: dict) -> None:
    out, one = table[SCALE]["shape"]
    assert one == 1
    table[SCALE]["shape"] = [out]


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_relabel, f"'{CODES}' holds I8 codes; FP8_DYNAMIC's codes are F8_E4M3"),
        (_reshape_scale, f"the scale '{SCALE}' has shape \\[64\\]; a channel scale of a weight \\[64, 128\\] has shape \\[64, 1\\]"),
    ],
    ids=["codes relabelled", "scale reshaped"],
)
def test_tensors_that_do_not_fit_the_scheme_are_refused(honest, tmp_path, capsys, edit, message):
    bucket = _copy(honest, tmp_path)
    synced = _synced(bucket, FP8, 5)
    before = _snapshot(synced)
    # Every anchor edited, and every file's manifest digest, size and SHA-256 made to match.
    _rewrite(_folder(bucket, FP8), tensors=edit)
    for receiver in (synced, DeltaReceiver(bucket, view=FP8)):
        state = _snapshot(receiver)
        with pytest.raises(FormatError, match="views/FP8_DYNAMIC/anchors/00000004.safetensors.*: view FP8_DYNAMIC was "
                           f"asked for, {message}"):  # fmt: skip
            receiver.sync()
        assert _unchanged(receiver, state)
    assert _unchanged(synced, before)
    out = tmp_path / "export"
    assert cli(["export", str(bucket), str(out), "--view", FP8]) == 1
    assert not out.exists() and "Traceback" not in capsys.readouterr().err


# --------------------------------------------------------------------------- export's folder


def test_export_into_a_file_or_a_folder_it_cannot_create_is_an_error_line(honest, tmp_path, capsys):
    target = tmp_path / "a-file"
    target.write_bytes(b"keep me")
    assert cli(["export", str(honest), str(target)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {target} exists and is not a folder; name a new or empty folder to write the checkpoint to\n"
    assert target.read_bytes() == b"keep me"
    below = target / "out"  # a folder under a file cannot be created
    assert cli(["export", str(honest), str(below), "--view", FP8]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot create the folder {below}: ") and "Traceback" not in err
    assert target.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]
