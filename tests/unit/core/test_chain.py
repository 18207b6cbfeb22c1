"""The chain reader: a pointer's versions fetched, checked and decoded over an overlay.

Its consumers (the receiver here; the in-place state and the adapter sync in
tests/unit/vllm_ext/test_chain_consumers.py) check only what is theirs; these tests hold the
reader to its part: what it yields is what was published, bit for bit, and a bad file is
refused naming it, before any of its values reach the overlay."""

from __future__ import annotations

import pytest
import torch
from helpers import checkpoint_model, edit_bits, publish_chain, replace_file, same_state

from deltasync import DeltaPublisher, DeltaReceiver, IntegrityError, VersionError, fingerprint, open_store
from deltasync.reader.chain import ChainReader, Overlay, bits, read_pointer

SHAPES = {"a.weight": (8, 6), "b.weight": (7,)}


@pytest.fixture
def chain(tmp_path):
    states = publish_chain(tmp_path / "bucket", checkpoint_model(SHAPES), deltas=3)
    store = open_store(tmp_path / "bucket")
    return store, states


def host_overlay(state: dict[str, torch.Tensor]) -> Overlay:
    return Overlay(lambda name, index: (None, bits(state[name].view(-1))[index]))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_the_reader_replays_what_was_published_bit_for_bit(tmp_path, codec) -> None:
    states = publish_chain(tmp_path / "b", checkpoint_model(SHAPES), deltas=3, codec=codec)
    store = open_store(tmp_path / "b")
    reader = ChainReader(store, read_pointer(store))
    assert reader.target(None) == 3
    anchor = reader.anchor(reader.pointer.anchors[0])
    assert same_state(anchor.tensors, states[0]) and anchor.header.fingerprint == fingerprint(states[0])
    overlay = host_overlay(anchor.tensors)
    for step in reader.deltas(1, 3, overlay, numels={n: t.numel() for n, t in anchor.tensors.items()}):
        assert step.header.version == step.entry.version and step.nbytes == step.entry.nbytes
        # What each version moves is what the publisher changed, old values included.
        before, after = states[step.entry.version - 1], states[step.entry.version]
        for name, move in step.moves.items():
            assert torch.equal(move.old, bits(before[name].view(-1))[move.index])
            assert torch.equal(move.new, bits(after[name].view(-1))[move.index])
            assert move.changed == move.index.numel()
    replayed = {n: t.clone() for n, t in anchor.tensors.items()}
    for name, patch in overlay.patches.items():
        patch.write(replayed[name].view(-1))
    assert same_state(replayed, states[3])


def test_a_reader_that_holds_some_elements_decodes_and_patches_only_those(chain) -> None:
    store, states = chain
    reader = ChainReader(store, read_pointer(store))
    held = {name: torch.arange(0, t.numel(), 2) for name, t in states[0].items()}  # every other element

    def base(name: str, index: torch.Tensor):
        pos = torch.nonzero(torch.isin(index, held[name])).reshape(-1)
        return pos, bits(states[0][name].view(-1))[index[pos]]

    overlay = Overlay(base)
    for step in reader.deltas(1, 3, overlay, numels={n: t.numel() for n, t in states[0].items()}):
        for name, move in step.moves.items():
            assert bool(torch.isin(move.index, held[name]).all())
            assert move.changed >= move.index.numel()
    for name, patch in overlay.patches.items():
        assert bool(torch.isin(patch.index, held[name]).all())
        # zstd codes new values against the old: the held ones decode exactly over a partial base.
        assert torch.equal(patch.bits, bits(states[3][name].view(-1))[patch.index])


def test_a_tampered_delta_is_refused_naming_it_before_its_values_reach_the_overlay(chain) -> None:
    store, states = chain
    data = bytearray(store.read_bytes("deltas/00000002.safetensors"))
    data[-3] ^= 0x10
    replace_file(store, 2, bytes(data), fix_pointer=False)
    reader = ChainReader(store, read_pointer(store))
    overlay = host_overlay(states[0])
    seen = []
    with pytest.raises(IntegrityError, match=r"deltas/00000002.safetensors \(version 2\): SHA-256 .* \(corrupted or tampered\)"):
        for step in reader.deltas(1, 3, overlay, numels={n: t.numel() for n, t in states[0].items()}):
            seen.append(step.entry.version)
    assert seen == [1]
    for name, patch in overlay.patches.items():  # version 1's values only
        assert torch.equal(patch.bits, bits(states[1][name].view(-1))[patch.index])


