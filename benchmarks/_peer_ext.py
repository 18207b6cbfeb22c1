"""Benchmark only: vLLM's own sparse path as a peer of deltasync's in-place write, in the worker.

``--worker-extension-cls benchmarks._peer_ext.PeerExtension`` (with the repository root on
``PYTHONPATH``) gives a worker every deltasync method plus three that feed the same deltas to
vLLM 0.32's ``load_checkpoint_weight_patches``
(``vllm/model_executor/model_loader/checkpoint_weight_patch.py``): one NaN-masked full tensor
per changed checkpoint name, loaded through the model's own ``load_weights`` with
``torch.Tensor.copy_`` swapped for a ``torch.where`` process-wide.

- ``deltasync_bench_peer_prepare(version)``: decode delta ``version`` from the bucket, in
  checkpoint coordinates, against the live weights (the worker must serve ``version - 1``):
  per name the flat indices, the new bf16 values and the values there now. Not timed as an
  apply: it is the peer's staging.
- ``deltasync_bench_peer_apply(version, values, check)``: write the prepared ``"new"`` or
  ``"old"`` values through ``load_checkpoint_weight_patches``; answers its seconds and, with
  ``check``, the fingerprint of the live weights recomputed in full afterwards (deltasync's own
  hash, without touching deltasync's state, so a peer write never taints it).
- ``deltasync_bench_peer_nan()``: whether the peer can carry a NaN payload (it cannot: NaN is
  its "unchanged" sentinel, and its validation refuses NaN values); touches no weight.

Single-rank servers only (the benchmark's). The prefetch thread must be idle while the peer
writes: ``copy_`` is swapped for the whole process.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from deltasync.reader.chain import ChainReader
from deltasync.reader.parts import decode_version
from vllm_ext import DeltaWorkerExtension
from deltasync.server.inplace import InPlaceState
from vllm_ext._worker import vllm_updater

__all__ = ["PeerExtension"]


class PeerExtension(DeltaWorkerExtension):
    """deltasync's worker extension plus the peer's benchmark methods (see the module)."""

    def deltasync_bench_peer_prepare(self, version: int) -> dict[str, Any]:
        updater = vllm_updater(self.model_runner.get_model(), self.vllm_config)
        live = _live(self)
        assert live.version == version - 1, f"serving {live.version}, not {version - 1}"
        shapes = updater.checkpoint.shapes
        assert shapes is not None, "the served checkpoint's shapes are unknown"
        start = time.perf_counter()
        receiver = updater._open_receiver()
        reader = ChainReader(receiver.store, receiver.pointer(), view=receiver.view)

        def current(name: str, index: torch.Tensor) -> torch.Tensor:
            pos, bits = live.read(name, index)
            out = torch.zeros(index.numel(), dtype=torch.int16)
            out[pos] = bits
            return out.view(torch.bfloat16)

        entry, files = reader.fetch(version)
        _, changes = decode_version(files, entry, url=receiver.store.url, numels=live.map.numels, base_values=current)
        patches = {}
        for name, change in changes.items():
            if name in live.map.ignored:
                continue
            index = change.index.to(torch.int64)
            patches[name] = (tuple(shapes[name]), index, change.new.view(torch.bfloat16),
                             current(name, index))  # fmt: skip
        _PREPARED.clear()
        _PREPARED[version] = patches
        return {"names": len(patches), "changed": sum(p[1].numel() for p in patches.values()),
                "seconds": time.perf_counter() - start}  # fmt: skip

    def deltasync_bench_peer_apply(self, version: int, values: str = "new", check: bool = False) -> dict[str, Any]:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        model = self.model_runner.get_model()
        live = _live(self)
        column = {"new": 2, "old": 3}[values]
        patches = [CheckpointWeightPatch(name, p[0], torch.bfloat16, p[column], p[1]) for name, p in _PREPARED[version].items()]
        error = None
        start = time.perf_counter()
        try:
            with set_current_vllm_config(self.vllm_config):
                load_checkpoint_weight_patches(model, patches)
        except Exception as exc:  # noqa: BLE001  (reported: the benchmark says what failed)
            error = f"{type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - start
        fingerprint = live.full_fingerprint() if check else None
        return {"apply_s": seconds, "error": error, "fingerprint": fingerprint, "names": len(patches)}

    def deltasync_bench_peer_nan(self) -> dict[str, Any]:
        from vllm.model_executor.model_loader.checkpoint_weight_patch import (
            CheckpointWeightPatch,
            load_checkpoint_weight_patches,
        )

        live = _live(self)
        name = next(n for n in live.map.pieces if n not in live.map.ignored)
        nan = torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)  # a quiet NaN with a payload
        patch = CheckpointWeightPatch(name, (live.map.numels[name],), torch.bfloat16, nan, torch.tensor([0]))
        try:
            load_checkpoint_weight_patches(torch.nn.Module(), [patch])  # validation comes before any load
        except Exception as exc:  # noqa: BLE001
            return {"carried": False, "error": f"{type(exc).__name__}: {exc}"}
        return {"carried": True, "error": None}


def _live(worker: Any) -> InPlaceState:
    """The worker's in-place state (the peer needs a server in place)."""
    updater = vllm_updater(worker.model_runner.get_model(), worker.vllm_config)
    live = getattr(updater.target, "live", None)
    assert isinstance(live, InPlaceState) and updater.mode == "in-place", "the peer needs a server in place"
    return live


_PREPARED: dict[int, dict[str, tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
