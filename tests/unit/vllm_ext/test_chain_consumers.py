"""One chain, read by its three consumers through the one chain reader, gives each the same
weights: the receiver's host copy, the live weights of two tensor-parallel ranks patched in
place (each decoding only the elements it holds), and the adapter sync's staged adapter. A
tampered file is refused by each with the same error, and changes nothing.

The ranks run in threads of this process, their collectives a gather over a barrier; the
served model is the toy model of ``tests/toy_model.py`` (fused, sharded, padded and
transformed parameters)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import checkpoint_model, publish_chain, replace_file, same_state
from servers import requires_vllm
from toy_model import SHAPES, ToyModel

from deltasync import DeltaReceiver, IntegrityError, fingerprint, open_store
from deltasync.reader.chain import ChainReader, read_pointer
from deltasync.trainer.lora import ADAPTER_CONFIG_KEY, BASE_FINGERPRINT_KEY

pytestmark = requires_vllm

WORLD = 2
CONFIG = {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}
META = {ADAPTER_CONFIG_KEY: json.dumps(CONFIG), BASE_FINGERPRINT_KEY: "0123456789abcdef"}


class Group:
    """``WORLD`` ranks in threads: ``gather(rank)`` is their all-gather."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(WORLD, timeout=60)
        self.slots: list[Any] = [None] * WORLD

    def gather(self, rank: int) -> Callable[[Any], list[Any]]:
        def gather(obj: Any) -> list[Any]:
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out

        return gather


def on_ranks(fn: Callable[[int], Any]) -> list[Any]:
    """``fn(rank)`` on every rank at once; the first error is raised here."""
    results: list[Any] = [None] * WORLD
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001  (re-raised below)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


class Ranks:
    """The in-place state of every rank, at the bucket's anchor 0."""

    def __init__(self, anchor: dict[str, torch.Tensor]) -> None:
        from deltasync.server.inplace import InPlaceState
        from deltasync.server.weight_map import discover

        group = Group()
        self.models = [ToyModel(rank, WORLD) for rank in range(WORLD)]

        def start(rank: int) -> InPlaceState:
            model = self.models[rank]
            wmap = discover(model, SHAPES)
            assert list(wmap.fallback) == ["norm.weight"]  # patched on the host, reloaded through the loader
            live = InPlaceState(model, wmap, group.gather(rank), rank, model.load_weights,
                                host={"norm.weight": SHAPES["norm.weight"]}, reload=model.load_weights)  # fmt: skip
            live.load_anchor(iter(anchor.items()))
            live.commit(0, live.full_fingerprint())
            return live

        self.live = on_ranks(start)

    def update(self, reader: ChainReader, target: int) -> str:
        """Stage on every rank, check the fingerprint over the ranks, write; the fingerprint."""
        staged = on_ranks(lambda rank: self.live[rank].stage_deltas(reader, target))
        shares = [s.shares for s in staged]
        fps = {live.check_chain(s, shares) for live, s in zip(self.live, staged)}
        assert len(fps) == 1
        fp = fps.pop()
        for live, s in zip(self.live, staged):
            live.write(s)
            live.commit(target, fp)
        return fp

    def served(self) -> list[dict[str, torch.Tensor]]:
        return [{n: p.detach().clone() for n, p in model.named_parameters()} for model in self.models]


