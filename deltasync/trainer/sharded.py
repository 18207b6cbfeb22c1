"""Several trainer processes: which elements each rank owns, and the collectives of a publish.

A model trained by several processes is one of:

- FSDP2 (``fully_shard``): parameters are DTensors placed ``Shard(0)`` on a 1-D mesh. Rank
  ``r`` of the mesh owns its local rows, a contiguous flat range of each parameter, and
  writes part ``r`` of every version.
- HSDP: DTensors placed ``(Replicate(), Shard(0))`` on a 2-D mesh. The replica group whose
  replicate coordinate is 0 writes, one part per shard rank; the other replicas hold copies.
- DDP or any replicated layout (plain tensors, ``torch.distributed`` initialised with several
  ranks): rank 0 owns everything and writes a single file.

Plain (non-DTensor) parameters next to DTensors are replicated: part 0's writer owns them.
Layouts whose ranks do not own disjoint flat ranges are refused with a :class:`ConfigError`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..collective import failures, gather_objects
from ..errors import ConfigError, PublishError

__all__ = ["ShardLayout", "OwnedSlice", "shard_layout", "solo_layout", "check_not_zero3"]

T = TypeVar("T")


@dataclass(frozen=True)
class OwnedSlice:
    """The flat elements ``begin .. end - 1`` of a parameter that this rank owns and writes."""

    shape: tuple[int, ...]
    """The full parameter's shape."""
    begin: int
    end: int
    sharded: bool
    """The parameter is a DTensor: its owned elements are its local shard (``to_local()``)."""

    @property
    def numel(self) -> int:
        """Elements of the full parameter."""
        return math.prod(self.shape)

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """The owned elements, flat, as a view of the rank's own memory (never a gather)."""
        if self.end == self.begin:
            return torch.empty(0, dtype=param.dtype, device=_local_tensor(param).device)
        tensor = _local_tensor(param).detach()
        return tensor.reshape(-1) if self.sharded else tensor.reshape(-1)[self.begin : self.end]


@dataclass(frozen=True)
class ShardLayout:
    """How the processes of a training job split the writing of a version."""

    rank: int
    world: int
    writer: bool
    """This rank writes a file of each version."""
    part: int
    """The writer's part number (0 on ranks that do not write)."""
    parts: int
    """Files per version: 1 (a single-file version, format version 1) or one per shard rank."""
    description: str
    """What was found, e.g. "FSDP2, 3 shards" or "DDP, 2 replicas"."""
    slices: dict[str, OwnedSlice]
    """Checkpoint name -> what this rank owns of it (empty ranges included)."""

    # -------------------------------------------------------------- collectives

    def all_gather(self, value: T, group: Any = None) -> list[T]:
        """Every rank's ``value`` (over ``group``, default the default process group)."""
        return gather_objects(value, [(group, self.world)])

    def from_rank0(self, value: T) -> T:
        if self.world == 1:
            return value
        import torch.distributed as dist

        box: list[Any] = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, what: str, step: Callable[[], T], group: Any = None) -> tuple[T, list[Any]]:
        """Run ``step`` on this rank and learn every rank's outcome; if any failed, all raise.

        Returns this rank's result and every rank's second tuple element (``step`` returns
        ``(result, shared)``; ``shared`` must be small and picklable). ``group``: the process
        group to agree over (a background thread needs one of its own); in a world of one
        nothing is exchanged and a failure raises as it is.
        """
        if self.world == 1:
            result, shared = step()  # type: ignore[misc]
            return result, [shared]  # type: ignore[has-type]
        try:
            result, shared = step()  # type: ignore[misc]
            error = None
        except Exception as exc:  # noqa: BLE001 - every rank must learn about any failure
            result, shared, error, caught = None, None, f"{type(exc).__name__}: {exc}", exc
        outcomes = self.all_gather((error, shared), group)
        failed = failures([e for e, _ in outcomes])
        if failed:
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
            message = f"{what} failed on {len(failed)} of {self.world} ranks, nothing was committed ({detail})"
            if error is not None:
                raise PublishError(message) from caught
            raise PublishError(message)
        return result, [s for _, s in outcomes]  # type: ignore[return-value]

    def new_group(self) -> Any:
        """A process group of its own for a background thread's collectives (collective: every
        rank calls it, in the same order); None in a world of one."""
        if self.world == 1:
            return None
        import torch.distributed as dist

        return dist.new_group(backend="gloo")

    @staticmethod
    def release_group(group: Any) -> None:
        """Shut down a group from :meth:`new_group` (local; its threads end now, not while the
        interpreter exits). A group already gone with the default one is left alone."""
        if group is None:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group(group)
            except ValueError:  # destroyed with the world group already
                pass


