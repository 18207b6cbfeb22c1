"""Bad input is refused with a clear DeltaSyncError, and the receiver loses nothing."""

from __future__ import annotations

import pytest
import torch
from helpers import replace_file, small_transformer, train_step

from deltasync import (
    DeltaPublisher,
    DeltaReceiver,
    DeltaSyncError,
    FormatError,
    IntegrityError,
    NotFoundError,
    VersionError,
    open_store,
)
from deltasync.format import Change, safetensors_bytes, encode_delta, read_header
from safetensors.torch import load

Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture
def chain(tmp_path):
    """A bucket at version 2 (anchor 0, deltas 1 and 2) and a receiver at version 1."""
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    publisher = DeltaPublisher(tmp_path / "b", model, opt, codec="raw", anchor_bytes_ratio=0)
    publisher.publish()
    train_step(model, opt, seed=1)
    publisher.publish()
    receiver = DeltaReceiver(tmp_path / "b")
    receiver.sync()
    train_step(model, opt, seed=2)
    publisher.publish()
    store = open_store(tmp_path / "b")
    return store, receiver


def snapshot(receiver: DeltaReceiver) -> tuple:
    return receiver.version, receiver.fingerprint, {k: v.clone() for k, v in receiver.state_dict().items()}


def assert_unchanged(receiver: DeltaReceiver, before: tuple) -> None:
    version, fp, state = before
    assert receiver.version == version == 1
    assert receiver.fingerprint == fp
    now = receiver.state_dict()
    assert set(now) == set(state)
    assert all(torch.equal(now[k].view(torch.int16), state[k].view(torch.int16)) for k in state)


def rewrite_delta(store, version: int, edit) -> bytes:
    """Decode delta ``version`` (raw), let ``edit`` change its tensors/metadata, re-encode."""
    path = f"deltas/{version:08d}.safetensors"
    data = store.read_bytes(path)
    header = read_header(data, where=path)
    tensors = load(data)
    meta = header.to_metadata()
    edit(tensors, meta)
    return safetensors_bytes(tensors, meta)


def check(receiver, before, exc_type, pattern) -> None:
    with pytest.raises(exc_type, match=pattern) as info:
        receiver.sync()
    assert isinstance(info.value, DeltaSyncError)
    assert_unchanged(receiver, before)


def test_truncated_file(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)
    data = store.read_bytes("deltas/00000002.safetensors")
    replace_file(store, 2, data[:-7], fix_pointer=False)
    check(receiver, before, IntegrityError, rf"deltas/00000002.safetensors \(version 2\): {len(data) - 7} bytes, the pointer says {len(data)} \(truncated")


