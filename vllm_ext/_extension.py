"""The worker extension: deltasync methods reachable through ``/collective_rpc``.

``--worker-extension-cls vllm_ext.DeltaWorkerExtension`` appends this class to the
bases of every vLLM worker. vLLM refuses an extension attribute that the worker already
has, so every name here starts with ``deltasync_``. Arguments and results are plain data,
as collective_rpc requires. Each method answers one call of :mod:`deltasync.protocol.calls`
(its name, arguments and answer are defined there) and takes the call's fields in order.
"""

from __future__ import annotations

from typing import Any

from deltasync.server.updater import WorkerUpdater

from ._lora_worker import lora_fingerprint, lora_modules
from ._worker import vllm_updater

__all__ = ["DeltaWorkerExtension", "updater_of"]


class DeltaWorkerExtension:
    """Worker extension adding ``deltasync_status``, ``deltasync_prefetch``, ``deltasync_begin``,
    ``deltasync_apply``, ``deltasync_verify`` and, for adapter mode, ``deltasync_lora_modules`` and
    ``deltasync_lora_fingerprint``. (The test RPCs live in :mod:`vllm_ext.testing`.)"""

    def deltasync_status(self) -> dict[str, Any]:
        """This worker's rank, version, fingerprint, bucket, last update and prefetch state."""
        return updater_of(self).status()

    def deltasync_prefetch(self, version: int, auth: str | None = None) -> dict[str, Any]:
        """Start downloading and decoding ``version`` in the background; returns at once."""
        return updater_of(self).prefetch(version, auth)

    def deltasync_begin(self, version: int, auth: str | None = None, pointer: bytes | None = None) -> dict[str, Any]:
        """``deltasync_prefetch`` and ``deltasync_status`` in one call: the status, whose
        ``prefetch`` is the answer to this prefetch (what the update route starts with).
        ``pointer``: the committed pointer's bytes, as the follower read them."""
        return updater_of(self).begin(version, auth, pointer)

    def deltasync_apply(self, version: int, auth: str | None = None) -> dict[str, Any]:
        """Apply ``version`` now, without the weight-update routes.

        The caller must pause generation around it and empty the prefix cache (``/pause`` with
        ``clear_cache=true`` does), as ``RolloutClient.update`` does through the routes.
        """
        return updater_of(self).update(version, auth)

    def deltasync_verify(self) -> dict[str, Any]:
        """Recompute the served fingerprint in full from the live weights; ``ok`` if it is the
        one tracked. A mismatch makes the next update load the newest anchor."""
        return updater_of(self).verify()

    def deltasync_lora_modules(self) -> dict[str, Any]:
        """The adapter module names whose LoRA this worker's vLLM loads and applies."""
        return lora_modules(self)

    def deltasync_lora_fingerprint(self, lora_id: int, path: str, names: list[str]) -> dict[str, Any]:
        """Fingerprint of loaded adapter ``lora_id`` from the LoRA tensors this worker holds,
        mapped back to the adapter's checkpoint ``names`` (see ``vllm_ext._lora_worker``)."""
        return lora_fingerprint(self, lora_id, path, names)


def updater_of(worker: Any) -> WorkerUpdater:
    # A function, not a method: every method of the extension becomes a collective_rpc
    # target. The same updater as the "delta" engine's, so both paths share one receiver.
    return vllm_updater(worker.model_runner.get_model(), worker.vllm_config)
