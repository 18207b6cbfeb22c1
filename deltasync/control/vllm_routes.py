"""vLLM's own weight-update routes: how a client updates a server without ``vllm_ext``'s route.

A server without ``vllm_ext.UpdateMiddleware`` answers 404 on the one-request update route;
:func:`update_through_vllm_routes` then takes vLLM's sequence, five round trips::

    POST /pause?mode=keep&clear_cache=true
    POST /start_weight_update
    POST /update_weights                     {"update_info": {"version": N, "auth": TAG}}
    POST /finish_weight_update               {"weight_version": "N"}
    POST /resume                             always, even after a failure

(:mod:`deltasync.control.client` says why no separate prefix-cache reset is needed.)
"""

from __future__ import annotations

import time

from .http import RequestError, ServerHandle

__all__ = ["update_through_vllm_routes"]


def update_through_vllm_routes(server: ServerHandle, version: int, tag: str | None) -> tuple[str | None, float]:
    """Make ``server`` apply ``version`` through vLLM's five routes; a failed call is reported.

    Returns the error (None: applied, as far as the routes say; the caller reads the state
    back) and the seconds from sending ``/pause`` to ``/resume`` answering.
    """
    error: str | None = None
    start = time.perf_counter()
    refused_pause = False
    try:
        try:
            server.post("/pause", params={"mode": "keep", "clear_cache": "true"})
        except RequestError as exc:
            refused_pause = exc.status is not None  # an answer, so certainly not paused
            raise
        _start_update(server)
        try:
            server.post("/update_weights", body={"update_info": {"version": version, "auth": tag}})
        except RequestError:
            _close_session(server)
            raise
        server.post("/finish_weight_update", body={"weight_version": str(version)})
    except RequestError as exc:
        error = str(exc)
    finally:
        try:
            server.post("/resume", attempts=3)
        except RequestError as exc:
            if not refused_pause:
                error = f"{error}; then " if error else ""
                error += f"{exc} (the server may still be paused)"
        paused_s = time.perf_counter() - start
    return error, paused_s


def _start_update(server: ServerHandle) -> None:
    """Open a weight-update session, closing one that a client before left open."""
    try:
        server.post("/start_weight_update")
    except RequestError as exc:
        if "already active" not in str(exc):
            raise
        # A client that died between start and finish left a session open. The delta
        # engine loads nothing between the calls, so closing it is safe.
        _close_session(server)
        server.post("/start_weight_update")


def _close_session(server: ServerHandle) -> None:
    """End a weight-update session that may be open on some of the server's workers.

    vLLM closes the session of a worker whose update raised, but with several workers
    only the last one raises (see ``vllm_ext``); the others still hold theirs. Closing
    without a version leaves the served version's label alone; the workers without a
    session refuse, and that refusal means nothing here.
    """
    try:
        server.post("/finish_weight_update", attempts=3)
    except RequestError:
        pass
