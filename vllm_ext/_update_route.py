"""``--middleware vllm_ext.UpdateMiddleware``: a whole server update in one HTTP request.

vLLM's own sequence for a weight update is five HTTP calls (``/pause``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update``, ``/resume``), each a round trip through the API
server, and vLLM's ``pause_generation`` sleeps 20 ms after pausing (so that outputs of requests
it aborts come out first; nothing is aborted in ``keep`` mode). Inside the pause that is
several times the cost of writing a sparse delta in place. This middleware adds one route,
run in the API-server process::

    POST /deltasync/update {"version": N, "auth": TAG}

It pauses the scheduler in ``keep`` mode emptying the caches (in-flight requests freeze and
recompute their KV with the new weights on resume; no KV of the old weights is reused), runs
``deltasync_apply`` on every worker (one ``collective_rpc``: the same staged, checked,
all-ranks-or-none apply as the weight-transfer backend), labels the served weight version,
and resumes, whatever happened. The answer carries the workers' results and the seconds the
scheduler was paused. It needs ``Authorization: Bearer $DELTASYNC_TOKEN`` when the server has a
token, and the update's tag, like every update. :class:`deltasync.RolloutClient` uses it when
a server has it and vLLM's five routes otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from deltasync._auth import TOKEN_ENV
from deltasync._client import UPDATE_ROUTE

from ._asgi import answer, error_body, read_body, refused
from ._middleware import route_path

__all__ = ["UPDATE_ROUTE", "UpdateMiddleware"]

logger = logging.getLogger(__name__)


class UpdateMiddleware:
    """ASGI middleware adding ``POST /deltasync/update`` (see the module)."""

    def __init__(self, app: Any, token: str | None = None) -> None:
        self.app = app
        self.token = token if token is not None else os.environ.get(TOKEN_ENV) or None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or route_path(scope) != UPDATE_ROUTE:
            await self.app(scope, receive, send)
            return
        if await refused(scope, send, UPDATE_ROUTE, self.token):
            return
        try:
            request = json.loads(await read_body(receive) or b"{}")
            if not isinstance(request, dict) or set(request) - {"version", "auth"}:
                raise ValueError('the body must be a JSON object {"version": N, "auth": TAG}')
        except ValueError as exc:
            await answer(send, 400, error_body(f"{UPDATE_ROUTE}: bad body ({exc})", "BadRequest", 400))
            return
        status, payload = await _update(scope["app"].state.engine_client, request.get("version"), request.get("auth"))
        await answer(send, status, payload)


async def _update(engine: Any, version: object, auth: object) -> tuple[int, dict[str, Any]]:
    """Pause, apply on every worker, label, resume; returns the HTTP status and the answer."""
    start = time.perf_counter()
    paused = False
    try:
        await _pause(engine)
        paused = True
        results = await engine.collective_rpc("deltasync_apply", args=(version, auth))
        failed = [r for r in results if isinstance(r, dict) and r.get("error")]
        if not failed:
            await engine.update_weight_version(str(version))
    except Exception as exc:  # noqa: BLE001  (the worker's own message names what was wrong)
        status = 500 if paused else 503
        message = str(exc) if paused else f"pausing the server failed ({type(exc).__name__}: {exc})"
        return status, error_body(message, type(exc).__name__, status)
    finally:
        if paused:
            await engine.resume_generation()
        paused_s = time.perf_counter() - start
    if failed:  # a worker reported an error without raising (not the last rank): never a success
        return 500, error_body(str(failed[0]["error"]), "UpdateError", 500)
    return 200, {"results": results, "paused_s": paused_s}


async def _pause(engine: Any) -> None:
    """``engine.pause_generation(mode="keep", clear_cache=True)`` without its 20 ms sleep, which
    only orders the outputs of aborted requests (``keep`` aborts none)."""
    core = getattr(engine, "engine_core", None)
    if core is None or not hasattr(core, "pause_scheduler_async"):
        await engine.pause_generation(mode="keep", clear_cache=True)
        return
    renderer = getattr(engine, "renderer", None)
    if renderer is not None and hasattr(renderer, "clear_mm_cache_async"):
        await renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode="keep", clear_cache=True)
