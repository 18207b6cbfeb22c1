"""The routes and headers of a server's update surface: one definition for both sides.

The trainer's clients (:class:`deltasync.RolloutClient`, :class:`deltasync.AdapterRolloutClient`)
call these routes and read these headers; ``vllm_ext``'s middlewares serve and write them.
docs/server.md describes each.
"""

from __future__ import annotations

__all__ = [
    "INFERENCE_ROUTES",
    "LORA_STATUS_ROUTE",
    "LORA_UPDATE_ROUTE",
    "MAX_POLL_S",
    "STATUS_ROUTE",
    "TOKEN_VERSIONS_HEADER",
    "UPDATE_ROUTE",
    "VERSIONS_HEADER",
    "VERSION_HEADER",
]

#: The one-request update route (stage, pause or not, apply, resume): ``POST {"version": N, "auth": TAG}``.
UPDATE_ROUTE = "/deltasync/update"
#: What the server serves, its follow mode and its last heal, as JSON (``GET``).
STATUS_ROUTE = "/deltasync/status"
#: The adapter sync's update route (``vllm_ext.LoraSyncMiddleware``).
LORA_UPDATE_ROUTE = "/deltasync/lora/update"
#: The adapter sync's status route.
LORA_STATUS_ROUTE = "/deltasync/lora/status"
#: The generation routes whose answers carry the version headers below.
INFERENCE_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions"})

#: The response header of completions: the version served when the request was admitted.
VERSION_HEADER = "x-deltasync-version"
#: The versions a response's tokens came from, first to last (``"3-5"``).
VERSIONS_HEADER = "x-deltasync-versions"
#: Where each version began in each choice's output (:mod:`deltasync.protocol.token_versions`);
#: a header of a whole answer, an SSE comment (``: x-deltasync-token-versions ...``) of a stream.
TOKEN_VERSIONS_HEADER = "x-deltasync-token-versions"

#: The longest wait between two status reads of :meth:`deltasync.RolloutClient.wait_prefetched`
#: (and of the server's own wait for its workers' staging), which start fast and back off to it.
MAX_POLL_S = 0.4
