"""The trainer side of a server update: tell rollout servers that version N is committed.

:class:`RolloutClient` speaks plain HTTP to vLLM servers started with ``vllm_ext`` (see
``deltasync serve``). It sends no weights: each server pulls version N from its own bucket.
Per server and concurrently (a thread each), :meth:`RolloutClient.update` makes one request
when the server has ``vllm_ext.UpdateMiddleware`` (``deltasync serve`` adds it)::

    POST /deltasync/update {"version": N, "auth": TAG}

which pauses the server (``keep`` mode, caches emptied), applies N on every worker, and
resumes, in the API-server process; on a server without it (404), vLLM's own weight-update
sequence, five round trips::

    POST /pause?mode=keep&clear_cache=true   in-flight requests freeze, new ones queue, and the
                                             prefix cache is emptied (the frozen requests'
                                             KV is recomputed on resume, with the new weights)
    POST /start_weight_update
    POST /update_weights                     {"update_info": {"version": N, "auth": TAG}}
    POST /finish_weight_update               {"weight_version": "N"}
    POST /resume                             always, even after a failure

Nothing generates between the pause and the resume, so no KV computed with the old weights
can enter the cache after the pause emptied it: no separate ``/reset_prefix_cache`` is needed
(vLLM's pause raises, so the update fails, when the cache cannot be emptied).

Either way it then reads the server's state back through ``/collective_rpc`` (``deltasync_status``).
A server that fails is reported with the server's own error text; it never raises.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import ConfigError, FormatError
from ..protocol.auth import update_tag
from ..protocol.calls import PrefetchCall, StatusCall
from ..protocol.messages import ServedBody, check_version
from ..protocol.routes import MAX_POLL_S, STATUS_ROUTE, UPDATE_ROUTE, VERSION_HEADER
from ..protocol.token_versions import VersionedCompletion, versioned_completion
from .http import RequestError, ServerHandle, error_text
from .vllm_routes import update_through_vllm_routes

if TYPE_CHECKING:
    import httpx

__all__ = [
    "MAX_POLL_S",
    "STATUS_ROUTE",
    "UPDATE_ROUTE",
    "VERSION_HEADER",
    "BaseRolloutClient",
    "RequestError",
    "RolloutClient",
    "ServerHandle",
    "ServerResult",
    "ServerStatus",
    "UpdateReport",
    "check_update_mode",
]


#: Seconds an idle connection stays open for the next call. Below the 5 s after which vLLM's
#: server (uvicorn, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``) closes one, so that no request is sent on a
#: connection the server is closing at that moment (httpx's own default is 5 s too).
KEEPALIVE_S = 2.0

_T = TypeVar("_T")
_C = TypeVar("_C", bound="BaseRolloutClient")


@dataclass(frozen=True, kw_only=True)
class ServerResult:
    """What one server did in :meth:`RolloutClient.update` or :meth:`RolloutClient.prefetch`."""

    url: str
    ok: bool
    """The call succeeded on this server (for an update: it now serves the version)."""
    version: int | None = None
    """The version the server serves after the call (None: unknown, or the checkpoint it started with)."""
    fingerprint: str | None = None
    """Fingerprint of the served state, as the server computed it."""
    kind: str | None = None
    """"anchor" (loaded the newest anchor, then replayed deltas), "delta" or "none" (already there)."""
    nbytes: int = 0
    """Bytes the server downloaded from the bucket."""
    stage_s: float = 0.0
    """Seconds the server spent downloading, decoding and checking (0 if prefetched in time)."""
    apply_s: float = 0.0
    """Seconds the server spent loading the new values into the model."""
    paused_s: float = 0.0
    """Seconds the server could not generate: as the server measured it on the one-request route
    (from its pause to its resume; in "inflight" mode, the write between two engine steps), or
    as the client sees vLLM's five routes (from sending ``/pause`` to ``/resume`` answering)."""
    error: str | None = None
    """What went wrong, in the server's words; None when ok."""
    mode: str | None = None
    """How the update was applied ("pause" or "inflight"), where the server says."""
    note: str | None = None
    """Why an "inflight" update paused instead, where it did."""


