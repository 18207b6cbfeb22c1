"""deltasync inside vLLM: apply committed versions from a bucket to a running server.

Start a server that follows a bucket (``deltasync serve`` fills all of this in)::

    VLLM_SERVER_DEV_MODE=1 DELTASYNC_BUCKET=<url> DELTASYNC_TOKEN=<secret> \\
    python -m vllm.entrypoints.openai.api_server --model MODEL \\
        --worker-extension-cls vllm_ext.DeltaWorkerExtension \\
        --weight-transfer-config '{"backend": "delta"}' \\
        --middleware vllm_ext.UpdateMiddleware --middleware vllm_ext.TokenMiddleware

- :class:`DeltaWeightTransferEngine` is the ``"delta"`` weight-transfer backend behind vLLM's
  ``/start_weight_update``, ``/update_weights`` and ``/finish_weight_update`` routes.
- :class:`DeltaWorkerExtension` is the worker extension: ``deltasync_status``,
  ``deltasync_prefetch`` and ``deltasync_apply`` through ``/collective_rpc``.
- :class:`UpdateMiddleware` adds ``/deltasync/update``: pause, apply and resume in one request.
- :class:`TokenMiddleware` requires the token on vLLM's control routes.
- :class:`LoraSyncMiddleware` loads adapter versions from the bucket (``--enable-lora``).
- ``DELTASYNC_CPU_PLAIN_GEMM=1`` keeps vLLM-CPU's linear weights plain, so deltas are written
  in place there too (a test and benchmark setting; see :mod:`vllm_ext._plain_gemm`). On CUDA,
  unquantized models are patched in place anyway.
- :func:`register` is the ``vllm.general_plugins`` entry point ``deltasync`` (pyproject.toml):
  vLLM runs it in every process it starts (the API server, the engine core, and each worker
  before it loads its model). It registers the backend and installs the plain GEMM dispatch
  when the switch asks for it; on a CPU with AMX it first asks Linux for the AMX tile state
  (:mod:`vllm_ext._amx`). Importing this package patches nothing: it only registers the
  backend (the worker extension imports it in every worker), and it loads no trainer-side
  module of deltasync (no publisher, detector or weight source).
- :class:`deltasync.server.config.ServerConfig` reads the server's ``DELTASYNC_*`` environment once
  (the names are in :mod:`deltasync.protocol.env`); :mod:`vllm_ext.testing` holds the test-only worker
  extension, which only the test suite loads.

The trainer drives all of it with :class:`deltasync.RolloutClient`. This package never
imports TRL.
"""

from __future__ import annotations

from deltasync.server.middleware import TokenMiddleware

from ._amx import request_amx_tile_state
from ._engine import DeltaWeightTransferEngine
from ._extension import DeltaWorkerExtension
from ._lora import LoraSyncMiddleware
from ._plain_gemm import PLAIN_GEMM_ENV, install_plain_gemm
from ._update_route import UpdateMiddleware

__all__ = [
    "BACKEND",
    "PLAIN_GEMM_ENV",
    "DeltaWeightTransferEngine",
    "DeltaWorkerExtension",
    "LoraSyncMiddleware",
    "TokenMiddleware",
    "UpdateMiddleware",
    "register",
]

#: The name of the weight-transfer backend (``--weight-transfer-config '{"backend": "delta"}'``).
BACKEND = "delta"


def register() -> None:
    """Where a vLLM server starts (the ``vllm.general_plugins`` entry point, run in every process
    vLLM starts, before a worker loads its model): register the backend and, when
    ``DELTASYNC_CPU_PLAIN_GEMM`` asks for it, install the plain CPU GEMM dispatch. On an x86-64
    CPU with AMX it first asks Linux for the AMX tile state, which vLLM-CPU's kernels need and
    never ask for (:mod:`vllm_ext._amx`). Safe to repeat."""
    request_amx_tile_state()
    register_backend()
    install_plain_gemm()


def register_backend() -> None:
    """Register the ``"delta"`` backend with vLLM's weight-transfer factory; safe to repeat."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "vllm_ext._engine", "DeltaWeightTransferEngine")
    except ValueError as exc:
        if "already registered" not in str(exc):
            raise
    from ._vllm_engine import install_engine_core_method

    install_engine_core_method()  # in the engine-core process: where each version began, per request


# The worker extension's module imports this package in every worker: the backend is known
# there even where the entry point is not installed.
register_backend()
