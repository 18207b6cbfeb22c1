"""HTTP calls to one rollout server, as the control plane's clients make them.

:class:`ServerHandle` sends one request (retrying transport errors where the call is safe to
repeat) and turns every failure into a :class:`RequestError` that names the route and carries
the server's own words (:func:`error_text` reads them out of vLLM's and FastAPI's error bodies).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

    from ..protocol.calls import WorkerCall

__all__ = ["RequestError", "ServerHandle", "error_text"]


class RequestError(Exception):
    """One HTTP call failed; the message names the route and carries the server's words."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """The HTTP status the server answered with; None when no answer came."""


class ServerHandle:
    """HTTP calls to one server, each failure turned into a :class:`RequestError`."""

    def __init__(self, client: httpx.Client, url: str) -> None:
        self.client = client
        self.url = url

    def post(self, route: str, *, body: Any = None, params: dict[str, str] | None = None, attempts: int = 1) -> Any:
        """POST; ``attempts`` > 1 retries transport errors (only for calls that are safe to repeat)."""
        return self.call("POST", route, body=body, params=params, attempts=attempts)

    def call(self, method: str, route: str, *, body: Any = None, params: dict[str, str] | None = None,
             attempts: int = 1) -> Any:  # fmt: skip
        """One request; failures become :class:`RequestError` (see :meth:`post`)."""
        import httpx

        for attempt in range(attempts):
            try:
                response = self.client.request(method, self.url + route, json=body, params=params)
                break
            except httpx.TransportError as exc:
                # After a 500, vLLM's server closes the connection; a request sent on it
                # right away fails without reaching the server. A retry opens a new one.
                if attempt + 1 < attempts:
                    time.sleep(0.1 * (attempt + 1))
                    continue
                raise RequestError(f"{method} {route}: {type(exc).__name__}: {str(exc) or 'no answer'}") from exc
            except httpx.HTTPError as exc:
                raise RequestError(f"{method} {route}: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            status = response.status_code
            raise RequestError(f"{method} {route}: HTTP {status}: {error_text(response)}", status)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            return response.text

    def rpc(self, call: WorkerCall[Any], timeout: float, *, attempts: int = 1) -> list[Any]:
        """``call`` on every worker of the server (``POST /collective_rpc``): each worker's
        answer, an object, in rank order."""
        method = call.method
        body = {"method": method, "args": list(call.args()), "timeout": timeout}
        answer = self.post("/collective_rpc", body=body, attempts=attempts)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list) or not results:
            raise RequestError(f"POST /collective_rpc ({method}): unexpected answer {answer!r}")
        for rank, result in enumerate(results):
            if not isinstance(result, dict):
                raise RequestError(f"POST /collective_rpc ({method}): worker {rank} answered {result!r}")
        return results


def error_text(response: httpx.Response) -> str:
    """The message in a vLLM / FastAPI error body, else the body itself."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:4000] or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in body:
            detail = body["detail"]
            return detail if isinstance(detail, str) else json.dumps(detail)
        if body.get("message"):
            return str(body["message"])
    return json.dumps(body)[:4000]