@dataclass(frozen=True, kw_only=True)
class UpdateReport:
    """The outcome of :meth:`RolloutClient.update` across all servers."""

    version: int
    results: list[ServerResult]

    @property
    def ok(self) -> bool:
        """Every server serves ``version`` now."""
        return all(r.ok for r in self.results)

    @property
    def updated(self) -> list[str]:
        """URLs of the servers that serve ``version`` now."""
        return [r.url for r in self.results if r.ok]

    @property
    def failed(self) -> list[ServerResult]:
        """The servers that did not apply it, with their errors."""
        return [r for r in self.results if not r.ok]

    @property
    def paused_s(self) -> float:
        """The longest pause of any server."""
        return max((r.paused_s for r in self.results), default=0.0)


@dataclass(frozen=True, kw_only=True)
class ServerStatus:
    """What a server serves, from :meth:`RolloutClient.status`."""

    url: str
    ok: bool
    """The server answered and all its workers agree."""
    version: int | None = None
    """The served version (None before its first update: the checkpoint it started with)."""
    fingerprint: str | None = None
    """Fingerprint of the weights served. In "in-place" mode it is hashed from the live
    weights (every rank's share, each element once); in "reload" mode it is that of the
    exact copy the weights were loaded from."""
    mode: str | None = None
    """"in-place" (deltas are written into the live weights) or "reload" (layerwise reload;
    each worker's ``fallback`` names the parameters that could not be patched in place)."""
    error: str | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)
    """Each worker's own report (one per tensor/pipeline-parallel rank): ``version``,
    ``fingerprint`` (served), ``mode``, ``fallback``, ``last_update``, ``prefetch``..."""
    follow: dict[str, Any] | None = None
    """From :meth:`RolloutClient.served`: the server's follow mode (``enabled``, ``interval``,
    ``latest_seen``, ``lag``, ``last_error``, ``last_update_at``)."""
    view: str | None = None
    """From :meth:`RolloutClient.served`: the quantized view served (None: the bf16 chain);
    ``fingerprint`` is then the view's (``DeltaPublisher.view_fingerprint``)."""


def check_update_mode(mode: object) -> None:
    """Raise :class:`ConfigError` unless ``mode`` is an update mode :meth:`RolloutClient.update` takes."""
    if mode not in (None, "pause", "inflight"):
        raise ConfigError(f"mode must be 'pause', 'inflight' or None (the server's own), got {mode!r}")


def _combine(url: str, workers: list[dict[str, Any]]) -> ServerStatus:
    """One status from the workers' reports; their disagreement is an error."""
    states = {(w.get("version"), w.get("fingerprint")) for w in workers}
    if len(states) > 1:
        detail = "; ".join(
            f"rank {w.get('rank', i)} at version {w.get('version')} ({w.get('fingerprint')})"
            for i, w in enumerate(workers)
        )
        return ServerStatus(url=url, ok=False, error=f"the server's workers disagree: {detail}", workers=workers)
    version, fingerprint = states.pop()
    modes = {w.get("mode") for w in workers}
    mode = modes.pop() if len(modes) == 1 else "reload"
    return ServerStatus(url=url, ok=True, version=version, fingerprint=fingerprint, mode=mode, workers=workers)


