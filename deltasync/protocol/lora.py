"""What both sides of an adapter sync agree on: the anchor metadata keys, the routes, the name
rule, and the checks of an adapter's config and modules against what vLLM serves.

The trainer side (:mod:`deltasync.trainer.lora`: the adapter's weights and publishers;
:mod:`deltasync.control.lora_client`: its client) and the server side (``vllm_ext.LoraSyncMiddleware``) both import this module; it imports neither torch
nor PEFT, so a vLLM worker checks adapters without loading any trainer-side code.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import AdapterError
from ..format.fingerprint import format_fingerprint, parse_fingerprint
from .routes import LORA_STATUS_ROUTE, LORA_UPDATE_ROUTE

__all__ = [
    "ADAPTER_CONFIG_KEY",
    "BASE_FINGERPRINT_KEY",
    "LORA_NAME_RE",
    "STATUS_ROUTE",
    "UPDATE_ROUTE",
    "VLLM_LORA_RANKS",
    "adapter_config",
    "adapter_modules",
    "adapter_rank",
    "check_adapter_config",
    "check_adapter_modules",
    "check_server_lora",
    "fingerprint_sum",
]

#: Anchor metadata key: the adapter's PEFT config as JSON (what ``adapter_config.json`` holds).
ADAPTER_CONFIG_KEY = "x-peft-config"
#: Anchor metadata key: fingerprint of the base model's weights in bf16 (checkpoint names).
BASE_FINGERPRINT_KEY = "x-base-fingerprint"
#: Ranks vLLM builds stacked LoRA buffers for (``--max-lora-rank`` takes only these).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: Routes of ``vllm_ext.LoraSyncMiddleware`` (defined in :mod:`deltasync.protocol.routes`).
UPDATE_ROUTE = LORA_UPDATE_ROUTE
STATUS_ROUTE = LORA_STATUS_ROUTE

#: What an adapter name may be (vLLM serves it as a model name).
LORA_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
# Modules vLLM cannot put a LoRA on (its LoRA manager covers linear layers only).
_UNSUPPORTED_TARGETS = ("embed_tokens", "lm_head", "wte", "wpe", "embed_in", "embed_out")


# --------------------------------------------------------------------------- configs


def adapter_config(config: object) -> dict[str, Any]:
    """A PEFT config (``LoraConfig`` or its dict) as plain JSON data, as ``adapter_config.json`` holds it."""
    if hasattr(config, "to_dict"):
        config = config.to_dict()  # type: ignore[union-attr]
    if not isinstance(config, Mapping):
        raise AdapterError(f"adapter config: expected a PEFT config or a dict, got {type(config).__name__}")
    return json.loads(json.dumps(dict(config), default=_jsonable, sort_keys=True))


def _jsonable(value: object) -> object:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # enums such as PeftType / TaskType
        return value.value  # type: ignore[attr-defined]
    return str(value)


def adapter_rank(config: Mapping[str, Any]) -> int:
    """The largest rank of any module (``rank_pattern`` can lift modules above ``r``)."""
    ranks = [int(config.get("r") or 0), *(int(v) for v in (config.get("rank_pattern") or {}).values())]
    return max(ranks)


def check_adapter_config(config: Mapping[str, Any]) -> None:
    """Raise :class:`AdapterError` unless the adapter is plain LoRA that vLLM (and a merge) can express.

    The same rules as TRL's adapter sync: LoRA only, no DoRA, no ``modules_to_save``, no
    trained biases, no parameter (MoE) LoRA, no embedding or head targets.
    """
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"peft_type={peft_type}: delta sync ships LoRA adapters only; use a LoraConfig")
    if config.get("use_dora"):
        raise AdapterError(
            "use_dora=True: DoRA's magnitude vectors are not part of a vLLM LoRA adapter; train with use_dora=False"
        )
    if config.get("modules_to_save"):
        raise AdapterError(
            f"modules_to_save={config['modules_to_save']}: fully trained modules cannot ride in a LoRA adapter; "
            "drop modules_to_save (or train those modules as LoRA targets)"
        )
    if (config.get("bias") or "none") != "none":
        raise AdapterError(f"bias={config['bias']!r} trains bias terms, which a LoRA adapter cannot carry; use bias='none'")
    if config.get("target_parameters"):
        raise AdapterError(
            f"target_parameters={config['target_parameters']}: parameter (fused-MoE) LoRA is not supported; "
            "target modules instead"
        )
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    bad = sorted(t for t in targets if any(u in t for u in _UNSUPPORTED_TARGETS))
    if bad:
        raise AdapterError(
            f"target_modules={sorted(targets)} includes {bad}: vLLM serves LoRA on linear layers only, "
            "not on embeddings or the head; target e.g. q_proj, k_proj, v_proj, o_proj"
        )


def adapter_modules(names: Iterable[str]) -> list[str]:
    """The module names (last component) that adapter tensors named ``names`` put LoRA on.

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``q_proj``: the
    suffix vLLM's loader matches against the modules it supports.
    """
    modules = set()
    for name in names:
        parts = name.split(".")
        if len(parts) < 3 or not parts[-2].startswith("lora_"):
            raise AdapterError(f"{name!r} is not a LoRA tensor name (expected '<module>.lora_A.weight' or '.lora_B.weight')")
        modules.add(parts[-3])
    return sorted(modules)


def check_adapter_modules(modules: Iterable[str], accepted: Iterable[str] | None, *, restricted: object = None) -> None:
    """Raise :class:`AdapterError` unless vLLM serves LoRA on every module in ``modules``.

    ``accepted``: what the server reports (``lora_modules`` of the middleware's status route:
    the modules whose LoRA vLLM both loads and applies to the served model; None when the
    server cannot tell). ``restricted``: the server's ``--lora-target-modules``, named in the
    message when it is what excludes a module. vLLM itself refuses a module it does not support
    only when the adapter loads, and silently skips one that ``--lora-target-modules`` leaves
    out; this check runs before anything is trained or loaded.
    """
    if accepted is None:
        raise AdapterError(
            "the server does not report which modules it serves LoRA on (its middleware could not ask the workers): "
            "start it with --worker-extension-cls vllm_ext.DeltaWorkerExtension (deltasync serve adds it)"
        )
    accepted = sorted(accepted)
    bad = sorted(set(modules) - set(accepted))
    if bad:
        why = f" (its --lora-target-modules is {list(restricted)})" if restricted else ""  # type: ignore[call-overload]
        raise AdapterError(
            f"the adapter puts LoRA on {', '.join(bad)}, but this vLLM server serves LoRA only on "
            f"{', '.join(accepted) or 'no module'}{why}: remove {', '.join(bad)} from target_modules"
            + (" or restart the server with those modules in --lora-target-modules" if restricted else "")
            + ", or use peft_sync='merged'"
        )


def check_server_lora(
    server_lora: Mapping[str, Any] | None,
    config: Mapping[str, Any],
    *,
    max_staleness: int,
    modules: Iterable[str] | None = None,
    accepted: Iterable[str] | None = None,
) -> None:
    """Raise :class:`AdapterError` unless a server with LoRA config ``server_lora`` can serve the adapter.

    ``server_lora`` is the ``lora_config`` of vLLM's ``/server_info`` (None: no ``--enable-lora``).
    Each sync loads the next version before the oldest servable one is unloaded, so the server
    holds ``max_staleness + 2`` adapters for a moment (vLLM would silently evict one otherwise).
    ``modules`` (the adapter's, :func:`adapter_modules`) are checked against ``accepted``, the
    server's ``lora_modules`` (:func:`check_adapter_modules`); None skips that check.
    """
    if server_lora is None:
        raise AdapterError(
            "adapter mode needs a server started with --enable-lora (and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1); "
            "start it so, or use peft_sync='merged'"
        )
    rank = adapter_rank(config)
    max_rank = int(server_lora.get("max_lora_rank") or 0)
    if rank > max_rank:
        fit = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
        fix = f"restart it with --max-lora-rank {fit}" if fit else f"lower r below {VLLM_LORA_RANKS[-1] + 1}"
        raise AdapterError(f"the adapter has rank {rank}, but the server was started with --max-lora-rank {max_rank}: {fix}")
    max_loras = int(server_lora.get("max_loras") or 0)
    need = max_staleness + 2
    if max_loras < need:
        raise AdapterError(
            f"the server was started with --max-loras {max_loras}, but max_staleness={max_staleness} lets requests "
            f"name {need - 1} adapter versions and each sync loads the next before unloading the oldest: restart it "
            f"with --max-loras {need}, or lower max_staleness"
        )
    if modules is not None:
        check_adapter_modules(modules, accepted, restricted=server_lora.get("target_modules"))


def fingerprint_sum(parts: list[str]) -> str:
    """The fingerprint of a state from the fingerprints of disjoint parts of it (they add)."""
    return format_fingerprint(sum(parse_fingerprint(p) for p in parts))
