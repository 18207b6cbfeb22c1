"""``--middleware vllm_ext.UpdateMiddleware``: deltasync's update route over vLLM's engine.

The route itself (``/deltasync/update``, ``/deltasync/status``, follow mode, the version
headers, the metrics) is engine-neutral: :class:`deltasync.server.update_route.UpdateRoute`.
This module only builds vLLM's engine (:class:`._vllm_engine.VllmEngine`) from the API server's
state.
"""

from __future__ import annotations

from typing import Any

from deltasync.server.server_sync import FollowConfig
from deltasync.server.update_route import UpdateRoute

from ._vllm_engine import VllmEngine

__all__ = ["UpdateMiddleware"]


def _vllm_engine(scope: Any) -> VllmEngine:
    return VllmEngine(scope["app"].state.engine_client)


class UpdateMiddleware(UpdateRoute):
    """:class:`~deltasync.server.update_route.UpdateRoute` over the vLLM API server's engine."""

    def __init__(
        self, app: Any, token: str | None = None, follow: FollowConfig | None = None, update_mode: str | None = None
    ) -> None:
        super().__init__(app, _vllm_engine, token=token, follow=follow, update_mode=update_mode)
