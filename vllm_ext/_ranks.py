"""The workers of one engine agreeing with each other: every update is all ranks or none.

Each tensor- or pipeline-parallel rank runs its own update; before any rank touches its
model, and again before any rank commits, they exchange their outcomes over the engine's own
process groups (CPU side), so that every rank takes the same decision.
"""

from __future__ import annotations

from typing import Any

from deltasync.collective import failures, gather_objects

__all__ = ["agree", "gather", "is_last_rank", "parallel_groups", "rank_index"]


def parallel_groups() -> list[Any]:
    """This engine's tensor- and pipeline-parallel groups (none in a plain process)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        return [get_tp_group(), get_pp_group()]
    except (ImportError, AssertionError):  # vLLM's distributed state is not initialised
        return []


def is_last_rank() -> bool:
    """Whether this worker answers last in vLLM's executor (rank order: pipeline, then tensor)."""
    return all(group.rank_in_group == group.world_size - 1 for group in parallel_groups())


def rank_index() -> int:
    """This worker's position in :func:`gather`'s answer."""
    index, size = 0, 1
    for group in parallel_groups():
        index += group.rank_in_group * size
        size *= group.world_size
    return index


def gather(obj: Any) -> list[Any]:
    """``obj`` of every worker of this engine, in :func:`rank_index` order (the same list on all)."""
    return gather_objects(obj, [(group.cpu_group, group.world_size) for group in parallel_groups()])


def agree(error: str | None) -> str | None:
    """The first error any worker of this engine reports (the same answer on every worker)."""
    failed = failures(gather(error))
    return failed[0][1] if failed else None
