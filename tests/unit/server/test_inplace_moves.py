"""The in-place stage's fingerprint move over many tensors (deltasync/server/inplace.py,
``_share_moves``): the small moves are hashed together in the staging thread while the large ones
are hashed in the decode threads, and the sum is the bucket's."""

from __future__ import annotations

import threading

import torch
from torch import nn

import deltasync.server.inplace as inplace
from deltasync import DeltaPublisher
from deltasync.reader.chain import ChainReader, read_pointer
from deltasync.server.weight_map import discover
from deltasync.stores import LocalStore


class Weights(nn.Module):
    """bf16 parameters under checkpoint names, loaded as a vLLM loader loads unfused ones."""

    def __init__(self, named: dict[str, torch.Tensor], *, trainable: bool = False) -> None:
        super().__init__()
        self.names = list(named)
        for k, t in enumerate(named.values()):
            self.register_parameter(f"p{k}", nn.Parameter(t.clone(), requires_grad=trainable))

    def named_parameters(self, *args, **kwargs):  # type: ignore[override]
        return ((n, getattr(self, f"p{k}")) for k, n in enumerate(self.names))

    def load_weights(self, weights) -> set[str]:  # type: ignore[no-untyped-def]
        params = dict(self.named_parameters())
        for name, w in weights:
            params[name].data.copy_(w)
        return {name for name, _ in weights}


def _live(model, start: dict[str, torch.Tensor]) -> inplace.InPlaceState:  # type: ignore[no-untyped-def]
    """The in-place state of one rank serving ``model`` at version 0 (holding ``start``)."""
    live = inplace.InPlaceState(model, discover(model, {n: tuple(t.shape) for n, t in start.items()}),
                                lambda obj: [obj], 0, model.load_weights)  # fmt: skip
    live.commit(0, live.full_fingerprint())
    return live


def test_small_moves_are_hashed_together_here_and_large_ones_in_the_threads(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DELTASYNC_DECODE_THREADS", "2")
    monkeypatch.setattr(inplace, "SMALL", 2000)  # a move of 2000 changes or more is large
    monkeypatch.setattr(inplace, "_SPREAD_MOVES", 1000)
    g = torch.Generator().manual_seed(0)
    start = {f"big.{k}.weight": torch.randn(64, 125, generator=g).to(torch.bfloat16) for k in range(3)}
    start |= {f"small.{k}.bias": torch.randn(300, generator=g).to(torch.bfloat16) for k in range(200)}
    trainer = Weights(start, trainable=True)
    with DeltaPublisher(tmp_path, trainer, None, anchor_every=1000, anchor_bytes_ratio=0) as publisher:
        publisher.publish()
        with torch.no_grad():
            for name, p in trainer.named_parameters():
                bits = p.view(-1).view(torch.int16)
                share = 0.5 if name.startswith("big") else 0.1
                picked = torch.randperm(bits.numel(), generator=g)[: int(bits.numel() * share)]
                bits[picked] += torch.randint(1, 300, (picked.numel(),), generator=g, dtype=torch.int16)
            # -0.0 and a NaN payload among the small ones.
            trainer.p3.view(torch.int16)[:2] = torch.tensor([-0x8000, 0x7FC1], dtype=torch.int16)
        result = publisher.publish()
    store = LocalStore(tmp_path)
    live_model = Weights(start)
    live = _live(live_model, start)

    hashed: list[tuple[str, str]] = []  # (names, thread)
    batch, one = inplace.fingerprint_moves, inplace.InPlaceState._share_move

    def batch_spy(moves):  # type: ignore[no-untyped-def]
        moves = list(moves)
        hashed.extend((name, threading.current_thread().name) for name, *_ in moves)
        return batch(moves)

    def one_spy(self, name, *args):  # type: ignore[no-untyped-def]
        hashed.append((name, threading.current_thread().name))
        return one(self, name, *args)

    monkeypatch.setattr(inplace, "fingerprint_moves", batch_spy)
    monkeypatch.setattr(inplace.InPlaceState, "_share_move", one_spy)
    staged = live.stage_deltas(ChainReader(store, read_pointer(store)), 1)
    assert live.check_chain(staged, [staged.shares]) == result.fingerprint
    where = dict(hashed)
    assert len(hashed) == len(where) == len(start)  # each once
    assert all(where[n] == "MainThread" for n in start if n.startswith("small"))
    assert all(where[n].startswith("deltasync-move") for n in start if n.startswith("big"))
    live.write(staged)
    for (name, want), got in zip(trainer.named_parameters(), live_model.parameters()):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name


class Fused(nn.Module):
    """Every checkpoint tensor a row of one parameter, as a fused MoE layer holds its experts."""

    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.rows = {name: k for k, name in enumerate(named)}
        self.experts = nn.Parameter(torch.stack(list(named.values())), requires_grad=False)

    def load_weights(self, weights) -> set[str]:  # type: ignore[no-untyped-def]
        for name, w in weights:
            self.experts.data[self.rows[name]].copy_(w)
        return {name for name, _ in weights}


def test_many_names_of_one_parameter_are_joined_once_and_written_exactly(tmp_path) -> None:
    """A delta of every expert of a fused parameter: each name's writes are kept apart while
    staging and joined once (in the parameter's order), and the write is exact, rolled back too."""
    g = torch.Generator().manual_seed(2)
    # Names in checkpoint order (experts.10 before experts.2): the rows they land in are not.
    start = {f"mlp.experts.{e}.weight": torch.randn(40, 25, generator=g).to(torch.bfloat16) for e in range(12)}
    trainer = Weights(start, trainable=True)
    with DeltaPublisher(tmp_path, trainer, None, anchor_every=1000, anchor_bytes_ratio=0) as publisher:
        publisher.publish()
        with torch.no_grad():
            for p in trainer.parameters():
                bits = p.view(-1).view(torch.int16)
                picked = torch.randperm(bits.numel(), generator=g)[:100]
                bits[picked] += torch.randint(1, 9, (100,), generator=g, dtype=torch.int16)
        result = publisher.publish()
    store = LocalStore(tmp_path)
    live_model = Fused(start)
    live = _live(live_model, start)
    before = live_model.experts.detach().clone()
    staged = live.stage_deltas(ChainReader(store, read_pointer(store)), 1)
    assert live.check_chain(staged, [staged.shares]) == result.fingerprint
    (write,) = staged.writes.values()
    assert not write.more and write.dst.numel() == 12 * 100
    assert bool((write.dst[1:] > write.dst[:-1]).all())  # sorted, each element once
    undo = live.write(staged)
    for name, p in trainer.named_parameters():
        assert torch.equal(live_model.experts[live_model.rows[name]].view(torch.int16), p.view(torch.int16)), name
    live.rollback(undo)
    assert torch.equal(live_model.experts.view(torch.int16), before.view(torch.int16))