class BaseRolloutClient(ABC):
    """Tells rollout servers which committed version to serve (:meth:`update`), and reads back
    what they serve (:meth:`status`); a subclass says how one server does each.
    :class:`RolloutClient` (full weights) and ``AdapterRolloutClient`` (LoRA adapters) are the two.

    Args:
        urls: base URL of each server (``http://host:port``), or one URL.
        token: the servers' ``DELTASYNC_TOKEN``. When set, updates and prefetches carry the
            tag HMAC-SHA256(token, ``"deltasync-update:<N>"``) and every request carries
            ``Authorization: Bearer <token>`` (for ``vllm_ext.TokenMiddleware``).
        timeout: seconds any one HTTP call may take (an update includes the download).
        transport: an ``httpx`` transport to send requests through (tests, proxies).

    All calls share one ``httpx.Client`` (made on first use): its connections stay open from
    one call to the next, and no call pays for a new client (10-30 ms of CPU each, nearly all
    of it loading the TLS certificates, even for ``http://`` servers). A child process forked
    from this one makes its own. :meth:`close` (or ``with``) closes the connections.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        token: str | None = None,
        *,
        timeout: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if isinstance(urls, str):
            urls = [urls]
        self.urls = [str(u).rstrip("/") for u in urls]
        if not self.urls:
            raise ConfigError("urls is empty: give the base URL of at least one server, e.g. http://host:8000")
        if len(set(self.urls)) != len(self.urls):
            raise ConfigError(f"urls lists a server twice: {self.urls}")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"server URL {url!r} must start with http:// or https://")
        if token is not None and not token:
            raise ConfigError("token is empty: pass the servers' DELTASYNC_TOKEN, or None for servers without one")
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        self.token = token
        self.timeout = float(timeout)
        self.transport = transport
        self._connections = _Connections(self)

    def close(self) -> None:
        """Close the open connections (a later call opens new ones)."""
        self._connections.close()

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, version: int) -> UpdateReport:
        """Make every server serve committed ``version``; waits until each has applied it or failed."""
        return self._update_each(version, self._update_one)

    def status(self) -> dict[str, ServerStatus]:
        """What each server serves (all of a server's workers must agree)."""
        statuses = self._each(self._status_one)
        return {s.url: s for s in statuses}

    @abstractmethod
    def _update_one(self, server: ServerHandle, version: int, tag: str | None) -> ServerResult:
        """Make one server serve ``version``; report, never raise."""

    @abstractmethod
    def _status_one(self, server: ServerHandle) -> ServerStatus:
        """What one server serves; report, never raise."""

    def _update_each(self, version: int, update_one: Callable[[ServerHandle, int, str | None], ServerResult]) -> UpdateReport:
        version = check_version(version)
        tag = self._tag(version)
        return UpdateReport(version=version, results=self._each(lambda server: update_one(server, version, tag)))

    def _tag(self, version: int) -> str | None:
        return None if self.token is None else update_tag(self.token, version)

    def _each(self, call: Callable[[ServerHandle], _T]) -> list[_T]:
        """Run ``call`` for every server, a thread each; results in ``urls`` order."""
        client = self._connections.get()

        def run(url: str) -> _T:
            return call(ServerHandle(client, url))

        if len(self.urls) == 1:
            return [run(self.urls[0])]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.urls), thread_name_prefix="deltasync") as pool:
            return list(pool.map(run, self.urls))


