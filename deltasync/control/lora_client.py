"""The control plane of adapter mode: make rollout servers load adapter version N.

:class:`AdapterRolloutClient` speaks to servers running ``vllm_ext.LoraSyncMiddleware`` over the
routes of :mod:`deltasync.protocol.lora`; :func:`server_lora_modules` and
:func:`server_lora_config` read what a server serves LoRA on, for the checks of
:mod:`deltasync.trl`. The adapter's weights and publishers are in :mod:`deltasync.trainer.lora`.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..errors import AdapterError, ConfigError
from ..protocol.lora import LORA_NAME_RE, STATUS_ROUTE, UPDATE_ROUTE
from .client import (
    BaseRolloutClient,
    RequestError,
    RolloutClient,
    ServerHandle,
    ServerResult,
    ServerStatus,
    UpdateReport,
    check_update_mode,
)

__all__ = ["AdapterRolloutClient", "server_lora_config", "server_lora_modules"]


class AdapterRolloutClient(BaseRolloutClient):
    """The rollout client of adapter mode: ``update(N)`` makes servers load adapter version N.

    Each server (``vllm_ext.LoraSyncMiddleware``) reads version N from its own bucket, loads it
    as ``<lora_name>-v<N>`` and unloads versions older than the newest ``keep``. Generation
    never pauses and nothing is staged ahead (:class:`RolloutClient` prefetches, this client has
    no need): a new version is a new adapter name, loaded while the server generates. :meth:`status`
    reports the newest loaded version and its fingerprint.

    Args:
        lora_name: the name adapters are served under (TRL's rollout worker requests
            ``<lora_name>-v<model_version>``).
        keep: adapter versions each server keeps loaded (TRL: ``max_staleness + 1``).
        Others: as :class:`~deltasync.control.client.BaseRolloutClient`.
    """

    def __init__(self, urls: Any, token: str | None = None, *, lora_name: str = "trl-policy", keep: int = 2, **kwargs: Any) -> None:
        super().__init__(urls, token, **kwargs)
        if not isinstance(lora_name, str) or not LORA_NAME_RE.match(lora_name):
            raise ConfigError(f"lora_name {lora_name!r}: use letters, digits, '.', '_' and '-' (at most 100)")
        if not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"keep must be an integer >= 1 (adapter versions kept loaded), got {keep!r}")
        self.lora_name = lora_name
        self.keep = keep

    def adapter_name(self, version: int) -> str:
        return f"{self.lora_name}-v{version}"

    def update(self, version: int, *, mode: str | None = None) -> UpdateReport:
        """Make every server load adapter version ``version``; waits until each has loaded it or failed.

        ``mode`` is deprecated and ignored: adapter servers have one update mode (a new version
        is a new adapter name, loaded while the server generates).
        """
        if mode is not None:
            check_update_mode(mode)
            _deprecated("update(mode=...)", "adapter servers have one update mode (no pause); drop mode=")
        return super().update(version)

    def prefetch(self, version: int) -> dict[str, ServerResult]:
        """Deprecated: adapter versions load while the servers generate, nothing is staged ahead;
        returns ``{}``. Call :meth:`update` alone."""
        _deprecated("prefetch", _NO_STAGING)
        return {}

    def wait_prefetched(self, version: int, *, timeout: float = 600.0, poll: float = 0.05) -> dict[str, bool]:
        """Deprecated: nothing is staged ahead in adapter mode (see :meth:`prefetch`); every
        server counts as ready."""
        _deprecated("wait_prefetched", _NO_STAGING)
        return {url: True for url in self.urls}

    def served(self) -> dict[str, ServerStatus]:
        """Deprecated: :meth:`RolloutClient.served` for these servers, which reports the base
        model's served version, not the adapter's; use :meth:`status`."""
        _deprecated("served", _BASE_SERVED)
        return self._base_client().served()

    def wait_served(self, version: int, *, timeout: float = 600.0, poll: float = 0.1) -> dict[str, ServerStatus]:
        """Deprecated: :meth:`RolloutClient.wait_served` for these servers (see :meth:`served`)."""
        _deprecated("wait_served", _BASE_SERVED)
        return self._base_client().wait_served(version, timeout=timeout, poll=poll)

    def _base_client(self) -> RolloutClient:
        """A :class:`RolloutClient` for the same servers, token, timeout, transport and connections."""
        base = RolloutClient(self.urls, self.token, timeout=self.timeout, transport=self.transport)
        base._connections = self._connections
        return base

    def _update_one(self, server: ServerHandle, version: int, tag: str | None) -> ServerResult:
        body = {"version": version, "auth": tag, "name": self.lora_name, "keep": self.keep}
        try:
            answer = server.post(UPDATE_ROUTE, body=body)
        except RequestError as exc:
            state = self._status_one(server)
            return ServerResult(url=server.url, ok=False, version=state.version, fingerprint=state.fingerprint, error=str(exc))
        answer = answer if isinstance(answer, dict) else {}
        served = answer.get("version")
        error = None if served == version else f"the server reports adapter version {served} after the update to {version}"
        return ServerResult(
            url=server.url,
            ok=error is None,
            version=served,
            fingerprint=answer.get("fingerprint"),
            kind=answer.get("kind"),
            nbytes=int(answer.get("nbytes") or 0),
            stage_s=float(answer.get("stage_s") or 0.0),
            apply_s=float(answer.get("apply_s") or 0.0),
            paused_s=0.0,
            error=error,
        )

    def _status_one(self, server: ServerHandle) -> ServerStatus:
        try:
            answer = server.post(STATUS_ROUTE, attempts=3)
        except RequestError as exc:
            return ServerStatus(url=server.url, ok=False, error=str(exc))
        if not isinstance(answer, dict):
            return ServerStatus(url=server.url, ok=False, error=f"POST {STATUS_ROUTE}: unexpected answer {answer!r}")
        return ServerStatus(
            url=server.url, ok=True, version=answer.get("version"), fingerprint=answer.get("fingerprint"), workers=[answer]
        )


_NO_STAGING = (
    "it does nothing (adapter versions load while the servers generate, nothing is staged ahead); call update() alone"
)
_BASE_SERVED = "it reports the base model's served version, not the adapter's; use status()"


def _deprecated(what: str, why: str) -> None:
    """Warn that ``AdapterRolloutClient.<what>`` is deprecated, and why (for its caller's caller)."""
    warnings.warn(f"AdapterRolloutClient.{what} is deprecated: {why}", DeprecationWarning, stacklevel=3)


def server_lora_modules(url: str, token: str | None = None, *, timeout: float = 60.0) -> list[str] | None:
    """The modules a server running ``vllm_ext.LoraSyncMiddleware`` serves LoRA on (its status route)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    where = url.rstrip("/") + STATUS_ROUTE
    try:
        response = httpx.post(where, json={}, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if response.status_code == 404:
        raise AdapterError(
            f"{where} does not exist: adapter mode needs the server to run --middleware vllm_ext.LoraSyncMiddleware "
            "(deltasync serve adds it with --enable-lora)"
        )
    if response.status_code != 200:
        raise AdapterError(f"{where}: HTTP {response.status_code}: {response.text[:300]}")
    try:
        modules = response.json().get("lora_modules")
    except (ValueError, AttributeError) as exc:
        raise AdapterError(f"{where}: not a JSON object ({exc})") from exc
    return None if modules is None else [str(m) for m in modules]


def server_lora_config(url: str, token: str | None = None, *, timeout: float = 60.0) -> tuple[dict[str, Any] | None, int]:
    """``(lora_config, data_parallel_size)`` from a vLLM server's ``/server_info`` (dev mode)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.get(
            url.rstrip("/") + "/server_info", params={"config_format": "json"}, headers=headers, timeout=timeout
        )
        response.raise_for_status()
        config = response.json()["vllm_config"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{url}/server_info: could not read the server's config ({exc}); the server must run with "
            "VLLM_SERVER_DEV_MODE=1 (deltasync serve sets it) and accept the token"
        ) from exc
    parallel = config.get("parallel_config") or {}
    return config.get("lora_config"), int(parallel.get("data_parallel_size") or 1)