def test_truncated_file_with_matching_pointer(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)
    data = store.read_bytes("deltas/00000002.safetensors")
    replace_file(store, 2, data[: len(data) // 2])
    check(receiver, before, FormatError, r"deltas/00000002.safetensors \(version 2\): not a readable safetensors file")


def test_flipped_byte(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)
    data = bytearray(store.read_bytes("deltas/00000002.safetensors"))
    data[-3] ^= 0x40
    replace_file(store, 2, bytes(data), fix_pointer=False)
    check(receiver, before, IntegrityError, r"deltas/00000002.safetensors \(version 2\): SHA-256 .* \(corrupted or tampered\)")


def test_flipped_value_with_matching_checksum_fails_the_fingerprint(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)
    data = bytearray(store.read_bytes("deltas/00000002.safetensors"))
    data[-3] ^= 0x40  # inside the last bf16 value
    replace_file(store, 2, bytes(data))
    check(receiver, before, IntegrityError, r"version 2\): applying it gives fingerprint [0-9a-f]{16}, the file says")


def test_wrong_dtype(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)

    def edit(tensors, meta):
        tensors[Q + ":values"] = tensors[Q + ":values"].float()

    replace_file(store, 2, rewrite_delta(store, 2, edit))
    check(receiver, before, FormatError, rf"values of parameter '{Q}' must be a 1-D bfloat16 tensor, got torch.float32")


def test_index_out_of_range(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)

    def edit(tensors, meta):
        tensors[Q + ":indices"][-1] = 64 * 64

    replace_file(store, 2, rewrite_delta(store, 2, edit))
    check(receiver, before, FormatError, rf"index 4096 of parameter '{Q}' is out of range \(it has 4096 elements\)")


def test_unknown_parameter(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)

    def edit(tensors, meta):
        tensors["model.layers.9.mlp.up_proj.weight:indices"] = torch.tensor([0], dtype=torch.int32)
        tensors["model.layers.9.mlp.up_proj.weight:values"] = torch.tensor([1.0], dtype=torch.bfloat16)

    replace_file(store, 2, rewrite_delta(store, 2, edit))
    check(receiver, before, FormatError, r"unknown parameter 'model.layers.9.mlp.up_proj.weight'")


def test_wrong_base_version(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)

    def edit(tensors, meta):
        meta["base"] = "0"

    replace_file(store, 2, rewrite_delta(store, 2, edit))
    check(receiver, before, FormatError, r"version 2\): delta 2 names base 0, expected 1")


def test_file_of_another_version(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)
    replace_file(store, 2, store.read_bytes("deltas/00000001.safetensors"))
    check(receiver, before, VersionError, r"deltas/00000002.safetensors \(version 2\): the file is version 1, the pointer lists it as 2")


def test_delta_for_another_base_state(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)
    data = store.read_bytes("deltas/00000002.safetensors")
    header = read_header(data, where="x")
    forged = encode_delta(
        {Q: Change(index=torch.tensor([0]), new=torch.tensor([0.5], dtype=torch.bfloat16))},
        version=2, anchor=0, codec="raw", total=header.total,
        fingerprint=header.fingerprint, base_fingerprint="0" * 16, manifest=header.manifest,
    )
    replace_file(store, 2, forged)
    check(receiver, before, IntegrityError, r"applies to a state with fingerprint 0000000000000000")


def test_pointer_naming_a_missing_file(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)
    store.delete(["deltas/00000002.safetensors"])
    check(receiver, before, NotFoundError, r"deltas/00000002.safetensors")


def test_garbage_pointer(chain) -> None:
    store, receiver = chain
    before = snapshot(receiver)
    store.write_bytes("latest.json", b'{"format": "deltasync", "format_version": 1, "version": 5')
    check(receiver, before, FormatError, r"latest.json: not a deltasync pointer \(invalid JSON")


def test_tampered_anchor_for_a_new_receiver(chain) -> None:
    store, _ = chain
    data = bytearray(store.read_bytes("anchors/00000000.safetensors"))
    data[-1] ^= 1
    replace_file(store, 0, bytes(data), kind="anchor")
    fresh = DeltaReceiver(store)
    with pytest.raises(IntegrityError, match=r"anchors/00000000.safetensors \(version 0\): the anchor's tensors hash to"):
        fresh.sync()
    assert fresh.version is None and fresh.state_dict() == {}


ANCHOR = r"anchors/00000000.safetensors \(version 0\): "


@pytest.mark.parametrize(
    ("edit", "fix_pointer", "error", "pattern"),
    [
        # Streamed into the tensors as it is read: a file that is not the pointer's says so,
        # wherever it differs, before anything else (even where its header no longer parses).
        (lambda d: d[:-5], False, IntegrityError, r"\d+ bytes, the pointer says \d+ \(truncated or replaced\)"),
        (lambda d: d[:100], False, IntegrityError, r"100 bytes, the pointer says \d+ \(truncated or replaced\)"),
        (lambda d: d + b"x", False, IntegrityError, r"more than \d+ bytes, the pointer says \d+ \(truncated or replaced\)"),
        (lambda d: d[:10] + b"!" + d[11:], False, IntegrityError, r"SHA-256 .* \(corrupted or tampered\)"),
        (lambda d: d[:-1] + bytes([d[-1] ^ 1]), False, IntegrityError, r"SHA-256 .* \(corrupted or tampered\)"),
        # The pointer rewritten to match: the file's own checks speak.
        (lambda d: d[:10] + b"!" + d[11:], True, FormatError, r"not a readable safetensors file \(tensor .!_metadata__. has"),
        (lambda d: d[: len(d) // 2], True, FormatError, r"not a readable safetensors file"),
    ],
    ids=["truncated", "header-only", "longer", "header-byte", "value-byte", "header-byte-matching", "half-matching"],
)
def test_a_bad_anchor_is_refused_while_streaming(chain, edit, fix_pointer, error, pattern) -> None:
    store, _ = chain
    replace_file(store, 0, edit(store.read_bytes("anchors/00000000.safetensors")), kind="anchor", fix_pointer=fix_pointer)
    fresh = DeltaReceiver(store)
    with pytest.raises(error, match=ANCHOR + pattern):
        fresh.sync()
    assert fresh.version is None and fresh.state_dict() == {}


def test_receiver_recovers_once_the_bucket_is_repaired(chain) -> None:
    store, receiver = chain
    good = store.read_bytes("deltas/00000002.safetensors")
    pointer = store.read_bytes("latest.json")
    replace_file(store, 2, good[:-1], fix_pointer=False)
    with pytest.raises(IntegrityError):
        receiver.sync()
    store.write_bytes("deltas/00000002.safetensors", good)
    store.write_bytes("latest.json", pointer)
    assert receiver.sync() == 2


def test_a_bad_delta_before_every_anchor_is_named_not_hidden(tmp_path) -> None:
    """Deltas are kept back to the anchor before the newest: a follower behind the newest
    anchor replays them. A corrupt one is reported as such when no anchor can replace it, and
    replaced by the newest anchor when one can."""
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    publisher = DeltaPublisher(tmp_path / "b", model, None, anchor_every=2, anchor_bytes_ratio=0)
    publisher.publish()
    follower = DeltaReceiver(tmp_path / "b")
    for step in range(5):
        with torch.no_grad():
            model.weight.view(-1)[step] += 1
        publisher.publish()
        publisher.flush()
        if step == 1:
            follower.sync()
    publisher.close()
    pointer = publisher.pointer
    assert ([a.version for a in pointer.anchors], pointer.base, follower.version) == ([4], 2, 2)
    store = open_store(tmp_path / "b")
    data = bytearray(store.read_bytes("deltas/00000003.safetensors"))
    data[-1] ^= 1
    store.write_bytes("deltas/00000003.safetensors", bytes(data))
    before = snapshot(follower)
    with pytest.raises(IntegrityError, match=r"deltas/00000003.safetensors \(version 3\): SHA-256"):
        follower.sync(3)  # no anchor at or below 3: the delta's own error, not "older than every anchor"
    assert (follower.version, follower.fingerprint) == before[:2] and before[0] == 2
    assert all(torch.equal(follower.state_dict()[k].view(torch.int16), v.view(torch.int16)) for k, v in before[2].items())
    staged = follower.stage()  # to the newest version: rebuilt from anchor 4
    assert (staged.kind, staged.versions) == ("anchor", [4, 5])
    follower.apply(staged)
    assert follower.fingerprint == publisher.fingerprint and follower.verify()
