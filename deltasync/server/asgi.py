"""Small ASGI pieces shared by deltasync's own routes (the update and LoRA middlewares)."""

from __future__ import annotations

import json
from typing import Any

from deltasync.protocol import TOKEN_ENV, bearer_matches

__all__ = ["answer", "error_body", "header", "read_body", "refused", "unauthorized"]


async def refused(scope: Any, send: Any, route: str, token: str | None) -> bool:
    """Answer a request for one of deltasync's own ``POST`` routes that is not a ``POST`` (405) or
    lacks the server's bearer token (401); True when it was answered so."""
    if scope.get("method") != "POST":
        await answer(send, 405, error_body(f"{route} takes POST", "MethodNotAllowed", 405))
        return True
    given = header(scope, b"authorization")
    if token is not None and not bearer_matches(token, given):
        await answer(send, 401, error_body(unauthorized(route, given), "Unauthorized", 401))
        return True
    return False


def unauthorized(route: str, given: str | None) -> str:
    """Why a request for ``route`` with the ``Authorization`` header ``given`` is refused."""
    if given is None:
        return f"{route} needs 'Authorization: Bearer <token>' with this server's {TOKEN_ENV}; none was sent"
    return f"{route}: the bearer token is wrong (it must equal this server's {TOKEN_ENV})"


def error_body(message: str, kind: str, status: int) -> dict[str, Any]:
    """An error answer in vLLM's shape (``{"error": {"message", "type", "code"}}``)."""
    return {"error": {"message": message, "type": kind, "code": status}}


def header(scope: Any, name: bytes) -> str | None:
    """The value of request header ``name`` (lower-case bytes), or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def read_body(receive: Any) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def answer(send: Any, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
