"""The API-server side of every update: the update flow, follow mode and the metrics of one
API-server process, held together.

- :class:`deltasync.server.flow.UpdateFlow` brings the server to version N (stage while generating,
  apply between two steps or paused, label, resume); push requests and the follower take turns.
- :class:`deltasync.server.follower.Follower` reads the bucket's committed pointer and runs that flow
  for each newer version.
- :class:`deltasync.server.metrics.Metrics` counts what the flow did; :class:`ServerSync` owns it and
  exposes it on the engine's ``/metrics`` while the server runs.

All of it drives the engine through :class:`deltasync.server.seam.Engine` (vLLM's is
:class:`vllm_ext._vllm_engine.VllmEngine`) and imports no vLLM. The push route
(``POST /deltasync/update``), the follower and the status route are wired in by
:class:`vllm_ext.UpdateMiddleware`. vLLM's own five weight-update routes (the ``"delta"``
weight-transfer backend) reach the same worker-side update (``WorkerUpdater.update``); their
pause and resume are the caller's.
"""

from __future__ import annotations

from typing import Any

from deltasync.protocol import UPDATE_MODE_ENV, UPDATE_MODES, UpdateMode

from .flow import UpdateFlow, UpdateOutcome
from .follower import FollowConfig, Follower
from .metrics import Metrics
from .seam import Engine

__all__ = ["UPDATE_MODE_ENV", "UPDATE_MODES", "FollowConfig", "ServerSync", "UpdateOutcome"]


class ServerSync(UpdateFlow):
    """The update flow of one API-server process, with its follower and its metrics."""

    def __init__(
        self,
        engine: Engine,
        *,
        token: str | None,
        follow: FollowConfig,
        update_mode: UpdateMode = "pause",
        metrics: Metrics | None = None,
    ) -> None:
        super().__init__(engine, token=token, update_mode=update_mode, metrics=metrics)
        self.follower = Follower(self, follow)
        """Follow mode (reads the pointer and runs :meth:`bring_to`; idle unless enabled)."""

    def start(self) -> None:
        """At the server's start-up: expose the metrics, learn what is served and, in follow
        mode, start following."""
        self.metrics.expose()
        self.follower.start()

    async def stop(self) -> None:
        """At the server's shutdown: stop following and hide the metrics."""
        await self.follower.stop()
        self.metrics.hide()

    async def follow_once(self) -> float:
        """One read of the pointer (see :meth:`Follower.follow_once`)."""
        return await self.follower.follow_once()

    def follow_status(self) -> dict[str, Any]:
        """Follow mode's part of ``GET /deltasync/status``."""
        return self.follower.status()

    @property
    def latest_seen(self) -> int | None:
        """The newest committed version the follower has read."""
        return self.follower.latest_seen

    @property
    def last_error(self) -> str | None:
        """Why the follower's last read or update failed (None after a success)."""
        return self.follower.last_error
