"""The one gather and agreement both sides use (trainer ranks, a vLLM engine's workers)."""

from __future__ import annotations

import torch.distributed

from deltasync.collective import failures, gather_objects


def test_gather_orders_ranks_with_the_first_group_fastest(monkeypatch) -> None:
    # This process is rank (tp=1, pp=0) of a 2 x 2 engine; the fake answers what the others hold.
    peers = {"tp": lambda items: [["tp0"], items], "pp": lambda items: [items, ["tp0-pp1", "tp1-pp1"]]}

    def all_gather_object(out, obj, group=None):
        out[:] = peers[group](obj)

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    assert gather_objects("me", [("tp", 2), ("pp", 2)]) == ["tp0", "me", "tp0-pp1", "tp1-pp1"]
    assert gather_objects("me", [("tp", 1), ("pp", 1)]) == ["me"]  # nothing exchanged
    assert gather_objects("me", []) == ["me"]


def test_failures_name_every_failed_rank_in_order() -> None:
    assert failures([None, "b", None, "d"]) == [(1, "b"), (3, "d")]
    assert failures([None, None]) == []
