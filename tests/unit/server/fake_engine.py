"""A second engine, for the tests: both seams of the server core (:class:`deltasync.server.seam.Engine`
and :class:`deltasync.server.seam.Worker`) on a small torch model, in one process, with no vLLM.

It is the proof that an engine is one package against the two Protocols: the whole update flow
(the route's :class:`~deltasync.server.server_sync.ServerSync`, the workers'
:class:`~deltasync.server.updater.WorkerUpdater`, in place or by reload) runs on it. The
scenarios at the end run in a child interpreter where ``vllm`` cannot be imported
(``test_fake_engine.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from deltasync.protocol import ApplyCall, WorkerCall
from deltasync.server.checkpoint import ServedCheckpoint
from deltasync.server.config import ServerConfig
from deltasync.server.seam import Applied, Engine, RequestTokens, SentRequest, Worker
from deltasync.server.updater import WorkerUpdater

TOKEN = "tok"


class TinyNet(torch.nn.Module):
    """The trainer's model: two projections and a norm."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16, bias=False)
        self.norm = torch.nn.Parameter(torch.ones(16))


class ServedNet(torch.nn.Module):
    """The served model: bf16 copies of :class:`TinyNet`'s parameters, loaded by name as an
    engine's loader loads checkpoint tensors."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = list(state)
        for name, tensor in state.items():
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(tensor.clone(), requires_grad=False))

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            getattr(self, name.replace(".", "_")).data.copy_(tensor)
            loaded.add(name)
        return loaded

    def state(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name.replace(".", "_")).data for name in self.names}


class FakeWorker:
    """One worker (a :class:`~deltasync.server.seam.Worker`): one rank, the model as loaded,
    ``reload`` by copying whole tensors; ``reload_only`` refuses writes in place (a platform
    check), so that the reload target serves."""

    def __init__(self, model: ServedNet, folder: Path, *, reload_only: bool = False) -> None:
        self._model = model
        self.folder = folder
        self.reload_only = reload_only
        self.reloaded: list[list[str]] = []

    @property
    def model(self) -> torch.nn.Module:
        return self._model

    @property
    def rank(self) -> int:
        return 0

    def rank_index(self) -> int:
        return 0

    def is_last_rank(self) -> bool:
        return True

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def checkpoint(self) -> ServedCheckpoint:
        return ServedCheckpoint.read(str(self.folder))

    def packed(self) -> dict[str, list[str]]:
        return {}

    def in_place_refusal(self) -> str | None:
        return "this fake engine reloads" if self.reload_only else None

    def loading(self, scheme: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def transformed(self, module: torch.nn.Module) -> str | None:
        return None

    def reload(self, weights: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
        pairs = list(weights)
        self.reloaded.append([name for name, _ in pairs])
        with torch.no_grad():
            self._model.load_weights(pairs)
        return []

    def checkpoint_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors.torch import load_file

        return iter(load_file(self.folder / "model.safetensors").items())


#: The worker calls of :mod:`deltasync.protocol.calls`, as this engine's workers answer them.
METHODS: dict[str, Callable[..., Any]] = {
    "deltasync_status": WorkerUpdater.status,
    "deltasync_prefetch": WorkerUpdater.prefetch,
    "deltasync_begin": WorkerUpdater.begin,
    "deltasync_apply": WorkerUpdater.update,
    "deltasync_verify": WorkerUpdater.verify,
}


class EngineRequests:
    """What every fake engine here shares: the requests it runs (engine id -> tokens sampled so
    far), the API server's watch on them, pause and resume, the label and the salt. The calls
    the flow made are recorded in order (``calls``); subclasses answer ``call_workers``."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.paused = False
        self.label_now: int | None = None
        self.requests: dict[str, int] = {}
        self._sent: Callable[[SentRequest], None] | None = None

    async def call_workers(self, call: WorkerCall[Any]) -> list[Any]:
        raise NotImplementedError

    async def apply(self, call: ApplyCall) -> Applied:
        tokens = [RequestTokens(SentRequest(i, i.rsplit("-", 1)[0], 0), n) for i, n in self.requests.items()]
        return Applied(await self.call_workers(call), tokens)

    def watch_requests(self, sent: Callable[[SentRequest], None]) -> None:
        self._sent = sent

    def add(self, engine_id: str, external: str, tokens: int = 0) -> None:
        """A request arrives at the engine (through the API server), ``tokens`` sampled already."""
        assert self._sent is not None
        self._sent(SentRequest(engine_id, external, 0))
        self.requests[engine_id] = tokens

    async def pause(self) -> None:
        self.calls.append("pause")
        self.paused = True

    async def resume(self) -> None:
        self.calls.append("resume")
        self.paused = False

    async def label(self, version: int) -> None:
        self.calls.append(("label", version))
        self.label_now = version

    def salt(self, request: dict[str, Any], version: int | None) -> dict[str, Any]:
        return {**request, "cache_salt": f"v{version}"}