def test_a_header_the_pointer_does_not_list_is_refused(chain) -> None:
    store, states = chain
    # Delta 3's file served as delta 2 (pointer rewritten to its size and digest).
    replace_file(store, 2, store.read_bytes("deltas/00000003.safetensors"))
    reader = ChainReader(store, read_pointer(store))
    with pytest.raises(VersionError, match=r"version 2\): the file is version 3, the pointer lists it as 2"):
        list(reader.deltas(1, 3, host_overlay(states[0]), numels={n: t.numel() for n, t in states[0].items()}))
    # Without the state before it (a delta only followers replay), as far as it can be checked.
    assert reader.check_files(1) == reader.pointer.delta(1).nbytes
    with pytest.raises(VersionError, match=r"version 2\): the file is version 3, the pointer lists it as 2"):
        reader.check_files(2)
    with pytest.raises(VersionError, match="version 4 is not committed in .* \\(the newest is 3\\)"):
        reader.target(4)


def test_anchor_metadata_comes_from_the_checked_read_of_the_anchor(tmp_path) -> None:
    model = checkpoint_model(SHAPES)
    publisher = DeltaPublisher(tmp_path / "b", model, anchor_bytes_ratio=0)
    publisher.anchor_metadata = {"x-note": "written with the anchor"}
    publisher.publish()
    edit_bits(model, 1)
    publisher.publish()
    publisher.close()
    receiver = DeltaReceiver(tmp_path / "b")
    staged = receiver.stage(0)
    assert staged.kind == "anchor" and staged.anchor_metadata == {"x-note": "written with the anchor"}
    receiver.apply(staged)
    assert receiver.stage().anchor_metadata == {}  # a delta on the receiver's own state
    # The metadata is covered by the pointer's digest: an edited anchor is refused as a whole.
    store = open_store(tmp_path / "b")
    data = store.read_bytes("anchors/00000000.safetensors")
    replace_file(store, 0, data.replace(b"written with the anchor", b"written by someone else"), kind="anchor", fix_pointer=False)
    with pytest.raises(IntegrityError, match=r"anchors/00000000.safetensors \(version 0\): SHA-256"):
        DeltaReceiver(tmp_path / "b").stage(0)


def test_an_anchor_of_another_state_is_refused_by_the_pointers_fingerprint(tmp_path) -> None:
    publish_chain(tmp_path / "b", checkpoint_model(SHAPES), deltas=1)
    other = tmp_path / "other"
    publish_chain(other, checkpoint_model(SHAPES, seed=1), deltas=0)
    store = open_store(tmp_path / "b")
    anchor = open_store(other).read_bytes("anchors/00000000.safetensors")
    replace_file(store, 0, anchor, kind="anchor")  # the pointer rewritten to match the file
    reader = ChainReader(store, read_pointer(store))
    with pytest.raises(IntegrityError, match=r"anchors/00000000.safetensors \(version 0\): fingerprint \w+ in the file"):
        reader.anchor(reader.pointer.anchors[0])


@pytest.mark.parametrize("seed", range(6))
def test_a_patch_merges_later_changes_as_a_dense_replay_would(seed) -> None:
    """Merging sorted changes into a patch gives exactly the last value written at each element,
    on random overlapping sets (empty ones, disjoint ones, full overlaps), and leaves the merged
    tensors as they were."""
    from deltasync.reader.chain import Patch

    g = torch.Generator().manual_seed(seed)
    size = 200
    dense = torch.zeros(size, dtype=torch.int16)
    written = torch.zeros(size, dtype=torch.bool)
    patch = Patch()
    for step in range(6):
        k = [0, size, 1, 50, 120, 7][(step + seed) % 6]
        index = torch.randperm(size, generator=g)[:k].sort().values
        values = torch.randint(-(1 << 15), 1 << 15, (k,), generator=g, dtype=torch.int16)
        held = (index.clone(), values.clone())
        patch.merge(index, values)
        assert torch.equal(index, held[0]) and torch.equal(values, held[1])
        dense[index], written[index] = values, True
        want = written.nonzero().squeeze(1)
        assert torch.equal(patch.index, want), step
        assert torch.equal(patch.bits, dense[want]), step
