"""How ``AsyncGRPOTrainer(delta_sync=...)`` ships its weights: :class:`DeltaSyncConfig`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from ..errors import ConfigError
from ..protocol.env import TOKEN_ENV, UPDATE_MODES
from ..trainer.publisher import PublishOptions

__all__ = ["DeltaSyncConfig"]


@dataclass(kw_only=True)
class DeltaSyncConfig:
    """Where and how the trainer ships its weights."""

    bucket: str | None = None
    """Bucket URL or path (local, ``hf://buckets/ns/name``, any fsspec URL). Default: the folder
    ``deltasync-bucket`` in the trainer's ``output_dir``. The servers must follow the same bucket."""
    server_urls: list[str] | None = None
    """Rollout servers to update. Default: ``[args.vllm_server_base_url]``."""
    token: str | None = None
    """Shared secret of the servers (``DELTASYNC_TOKEN`` on their side). Default: the trainer's
    ``DELTASYNC_TOKEN`` environment variable, if set."""
    publish: PublishOptions = field(default_factory=PublishOptions)
    """How versions are written: anchor schedule, codec, retention (see :class:`~deltasync.PublishOptions`)."""
    prefetch: bool = True
    """Let servers download and decode each version while still generating, so they pause only
    to swap it in."""
    follow: bool = False
    """The servers follow the bucket by themselves (``deltasync serve --follow``): the trainer
    only publishes, never asks a server to update, and tags samples with the version the
    servers report serving on ``GET /deltasync/status`` once they reach the new version."""
    background: bool = True
    """Publish and update the servers in the background: a sync returns as soon as the version
    is captured (its changed values copied out), and training goes on while it is encoded,
    uploaded and committed and the servers stage and apply it. At most one version is in
    flight: the next sync first waits for it. False: every sync waits for all of that."""
    timeout: float = 600.0
    """Seconds to wait for a server's answer."""
    peft_sync: str | None = None
    """PEFT models: "adapter" (adapter versions, servers with ``--enable-lora``), "merged" (merged
    weights), or None to decide from the servers' ``lora_config`` as TRL does."""
    lora_name: str = "trl-policy"
    """Adapter mode: adapters are served as ``<lora_name>-v<version>``."""
    view: str | None = None
    """The quantized view the rollout servers serve (a compressed-tensors preset scheme name,
    e.g. ``"FP8_DYNAMIC"``): it is published beside the bf16 chain (added to
    ``publish.views``), each server must report serving it, and sync records carry its bytes
    and fingerprint. Start the servers from a checkpoint of the view (``deltasync export
    --view``, or ``deltasync.views.write_view_checkpoint``)."""
    update_mode: str | None = "inflight"
    """How servers apply each version: "inflight" (between two engine steps, no pause; requests
    in flight go on with the new weights and every token is tagged with the version that sampled
    it), "pause" (requests in flight recompute their KV with the new weights), or None for each
    server's own ``--update-mode``. Servers whose parameters reload pause anyway and say so."""
    max_token_lag: int | None = None
    """Mask from the loss the tokens sampled more than this many versions behind the version
    being trained (their sampling version comes from the servers' per-token report); None
    masks nothing. TRL's ``max_staleness`` still drops whole samples by their oldest token."""

    def server_token(self) -> str | None:
        """:attr:`token`, or else the trainer's ``DELTASYNC_TOKEN`` (None when neither is set):
        the one place the trainer reads its environment."""
        return self.token if self.token is not None else os.environ.get(TOKEN_ENV) or None

    def __post_init__(self) -> None:
        if not isinstance(self.publish, PublishOptions):
            raise ConfigError(
                f"publish must be a PublishOptions, got {type(self.publish).__name__}: "
                "DeltaSyncConfig(publish=PublishOptions(anchor_every=...))"
            )
        if self.peft_sync not in (None, "adapter", "merged"):
            raise ConfigError(f"peft_sync must be 'adapter', 'merged' or None (decide from the servers), got {self.peft_sync!r}")
        if self.server_urls is not None and not self.server_urls:
            raise ConfigError("server_urls is empty: give at least one rollout server, or None for the trainer's")
        if self.update_mode is not None and self.update_mode not in UPDATE_MODES:
            raise ConfigError(f"update_mode must be one of {', '.join(UPDATE_MODES)} or None, got {self.update_mode!r}")
        if self.max_token_lag is not None and (isinstance(self.max_token_lag, bool) or not isinstance(self.max_token_lag, int)
                                               or self.max_token_lag < 0):  # fmt: skip
            raise ConfigError(f"max_token_lag must be a whole number of versions >= 0 or None, got {self.max_token_lag!r}")
        if self.timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {self.timeout}")
        if self.view is not None:
            from ..views import get_scheme

            get_scheme(self.view)  # an unknown scheme is refused by name
            if self.peft_sync == "adapter":
                raise ConfigError(f"view={self.view!r} with peft_sync='adapter': adapters are bf16; use peft_sync='merged'")
            self.publish = replace(self.publish, views=tuple(dict.fromkeys((*self.publish.views, self.view))))
        if self.follow and self.peft_sync == "adapter":
            raise ConfigError(
                "follow=True with peft_sync='adapter': followers serve full weights; adapter versions are loaded on the "
                "trainer's request. Use peft_sync='merged' with follow=True, or follow=False for adapters"
            )
