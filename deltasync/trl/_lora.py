"""PEFT models in ``AsyncGRPOTrainer(delta_sync=...)``: pick adapter or merged mode, as TRL does.

TRL's own async GRPO syncs a PEFT model adapter-only when the server runs ``--enable-lora``
and merged otherwise; it decides from the server's ``lora_config``. Delta sync decides the
same way (``DeltaSyncConfig.peft_sync`` can force a mode) and checks what TRL checks before
training starts: a plain LoRA adapter, its rank against ``--max-lora-rank``, ``--max-loras``
against ``max_staleness``, and (beyond TRL) that every module the adapter puts LoRA on is one
the server's vLLM serves LoRA on.
"""

from __future__ import annotations

import logging
from typing import Any

from ..control.client import BaseRolloutClient, RolloutClient
from ..control.lora_client import AdapterRolloutClient, server_lora_config, server_lora_modules
from ..errors import ConfigError
from ..trainer.lora import (
    AdapterError,
    adapter_config,
    adapter_publisher,
    check_adapter_config,
    check_server_lora,
    lora_targets,
    merged_publisher,
)
from ..trainer.publisher import DeltaPublisher, PublishOptions
from ._config import DeltaSyncConfig

__all__ = ["PEFT_SYNC_MODES", "choose_peft_sync", "start_peft_sync"]

# ``trainer`` below is a deltasync.trl.AsyncGRPOTrainer, typed Any: its module imports this one.

logger = logging.getLogger("deltasync.trl")

PEFT_SYNC_MODES = ("adapter", "merged")


def choose_peft_sync(trainer: Any, config: DeltaSyncConfig) -> str | None:
    """The sync mode for the trainer's model: None (not PEFT), "adapter" or "merged".

    Raises :class:`~deltasync.ConfigError` (an :class:`~deltasync.trainer.lora.AdapterError` for the
    adapter's and server's LoRA limits) before training when the mode cannot work.
    """
    from accelerate.utils import broadcast_object_list, is_peft_model

    model = trainer.accelerator.unwrap_model(trainer.model)
    if not is_peft_model(model):
        if config.peft_sync is not None:
            raise ConfigError(f"peft_sync={config.peft_sync!r} is set, but the model is not a PEFT model")
        return None
    if config.peft_sync not in (None, *PEFT_SYNC_MODES):
        raise ConfigError(f"peft_sync must be None (decide from the server), 'adapter' or 'merged'; got {config.peft_sync!r}")
    check_adapter_config(adapter_config(model.peft_config[model.active_adapters[0]]))
    decision: Any = None
    if trainer.accelerator.is_main_process:
        try:
            decision = _decide(trainer, config, model)
        except Exception as exc:  # noqa: BLE001  (raised on every rank below)
            decision = exc
    # Every rank must take the same branch (the publishers differ); a failure is raised on all.
    decision = broadcast_object_list([decision], from_process=0)[0]
    if isinstance(decision, Exception):
        raise decision
    if decision == "adapter" and config.follow:
        raise ConfigError(
            "follow=True, and the servers take LoRA adapters (adapter mode): followers serve full weights, "
            "adapter versions are loaded on the trainer's request. Pass peft_sync='merged', or follow=False"
        )
    if decision == "adapter" and trainer.rollout_worker is not None:
        _request_adapters(trainer.rollout_worker, config.lora_name)
    logger.info("delta sync: PEFT model, %s mode", decision)
    return decision


def _request_adapters(worker: Any, lora_name: str) -> None:
    """Make TRL's rollout worker request ``<lora_name>-v<model_version>`` instead of the base model.

    TRL 1.16 passes ``lora_name`` to the spawned rollout loop through the worker's
    ``_loop_kwargs`` (set at construction, read when the loop starts at train begin); with a
    weight transfer of its own it passes None.
    """
    kwargs = getattr(worker, "_loop_kwargs", None)
    if not isinstance(kwargs, dict) or "lora_name" not in kwargs:
        raise ConfigError(
            f"{type(worker).__name__} takes no lora_name: this TRL version's rollout worker is not supported in "
            "adapter mode; use peft_sync='merged'"
        )
    kwargs["lora_name"] = lora_name


def _decide(trainer: Any, config: DeltaSyncConfig, model: Any) -> str:
    if config.peft_sync == "merged":
        return "merged"
    urls = config.server_urls or [trainer.args.vllm_server_base_url]
    token = config.server_token()
    probes = {url: server_lora_config(url, token) for url in urls}
    without = [url for url, (lora, _) in probes.items() if lora is None]
    data_parallel = [url for url, (_, dp) in probes.items() if dp > 1]
    if config.peft_sync is None and (without or data_parallel):
        if without:
            logger.warning(
                "delta sync: %s runs without --enable-lora: publishing merged weights (start the servers with "
                "--enable-lora --max-lora-rank R to ship only the adapter)", ", ".join(without)
            )
        else:
            logger.warning("delta sync: %s is data-parallel: publishing merged weights", ", ".join(data_parallel))
        return "merged"
    if data_parallel:
        raise AdapterError(
            f"peft_sync='adapter': {', '.join(data_parallel)} runs with --data-parallel-size > 1, where a loaded "
            "adapter reaches one replica only; use peft_sync='merged' or one replica per server"
        )
    adapter = model.active_adapters[0]
    cfg = adapter_config(model.peft_config[adapter])
    # The modules the adapter really carries LoRA on (what target_modules matched, a regex
    # included), by the module's last name component as vLLM's loader matches it.
    modules = lora_targets(model, adapter)
    for url, (lora, _) in probes.items():
        try:
            # A server without LoRA is refused for that first (its status route does not exist).
            accepted = None if lora is None else server_lora_modules(url, token, timeout=config.timeout)
            check_server_lora(lora, cfg, max_staleness=trainer.args.max_staleness, modules=modules, accepted=accepted)
        except AdapterError as exc:
            raise AdapterError(f"{url}: {exc}") from None
    return "adapter"


def start_peft_sync(
    trainer: Any,
    mode: str,
    bucket: str,
    urls: list[str],
    token: str | None,
    config: DeltaSyncConfig,
    options: PublishOptions,
) -> tuple[DeltaPublisher, BaseRolloutClient]:
    """The publisher and client of a PEFT model's sync in ``mode``."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if mode == "adapter":
        publisher = adapter_publisher(bucket, model, trainer.optimizer, options=options)
        client: BaseRolloutClient = AdapterRolloutClient(
            urls, token, timeout=config.timeout, lora_name=config.lora_name, keep=trainer.args.max_staleness + 1
        )
    else:
        publisher = merged_publisher(bucket, model, trainer.optimizer, options=options)
        client = RolloutClient(urls, token=token, timeout=config.timeout)
    return publisher, client
