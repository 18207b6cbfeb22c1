"""The shared secret between a trainer and its rollout servers.

A server started with ``DELTASYNC_TOKEN`` accepts an update to version N only with the tag
``HMAC-SHA256(token, "deltasync-update:N")`` (hex), and its HTTP control routes only with
``Authorization: Bearer <token>`` (see ``vllm_ext.TokenMiddleware``). The tag names nothing
but the version: the server's bucket is fixed when it starts, so a replayed tag can at
most re-apply a version the trainer committed.
"""

from __future__ import annotations

import hashlib
import hmac

from ..errors import AuthError
from .env import TOKEN_ENV

__all__ = ["TOKEN_ENV", "update_tag", "check_update_tag", "bearer_matches"]


def update_tag(token: str, version: int) -> str:
    """The authentication tag of an update to ``version``: hex HMAC-SHA256."""
    return hmac.new(token.encode(), f"deltasync-update:{version}".encode(), hashlib.sha256).hexdigest()


def check_update_tag(token: str | None, version: int, tag: object) -> None:
    """Raise :class:`AuthError` unless ``tag`` authenticates ``version`` (no-op without a token)."""
    if token is None:
        return
    if tag is None or tag == "":
        raise AuthError(
            f"the update to version {version} carries no auth tag, but this server requires one "
            f"({TOKEN_ENV} is set): give the trainer's RolloutClient the same token"
        )
    expected = update_tag(token, version).encode()
    if not isinstance(tag, str) or not hmac.compare_digest(tag.encode(), expected):
        raise AuthError(
            f"the auth tag of the update to version {version} is wrong: the client's token differs "
            f"from this server's {TOKEN_ENV}"
        )


def bearer_matches(token: str, authorization: str | None) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <token>`` (constant time)."""
    if not authorization:
        return False
    scheme, _, value = authorization.partition(" ")
    # Compare digests: equal length, so the comparison time says nothing about the token.
    given = hashlib.sha256(value.strip().encode()).digest()
    return scheme.lower() == "bearer" and hmac.compare_digest(given, hashlib.sha256(token.encode()).digest())
