"""Publisher -> bucket -> receiver stays bit-exact, and receivers catch up from anchors."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import small_transformer, train_step

from deltasync import (
    ConfigError,
    DeltaPublisher,
    PublishOptions,
    DeltaReceiver,
    VersionError,
    bf16_state_dict,
    fingerprint,
    open_store,
)


def assert_same(receiver: DeltaReceiver, model: torch.nn.Module) -> None:
    want = bf16_state_dict(model)
    got = receiver.state_dict()
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name
    assert receiver.fingerprint == fingerprint(want)


@pytest.mark.parametrize("codec", ["zstd", "raw"])
@pytest.mark.parametrize("publish_every", [1, 3])
def test_receiver_is_bit_exact_after_every_sync(tmp_path, codec: str, publish_every: int) -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    publisher = DeltaPublisher(tmp_path / "bucket", model, opt, codec=codec, anchor_every=10, anchor_bytes_ratio=0)
    receiver = DeltaReceiver(tmp_path / "bucket")
    kinds, scheduled = [], []
    result = publisher.publish()
    assert (result.version, result.kind) == (0, "anchor")
    assert receiver.sync() == 0
    assert_same(receiver, model)
    for step in range(1, 52):
        train_step(model, opt, seed=step)
        if step % publish_every:
            continue
        result = publisher.publish()
        kinds.append(result.kind)
        if result.anchor_scheduled:
            scheduled.append(result.version)
        assert result.total == sum(p.numel() for p in model.parameters())
        staged = receiver.stage()
        assert staged.kind == "delta" and staged.versions == [result.version]  # a follower reads deltas only
        receiver.apply(staged)
        assert receiver.version == result.version == publisher.version
        assert_same(receiver, model)
        assert receiver.fingerprint == result.fingerprint
    # Every version after the first has a delta; anchors are written beside some of them.
    assert set(kinds) == {"delta"} and scheduled and scheduled[0] == 10
    publisher.flush()
    pointer = receiver.pointer()
    assert [a.version for a in pointer.anchors] == scheduled[-1:]
    late = DeltaReceiver(tmp_path / "bucket")  # starts from the newest anchor, exact too
    staged = late.stage()
    assert staged.kind == "anchor" and staged.versions == list(range(scheduled[-1], publisher.version + 1))
    late.apply(staged)
    assert_same(late, model)
    deltas = [json.loads(line) for line in open_store(tmp_path / "bucket").read_bytes("history.jsonl").splitlines()]
    assert [d["version"] for d in deltas] == list(range(publisher.version + 1))
    assert [d["version"] for d in deltas if "anchor_nbytes" in d] == [0, *scheduled]
    publisher.close()


def test_late_receiver_and_skipped_versions_catch_up(tmp_path) -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    publisher = DeltaPublisher(tmp_path / "b", model, opt, anchor_every=4, anchor_bytes_ratio=0)
    follower = DeltaReceiver(tmp_path / "b")
    skipper = DeltaReceiver(tmp_path / "b")
    publisher.publish()
    follower.sync()
    skipper.sync()
    for step in range(1, 11):
        train_step(model, opt, seed=step)
        publisher.publish()
        follower.sync()
        if step == 2:
            skipper.sync()  # then misses versions 3..9, across the anchors at 4 and 8
        publisher.flush()  # each anchor commits before the next one is due
    assert publisher.version == 10
    assert ([a.version for a in publisher.pointer.anchors], publisher.pointer.base) == ([8], 4)
    assert open_store(tmp_path / "b").list("anchors/") == ["anchors/00000008.safetensors"]
    staged = skipper.stage()
    assert staged.kind == "anchor" and staged.versions == [8, 9, 10]
    skipper.apply(staged)
    late = DeltaReceiver(tmp_path / "b")
    assert late.sync() == 10
    for receiver in (follower, skipper, late):
        assert receiver.version == 10
        assert_same(receiver, model)
    # a receiver whose state went wrong repairs itself from the anchor: first one whose
    # fingerprint disagrees with the bucket's ...
    name = "model.embed_tokens.weight"
    follower._state[name].view(-1)[0] += 1  # noqa: SLF001  (simulate a corrupted copy)
    assert not follower.verify()
    follower._fingerprint = fingerprint(follower._state)  # noqa: SLF001
    train_step(model, opt, seed=99)
    publisher.publish()
    assert follower.stage().kind == "anchor"
    follower.sync()
    assert_same(follower, model)
    assert follower.verify()
    # ... then one whose copy went wrong where the next delta changes it: the replay fails its
    # fingerprint check and the receiver starts again from the anchor
    for seed in (100, 101):
        train_step(model, opt, seed=seed)
        publisher.publish()
        follower.sync()
    train_step(model, opt, seed=102)
    assert publisher.publish().kind == "delta"
    touched = follower.stage()._patches[name].index[0]  # noqa: SLF001
    follower._state[name].view(-1)[touched] += 1  # noqa: SLF001
    staged = follower.stage()
    assert staged.kind == "anchor"
    follower.apply(staged)
    assert_same(follower, model)


def test_sync_to_a_given_version_and_version_errors(tmp_path) -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    publisher = DeltaPublisher(tmp_path / "b", model, opt, anchor_bytes_ratio=0)
    receiver = DeltaReceiver(tmp_path / "b")
    with pytest.raises(VersionError, match="no version is committed"):
        receiver.sync()
    states = []
    for step in range(4):
        if step:
            train_step(model, opt, seed=step)
        publisher.publish()
        states.append(fingerprint(bf16_state_dict(model)))
    assert receiver.sync(2) == 2 and receiver.fingerprint == states[2]
    with pytest.raises(VersionError, match=r"version 7 is not committed in file://.*/b \(the newest is 3\)"):
        receiver.sync(7)
    with pytest.raises(VersionError, match="older than the receiver's version 2"):
        receiver.sync(1)
    with pytest.raises(VersionError, match="non-negative integer"):
        receiver.sync(-1)
    assert receiver.version == 2 and receiver.fingerprint == states[2]
    assert receiver.stage(2).kind == "none"
    assert receiver.sync() == 3 and receiver.fingerprint == states[3]


def test_staged_update_is_two_phase(tmp_path) -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    publisher = DeltaPublisher(tmp_path / "b", model, opt, anchor_bytes_ratio=0)
    receiver = DeltaReceiver(tmp_path / "b")
    publisher.publish()
    receiver.sync()
    before = {k: v.clone() for k, v in receiver.state_dict().items()}
    train_step(model, opt, seed=1)
    publisher.publish()
    train_step(model, opt, seed=2)
    publisher.publish()
    staged = receiver.stage()
    assert staged.kind == "delta" and staged.versions == [1, 2]
    want = bf16_state_dict(model)
    for name, tensor in staged.tensors():
        assert torch.equal(tensor.view(torch.int16), want[name].view(torch.int16))
    assert receiver.version == 0  # nothing applied yet
    assert all(torch.equal(before[k], v) for k, v in receiver.state_dict().items())
    other = receiver.stage()
    changed = receiver.apply(staged)
    assert set(changed) == set(staged.names) and receiver.version == 2
    with pytest.raises(VersionError, match="stage it again"):
        receiver.apply(other)  # staged from version 0, the receiver moved on


def test_restarted_publisher_continues_numbering_with_an_anchor(tmp_path) -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    first = DeltaPublisher(tmp_path / "b", model, opt)
    first.publish()
    train_step(model, opt, seed=1)
    first.publish()
    first.close()
    second = DeltaPublisher(tmp_path / "b", model, opt)
    assert second.version == 1
    result = second.publish()
    assert (result.version, result.kind) == (2, "anchor")
    receiver = DeltaReceiver(tmp_path / "b")
    receiver.sync()
    assert_same(receiver, model)


def test_adaptive_anchor_bounds_catch_up_bytes(tmp_path) -> None:
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # dense changes: deltas are big
    publisher = DeltaPublisher(tmp_path / "b", model, opt, anchor_every=100, anchor_bytes_ratio=0.5)
    results = [publisher.publish()]
    for step in range(1, 8):
        train_step(model, opt, seed=step)
        results.append(publisher.publish())
        publisher.flush()  # an anchor in flight would delay the next one
    anchor_bytes = results[0].nbytes
    assert results[0].kind == "anchor" and {r.kind for r in results[1:]} == {"delta"}
    assert sum(r.anchor_scheduled for r in results) >= 2
    since = 0
    for r in results[1:]:
        since = 0 if r.anchor_scheduled else since + r.nbytes
        assert since <= 0.5 * anchor_bytes
    # A late joiner downloads the newest anchor and the deltas after it: at most 1.5 anchors.
    staged = DeltaReceiver(tmp_path / "b").stage()
    assert staged.kind == "anchor" and staged.versions[0] == publisher.pointer.anchor
    assert staged.nbytes <= 1.5 * anchor_bytes


def test_frozen_parameters_are_in_anchors_not_deltas(tmp_path) -> None:
    model = small_transformer()
    model.model.norm.weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    publisher = DeltaPublisher(tmp_path / "b", model, opt, codec="raw", anchor_bytes_ratio=0)
    publisher.publish()
    receiver = DeltaReceiver(tmp_path / "b")
    receiver.sync()
    assert "model.norm.weight" in receiver.state_dict()
    train_step(model, opt, seed=1)
    publisher.publish()
    staged = receiver.stage()
    assert "model.norm.weight" not in staged.names
    receiver.apply(staged)
    assert_same(receiver, model)


def test_options_are_validated(tmp_path) -> None:
    model = small_transformer()
    with pytest.raises(ConfigError, match="codec 'gzip' is unknown; choose one of raw, zstd"):
        DeltaPublisher(tmp_path, model, codec="gzip")
    with pytest.raises(ConfigError, match="zstd_level=9 is set but codec is 'raw'"):
        DeltaPublisher(tmp_path, model, codec="raw", zstd_level=9)
    with pytest.raises(ConfigError, match="anchor_every must be >= 1"):
        DeltaPublisher(tmp_path, model, anchor_every=0)
    with pytest.raises(TypeError, match="unknown publish option.* anchor_evry; PublishOptions has anchor_every, "):
        DeltaPublisher(tmp_path, model, anchor_evry=3)
    with pytest.raises(ConfigError, match="options must be a PublishOptions, got dict"):
        DeltaPublisher(tmp_path, model, options={"anchor_every": 3})
    # typed options, and single fields on top of them
    publisher = DeltaPublisher(tmp_path, model, options=PublishOptions(anchor_every=3, codec="raw"), anchor_bytes_ratio=0)
    assert publisher.options == PublishOptions(anchor_every=3, codec="raw", anchor_bytes_ratio=0)
    publisher.close()