def solo_layout(named: Sequence[tuple[str, torch.Tensor]]) -> ShardLayout:
    """The layout of a single process: a world of one that owns and writes everything."""
    slices = {n: OwnedSlice(tuple(p.shape), 0, p.numel(), False) for n, p in named}
    return ShardLayout(rank=0, world=1, writer=True, part=0, parts=1, description="one process", slices=slices)


def _local_tensor(param: torch.Tensor) -> torch.Tensor:
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


def check_not_zero3(model: torch.nn.Module) -> None:
    """DeepSpeed ZeRO-3 parameters are empty placeholders with a flat ``ds_tensor`` partition
    whose layout deltasync cannot map to checkpoint coordinates: refuse them by name."""
    for name, param in model.named_parameters():
        if hasattr(param, "ds_tensor") or hasattr(param, "ds_id"):
            raise ConfigError(
                f"parameter {name!r} is a DeepSpeed ZeRO-3 partitioned parameter (it has "
                f"{'ds_tensor' if hasattr(param, 'ds_tensor') else 'ds_id'}); deltasync supports FSDP2 "
                "(fully_shard), HSDP and DDP. Train with FSDP2, or with ZeRO stage 1 or 2"
            )


def shard_layout(named: Sequence[tuple[str, torch.Tensor]]) -> ShardLayout | None:
    """The layout of checkpoint-named parameters, or None for a single process."""
    import torch.distributed as dist

    # No parameter can be a DTensor before torch.distributed.tensor is imported: a single
    # process does not pay for that import (about 40 MiB, sympy included).
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    dtensors = [] if dtensor_module is None else [(n, p) for n, p in named if isinstance(p, dtensor_module.DTensor)]
    distributed = dist.is_available() and dist.is_initialized()
    if not dtensors and (not distributed or dist.get_world_size() == 1):
        return None
    if not distributed:  # pragma: no cover - a DTensor needs an initialised process group
        raise ConfigError("the model has DTensor parameters but torch.distributed is not initialised")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not dtensors:
        slices = {n: OwnedSlice(tuple(p.shape), 0, p.numel() if rank == 0 else 0, False) for n, p in named}
        return ShardLayout(
            rank=rank, world=world, writer=rank == 0, part=0, parts=1,
            description=f"replicated (DDP), {world} ranks", slices=slices,
        )

    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = dtensors[0][1].device_mesh
    for name, param in dtensors:
        placements = tuple(param.placements)
        sharded_rows = type(placements[-1]) is Shard and placements[-1].dim == 0
        replicated = all(type(p) is Replicate for p in placements[:-1])
        if not (sharded_rows and replicated and len(placements) <= 2):
            raise ConfigError(
                f"parameter {name!r} is placed {list(map(str, placements))} on a mesh of shape "
                f"{tuple(param.device_mesh.shape)}; deltasync supports Shard(0) (FSDP2) and "
                "[Replicate(), Shard(0)] (HSDP) placements. Tensor-parallel or strided shards are not "
                "supported yet: keep tensor parallelism out of the trainer, or sync with TRL's own weight transfer"
            )
        if param.device_mesh != mesh:
            raise ConfigError(
                f"parameter {name!r} lives on another device mesh than {dtensors[0][0]!r}; deltasync needs "
                "every sharded parameter on one mesh"
            )
    if mesh.size() != world:
        raise ConfigError(
            f"the device mesh has {mesh.size()} ranks but the process group has {world}; publish() is "
            "collective over the default process group, so the mesh must span all of it"
        )
    shard_rank = mesh.get_local_rank(mesh_dim=mesh.ndim - 1)
    replica = mesh.get_local_rank(mesh_dim=0) if mesh.ndim == 2 else 0
    parts = mesh.size(mesh.ndim - 1)
    writer = replica == 0
    slices = {}
    for name, param in named:
        if isinstance(param, DTensor):
            shape = tuple(param.shape)
            local_shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
            row = math.prod(shape[1:])
            begin = offset[0] * row if shape else 0
            end = begin + math.prod(local_shape)
            if not writer:
                begin = end = 0
            slices[name] = OwnedSlice(shape, begin, end, True)
        else:
            owns = writer and shard_rank == 0
            slices[name] = OwnedSlice(tuple(param.shape), 0, param.numel() if owns else 0, False)
    kind = f"HSDP, {mesh.size(0)} replicas x {parts} shards" if mesh.ndim == 2 else f"FSDP2, {parts} shards"
    return ShardLayout(
        rank=rank, world=world, writer=writer, part=shard_rank if writer else 0, parts=parts,
        description=kind, slices=slices,
    )