def loaded(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """What each rank's model holds after its loader reads ``state``."""
    out = []
    for rank in range(WORLD):
        model = ToyModel(rank, WORLD)
        model.load_weights(state.items())
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.fixture
def bucket(tmp_path):
    """Anchor 0, deltas 1..3 (zstd: new values coded against the old), an anchor beside
    version 2, and the adapter metadata in every anchor."""
    model = checkpoint_model(SHAPES)
    states = publish_chain(tmp_path / "b", model, deltas=3, anchor_at=2, metadata=META)
    return tmp_path / "b", states


def test_one_chain_read_gives_every_consumer_the_same_weights(bucket) -> None:
    from vllm_ext._lora import stage_adapter

    path, states = bucket
    store = open_store(path)
    reader = ChainReader(store, read_pointer(store))
    assert [a.version for a in reader.pointer.anchors] == [0, 2]
    # The host copy: a fresh receiver loads anchor 2 and replays delta 3; one at version 0
    # replays deltas 1..3.
    fresh = DeltaReceiver(path)
    assert fresh.sync() == 3 and fresh.verify()
    follower = DeltaReceiver(path)
    follower.sync(0)
    follower.sync()
    assert same_state(fresh.state_dict(), states[3]) and same_state(follower.state_dict(), states[3])
    # The live weights: deltas 1..3 on each rank's shard, from version 0.
    ranks = Ranks(states[0])
    assert ranks.update(reader, 3) == fresh.fingerprint == reader.pointer.fingerprint
    served = ranks.served()
    for rank, expected in enumerate(loaded(states[3])):
        assert same_state(served[rank], expected), rank
    assert on_ranks(lambda rank: ranks.live[rank].verify()["ok"]) == [True] * WORLD
    # The adapter sync: anchor 2 and delta 3, with the anchor's metadata.
    staged, state, config, base, anchor_meta, receiver = stage_adapter(str(path), None, None, 3)
    assert (staged.kind, staged.versions) == ("anchor", [2, 3])
    assert same_state(state, states[3]) and config == CONFIG and base == META[BASE_FINGERPRINT_KEY]
    assert anchor_meta == (0, META) and staged.fingerprint == fresh.fingerprint
    receiver.apply(staged)
    assert fingerprint(receiver.state_dict()) == fresh.fingerprint


def test_a_tampered_delta_is_refused_alike_by_every_consumer_and_changes_nothing(bucket) -> None:
    from vllm_ext._lora import stage_adapter

    path, states = bucket
    store = open_store(path)
    receiver = DeltaReceiver(path)
    receiver.sync(1)
    adapter = stage_adapter(str(path), None, None, 1)
    adapter[5].apply(adapter[0])
    ranks = Ranks(states[0])
    ranks.update(ChainReader(store, read_pointer(store)), 1)
    before = ranks.served()
    data = bytearray(store.read_bytes("deltas/00000003.safetensors"))
    data[len(data) // 2] ^= 0x01
    replace_file(store, 3, bytes(data), fix_pointer=False)
    reader = ChainReader(store, read_pointer(store))
    message = r"deltas/00000003.safetensors \(version 3\): SHA-256 .* \(corrupted or tampered\)"
    with pytest.raises(IntegrityError, match=message):
        receiver.sync()
    assert receiver.version == 1 and same_state(receiver.state_dict(), states[1])
    with pytest.raises(IntegrityError, match=message):
        stage_adapter(str(path), adapter[5], adapter[4], 3)
    with pytest.raises(IntegrityError, match=message):
        on_ranks(lambda rank: ranks.live[rank].stage_deltas(reader, 3))
    served = ranks.served()
    assert all(same_state(served[rank], before[rank]) for rank in range(WORLD))
    assert {live.version for live in ranks.live} == {1}
    # Up to version 2 the chain is sound: every consumer still gets there.
    assert ranks.update(reader, 2) == reader.pointer.fingerprint_at(2)
    assert receiver.sync(2) == 2 and same_state(receiver.state_dict(), states[2])


@pytest.mark.parametrize("target", [1, 3])
def test_the_undo_log_is_what_the_live_weights_hold_and_rolls_back_exactly(bucket, target) -> None:
    # One delta takes its undo log from the values its staging read (no second read); several
    # read it after the replay. Either way: the bits there now, written back exactly.
    path, states = bucket
    store = open_store(path)
    reader = ChainReader(store, read_pointer(store))
    ranks = Ranks(states[0])
    before = ranks.served()
    staged = on_ranks(lambda rank: ranks.live[rank].stage_deltas(reader, target))
    for live, s in zip(ranks.live, staged):
        assert s.writes
        for param, w in s.writes.items():
            assert torch.equal(w.old, live.flat[param].read(w.dst)), param
            assert not torch.equal(w.old, w.bits), param
        live.rollback(live.write(s))
    for rank, served in enumerate(ranks.served()):
        assert same_state(served, before[rank]), rank
    assert on_ranks(lambda rank: ranks.live[rank].verify()["ok"]) == [True] * WORLD
