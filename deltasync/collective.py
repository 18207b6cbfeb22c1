"""Processes agreeing with each other: every rank's small outcome, and the failures among them.

One definition for both sides: the trainer's ranks agree before a version is committed
(:meth:`deltasync.trainer.sharded.ShardLayout.agree`), and the workers of a vLLM engine agree before
any of them touches its model (``vllm_ext._ranks``). Objects go over the groups' CPU side
(``all_gather_object``): they must be small and picklable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

__all__ = ["failures", "gather_objects"]

T = TypeVar("T")


def gather_objects(value: T, groups: Sequence[tuple[Any, int]]) -> list[T]:
    """``value`` of every rank of the product of ``groups`` (pairs of a process group, None
    for the default one, and its size), the same list on every rank, ordered with the rank in
    the first group varying fastest. A group of size 1 exchanges nothing."""
    items: list[Any] = [value]
    for group, size in groups:
        if size > 1:
            import torch.distributed as dist

            out: list[Any] = [None] * size
            dist.all_gather_object(out, items, group=group)
            items = [x for sub in out for x in sub]
    return items


def failures(errors: Sequence[str | None]) -> list[tuple[int, str]]:
    """``(rank, error)`` of every rank that reported an error, in rank order."""
    return [(rank, error) for rank, error in enumerate(errors) if error is not None]