class RolloutClient(BaseRolloutClient):
    """Tells rollout servers which committed version of the full weights to serve, stages it
    ahead (:meth:`prefetch`), and reads back what they serve.

    Args: as :class:`BaseRolloutClient`.
    """

    @functools.wraps(BaseRolloutClient.__init__)  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # url -> whether the server answers UPDATE_ROUTE (absent: not known yet).
        self._one_route: dict[str, bool] = {}

    # ------------------------------------------------------------------ public

    def update(self, version: int, *, mode: str | None = None) -> UpdateReport:
        """Make every server serve committed ``version``; waits until each has applied it or failed.

        ``mode``: "inflight" (written between two engine steps, no pause; servers with
        ``vllm_ext.UpdateMiddleware`` whose parameters are all patched in place, else they pause
        and say so) or "pause"; None: each server's own ``--update-mode``.
        """
        check_update_mode(mode)
        return self._update_each(version, lambda server, number, tag: self._update_one(server, number, tag, mode))

    def prefetch(self, version: int) -> dict[str, ServerResult]:
        """Servers start downloading and decoding ``version`` in the background and keep generating.

        A later :meth:`update` to the same version then only loads it. Returns at once.
        """
        version = check_version(version)
        tag = self._tag(version)
        results = self._each(lambda server: self._prefetch_one(server, version, tag))
        return {r.url: r for r in results}

    def wait_prefetched(self, version: int, *, timeout: float = 600.0, poll: float = 0.05) -> dict[str, bool]:
        """Wait until every server has finished prefetching ``version`` (ready or failed).

        Lets a trainer hold back the pause until the servers only have to swap the version in.
        Returns url -> whether that server has it staged; a server that failed to prefetch, or
        doesn't answer, is False (its update will stage again, or report the error).

        The status is read after ``poll`` seconds, then twice as long each time, up to
        :data:`MAX_POLL_S`: each read is a call into every worker between two engine steps, and
        staging takes a second or more, so a fixed fast poll would slow generation for nothing.
        """
        version = check_version(version)
        deadline = time.monotonic() + timeout
        done: dict[str, bool] = {}
        delay = poll
        while True:
            for url, state in self.status().items():
                if url in done:
                    continue
                jobs = [w.get("prefetch") for w in state.workers] if state.ok else []
                if not state.ok or any(j is None or j.get("version") != version for j in jobs):
                    done[url] = False  # nothing (more) to wait for
                elif all(j.get("state") in ("ready", "failed") for j in jobs):  # type: ignore[union-attr]
                    done[url] = all(j.get("state") == "ready" for j in jobs)  # type: ignore[union-attr]
            if len(done) == len(self.urls) or time.monotonic() > deadline:
                return {url: done.get(url, False) for url in self.urls}
            time.sleep(delay)
            delay = min(2 * delay, max(poll, MAX_POLL_S))

    def served(self) -> dict[str, ServerStatus]:
        """What each server reports serving on ``GET /deltasync/status`` (servers with
        ``vllm_ext.UpdateMiddleware``; ``follow`` holds its follow mode's state)."""
        return {s.url: s for s in self._each(self._served_one)}

    def wait_served(self, version: int, *, timeout: float = 600.0, poll: float = 0.1) -> dict[str, ServerStatus]:
        """Wait until every server reports serving ``version`` or newer (followers move by
        themselves), or ``timeout`` passes; returns what each reports last."""
        version = check_version(version)
        deadline = time.monotonic() + timeout
        while True:
            states = self.served()
            if all(s.ok and s.version is not None and s.version >= version for s in states.values()):
                return states
            if time.monotonic() > deadline:
                return states
            time.sleep(poll)

    def complete(self, body: dict[str, Any], *, chat: bool = False, url: str | None = None) -> VersionedCompletion:
        """One non-streamed completion (``chat``: chat completion) from ``url`` (default: the
        first server), with the version that sampled each token: ``.token_versions`` holds
        ``[(version, first_token), ...]`` per choice (see :func:`deltasync.parse_token_versions`).

        Raises :class:`RequestError` when the server refuses, and
        :class:`~deltasync.FormatError` when it does not report token versions.
        """
        import httpx

        target = self.urls[0] if url is None else str(url).rstrip("/")
        if target not in self.urls:
            raise ConfigError(f"url {url!r} is not one of this client's servers: {self.urls}")
        route = "/v1/chat/completions" if chat else "/v1/completions"
        if body.get("stream"):
            raise ConfigError("complete() takes non-streamed requests: drop 'stream' (a stream's versions arrive as "
                              "the SSE comment ': x-deltasync-token-versions ...' before data: [DONE])")  # fmt: skip
        try:
            response = self._connections.get().post(target + route, json=body)
        except httpx.HTTPError as exc:
            raise RequestError(f"POST {route}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise RequestError(f"POST {route}: HTTP {response.status_code}: {error_text(response)}", response.status_code)
        return versioned_completion(response.json(), response.headers)

    # ------------------------------------------------------------------ per server

    def _update_one(self, server: ServerHandle, version: int, tag: str | None, mode: str | None = None) -> ServerResult:
        error: str | None = None
        start = time.perf_counter()
        if self._one_route.get(server.url, True):
            body: dict[str, Any] = {"version": version, "auth": tag}
            if mode is not None:
                body["mode"] = mode
            answer: Any = None
            try:
                answer = server.post(UPDATE_ROUTE, body=body)
            except RequestError as exc:
                if exc.status == 404:  # a server without vllm_ext.UpdateMiddleware: vLLM's routes
                    self._one_route[server.url] = False
                else:
                    error = str(exc)  # the server resumed by itself, whatever failed
            else:
                self._one_route[server.url] = True
            if self._one_route.get(server.url) is not False:
                result = self._report(server, version, error, time.perf_counter() - start)
                if isinstance(answer, dict):
                    result = replace(result, mode=answer.get("mode"), note=answer.get("note"))
                    if isinstance(answer.get("paused_s"), (int, float)):
                        result = replace(result, paused_s=float(answer["paused_s"]))  # what the server measured
                    if answer.get("noop") is True and result.ok:  # already served: nothing was done
                        result = replace(result, kind="none", nbytes=0, stage_s=0.0, apply_s=0.0, paused_s=0.0)
                return result
        error, paused_s = update_through_vllm_routes(server, version, tag)
        return self._report(server, version, error, paused_s)

    def _report(self, server: ServerHandle, version: int, error: str | None, paused_s: float) -> ServerResult:
        """The result of an update, from the server's state read back after it."""
        try:
            state = self._status_one(server)
        except RequestError as exc:  # pragma: no cover - _status_one reports, never raises
            state = ServerStatus(url=server.url, ok=False, error=str(exc))
        last = _last_update(state, version)
        if error is None and not state.ok:
            error = f"updated, but its status could not be read: {state.error}"
        elif error is None and state.version != version:
            error = f"the server reports version {state.version} after the update to version {version}"
        return ServerResult(
            url=server.url,
            ok=error is None,
            version=state.version,
            fingerprint=state.fingerprint,
            kind=last.get("kind") if error is None else None,
            nbytes=int(last.get("nbytes", 0)) if error is None else 0,
            stage_s=float(last.get("stage_s", 0.0)) if error is None else 0.0,
            apply_s=float(last.get("apply_s", 0.0)) if error is None else 0.0,
            paused_s=paused_s,
            error=error,
        )

    def _prefetch_one(self, server: ServerHandle, version: int, tag: str | None) -> ServerResult:
        try:
            workers = server.rpc(PrefetchCall(version=version, auth=tag), self.timeout)
        except RequestError as exc:
            return ServerResult(url=server.url, ok=False, error=str(exc))
        failed = [w for w in workers if w.get("error")]
        state = self._status_one(server)
        error = None
        if failed:
            error = failed[0]["error"]
            if failed[0].get("state") == "failed":
                error = f"prefetch of version {version} failed: {error}"
        elif not state.ok:
            error = state.error
        first = workers[0]
        return ServerResult(
            url=server.url,
            ok=error is None,
            version=state.version,
            fingerprint=state.fingerprint,
            kind=first.get("kind"),
            nbytes=int(first.get("nbytes") or 0),
            stage_s=float(first.get("stage_s") or 0.0),
            error=error,
        )

    def _served_one(self, server: ServerHandle) -> ServerStatus:
        try:
            body = server.call("GET", STATUS_ROUTE, attempts=3)
            status = ServedBody.from_answer(body, f"{server.url}{STATUS_ROUTE}")
        except (RequestError, FormatError) as exc:
            return ServerStatus(url=server.url, ok=False, error=str(exc))
        return ServerStatus(
            url=server.url, ok=True, version=status.version, fingerprint=status.fingerprint, mode=status.mode,
            workers=[w.to_json() for w in status.workers], follow=status.follow, view=status.view,
        )

    def _status_one(self, server: ServerHandle) -> ServerStatus:
        try:
            workers = server.rpc(StatusCall(), self.timeout, attempts=3)
        except RequestError as exc:
            return ServerStatus(url=server.url, ok=False, error=str(exc))
        return _combine(server.url, workers)

def _last_update(state: ServerStatus, version: int) -> dict[str, Any]:
    """The workers' record of the update to ``version`` (slowest worker's times)."""
    records = [w.get("last_update") or {} for w in state.workers]
    records = [r for r in records if r.get("version") == version]
    if not records:
        return {}
    return {
        **records[0],
        "stage_s": max(float(r.get("stage_s", 0.0)) for r in records),
        "apply_s": max(float(r.get("apply_s", 0.0)) for r in records),
    }


class _Connections:
    """The one ``httpx.Client`` a :class:`BaseRolloutClient` sends through, made on first use,
    and made again in a process forked after that (a child must not write to its parent's
    connections)."""

    def __init__(self, owner: BaseRolloutClient) -> None:
        self.owner = owner
        self.lock = threading.Lock()
        self.client: httpx.Client | None = None
        self.pid = os.getpid()

    def get(self) -> httpx.Client:
        try:
            import httpx
        except ImportError as exc:  # pragma: no cover
            raise ConfigError("RolloutClient needs httpx: pip install httpx") from exc

        if self.pid != os.getpid():  # a forked child: its parent's lock and connections are not its own
            self.lock, self.client, self.pid = threading.Lock(), None, os.getpid()
        with self.lock:
            if self.client is None or self.client.is_closed:
                owner = self.owner
                headers = {"Authorization": f"Bearer {owner.token}"} if owner.token is not None else {}
                # No cap on connections (httpx's default is 100): every server of a large fleet
                # is updated at once, as when each call had a client of its own.
                limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S)
                self.client = httpx.Client(headers=headers, timeout=owner.timeout, transport=owner.transport, limits=limits)
            return self.client

    def close(self) -> None:
        with self.lock:
            client, self.client = self.client, None
        if client is not None and self.pid == os.getpid():
            client.close()