class FakeEngine(EngineRequests):
    """The engine (an :class:`~deltasync.server.seam.Engine`) over in-process workers: a call
    runs on each in turn (nothing steps here, so every call is between two steps)."""

    def __init__(self, updaters: list[WorkerUpdater]) -> None:
        super().__init__()
        self.updaters = updaters

    async def call_workers(self, call: WorkerCall[Any]) -> list[Any]:
        self.calls.append(call.method)
        return [METHODS[call.method](updater, *call.args()) for updater in self.updaters]


def _check_seams(engine: Engine, worker: Worker) -> None:
    """Both fakes are what the Protocols ask for (mypy checks the same where this is typed)."""


# --------------------------------------------------------------------------- scenarios


class World:
    """A trainer publishing to a bucket, and a server of one fake worker serving version 0."""

    def __init__(self, root: Path, *, reload_only: bool = False, update_mode: str = "pause",
                 follow: bool = False) -> None:  # fmt: skip
        from safetensors.torch import save_file

        from deltasync import DeltaPublisher
        from deltasync.server.server_sync import FollowConfig, ServerSync

        self.bucket = root / "bucket"
        self.trainer = TinyNet()
        self.publisher = DeltaPublisher(self.bucket, self.trainer, None)
        self.publisher.publish()
        folder = root / "model"
        folder.mkdir()
        save_file(self.bf16(), folder / "model.safetensors")
        self.worker = FakeWorker(ServedNet(self.bf16()), folder, reload_only=reload_only)
        config = ServerConfig(bucket=str(self.bucket), token=TOKEN, staging_cpus="inherit")
        self.updater = WorkerUpdater(self.worker, config)
        self.engine = FakeEngine([self.updater])
        _check_seams(self.engine, self.worker)
        follow_config = FollowConfig(enabled=follow, interval=0.5, bucket=str(self.bucket) if follow else None)
        self.sync = ServerSync(self.engine, token=TOKEN, follow=follow_config, update_mode=update_mode)

    def bf16(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().to(torch.bfloat16).contiguous() for name, t in self.trainer.state_dict().items()}

    def train(self, seed: int) -> int:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in self.trainer.parameters():
                mask = torch.rand(param.shape, generator=gen) < 0.3
                param.add_(torch.randn(param.shape, generator=gen) * 0.05 * mask)
        return self.publisher.publish().version

    def bring_to(self, version: int) -> Any:
        from deltasync.protocol.auth import update_tag

        return asyncio.run(self.sync.bring_to(version, update_tag(TOKEN, version)))

    def assert_serves(self, version: int, mode: str) -> None:
        from deltasync import fingerprint

        served = self.worker._model.state()
        for name, tensor in self.bf16().items():
            assert torch.equal(served[name].view(torch.int16), tensor.view(torch.int16)), name  # bit-equal
        status = self.updater.status()
        assert (status["version"], status["mode"], status["tainted"]) == (version, mode, None), status
        assert status["fingerprint"] == fingerprint(self.bf16()), status
        assert self.updater.verify()["ok"], self.updater.verify()
        assert self.sync.served == version and self.engine.label_now == version


def scenario_paused(root: Path, reload_only: bool) -> None:
    world = World(root, reload_only=reload_only)
    mode = "reload" if reload_only else "in-place"
    for seed in (1, 2, 3):
        version = world.train(seed)
        outcome = world.bring_to(version)
        assert outcome.ok and outcome.mode == "pause", outcome
        world.assert_serves(version, mode)
        assert not world.engine.paused
    assert bool(world.worker.reloaded) == reload_only, world.worker.reloaded
    # Two versions at once (a catch-up), and a version already served (a no-op).
    world.train(4)
    version = world.train(5)
    assert world.bring_to(version).ok
    world.assert_serves(version, mode)
    assert world.bring_to(version).noop


def scenario_inflight(root: Path) -> None:
    world = World(root, update_mode="inflight")
    version = world.train(1)
    assert world.bring_to(version).ok  # the first update, nothing in flight
    marker = world.sync.tokens.track(version)
    world.engine.add(f"cmpl-{marker}-0-x", f"cmpl-{marker}-0", tokens=5)  # five tokens sampled at ``version``
    newer = world.train(2)
    outcome = world.bring_to(newer)
    assert outcome.ok and outcome.mode == "inflight" and "pause" not in world.engine.calls, outcome
    world.assert_serves(newer, "in-place")
    assert world.sync.tokens.versions(marker) == [[(version, 0), (newer, 5)]]


def scenario_follow(root: Path) -> None:
    world = World(root, follow=True)
    world.train(1)
    version = world.train(2)
    assert asyncio.run(world.sync.follow_once()) == 0.5
    world.assert_serves(version, "in-place")  # straight to the newest, tagged by the server itself
    assert world.sync.follow_status()["lag"] == 0 and world.sync.last_error is None
    version = world.train(3)
    asyncio.run(world.sync.follow_once())
    world.assert_serves(version, "in-place")
