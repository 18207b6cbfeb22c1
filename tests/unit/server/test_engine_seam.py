"""The engine seam (``deltasync.server.seam.Engine``): the server core imports no engine, and the
flow runs on any engine that keeps the seam's promises.

The flow is driven here by a small fake engine that implements the Protocol (not vLLM's
client): it tests the seam itself, the contract an SGLang port would implement. vLLM's
implementation is exercised by the servers of ``integration/vllm_ext`` and, with a recording
vLLM-shaped client, by ``test_update_route.py``.
"""

from __future__ import annotations

import ast
import asyncio
from typing import Any

from fake_engine import EngineRequests
from servers import REPO_ROOT

from deltasync.protocol import ApplyCall, BeginCall, StatusCall, WorkerCall
from deltasync.protocol.auth import update_tag

def _imports(path) -> set[str]:
    """Every module ``path`` imports, at any depth of its code (relative ones as ``.name``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add("." * node.level + (node.module or ""))
            if node.level and not node.module:
                found |= {"." + alias.name for alias in node.names}
    return found


def test_the_server_core_imports_no_engine():
    for path in sorted((REPO_ROOT / "deltasync" / "server").glob("*.py")):
        engine = sorted(i for i in _imports(path) if i.split(".")[0] in ("vllm", "vllm_ext", "sglang"))
        assert not engine, f"deltasync/server/{path.name} imports {engine}: reach the engine through its seams"


def test_the_check_sees_an_import_inside_a_function(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from vllm.v1.engine.core import EngineCore\n    from . import _vllm_engine\n")
    assert _imports(path) == {"vllm.v1.engine.core", ".", "._vllm_engine"}


class FakeEngine(EngineRequests):
    """An engine of ``workers`` in-memory workers that keeps the seam's promises (nothing steps
    here, so every call is between two steps; pause keeps the requests; the label is what it
    reports); its workers answer from a script, not from updaters (``fake_engine.FakeEngine``
    runs real ones)."""

    def __init__(self, workers: int = 2, *, served: int | None = None, mode: str = "in-place") -> None:
        super().__init__()
        self.workers = workers
        self.served = served
        self.mode = mode

    def _status(self, prefetch: dict | None) -> list[dict]:
        return [{"rank": r, "version": self.served, "fingerprint": "ab" * 8, "mode": self.mode, "prefetch": prefetch}
                for r in range(self.workers)]  # fmt: skip

    async def call_workers(self, call: WorkerCall[Any]) -> list[Any]:
        if isinstance(call, StatusCall):
            return self._status(None)
        self.calls.append((call.method, *call.args()))
        if isinstance(call, BeginCall):
            state = "applied" if call.version == self.served else "ready"
            return self._status({"version": call.version, "state": state})
        if isinstance(call, ApplyCall):
            if call.auth != "good-tag" and call.auth != update_tag("tok", call.version):
                return [{"version": self.served, "error": "deltasync: the tag is wrong"}] * self.workers
            self.served = call.version
            return [{"version": call.version, "nbytes": 10}] * self.workers
        raise AssertionError(call)


def _sync(engine: FakeEngine, **kwargs: Any):
    from deltasync.server.server_sync import FollowConfig, ServerSync

    return ServerSync(engine, token="tok", follow=FollowConfig(), **kwargs)


def test_a_paused_update_on_a_fake_engine():
    engine = FakeEngine()
    sync = _sync(engine)
    outcome = asyncio.run(sync.bring_to(3, "good-tag"))
    assert outcome.ok and outcome.mode == "pause" and [r.version for r in outcome.results] == [3, 3]
    assert engine.calls == [("deltasync_begin", 3, "good-tag"), "pause", ("deltasync_apply", 3, "good-tag"),
                            ("label", 3), "resume"]  # fmt: skip
    assert (sync.served, engine.label_now, engine.paused) == (3, 3, False)
    assert sync.metrics.registry.get_sample_value("deltasync_downloaded_bytes_total") == 20
    engine.calls.clear()
    assert asyncio.run(sync.bring_to(3, "good-tag")).noop and engine.calls == [("deltasync_begin", 3, "good-tag")]


def test_an_inflight_update_on_a_fake_engine_records_where_each_version_began():
    engine = FakeEngine(served=1)
    sync = _sync(engine, update_mode="inflight")
    sync.served = 1
    marker = sync.tokens.track(1)
    engine.add(f"cmpl-{marker}-0-x", f"cmpl-{marker}-0", tokens=5)  # five tokens sampled with version 1
    outcome = asyncio.run(sync.bring_to(2, "good-tag"))
    assert outcome.ok and outcome.mode == "inflight" and "pause" not in engine.calls
    assert sync.tokens.versions(marker) == [[(1, 0), (2, 5)]]
    # The salt is the engine's: the middleware asks the engine for it.
    from deltasync.server.update_route import _salted

    assert _salted(engine, b'{"prompt": "hi"}', 2) == b'{"prompt": "hi", "cache_salt": "v2"}'


def test_a_refused_update_on_a_fake_engine_resumes_and_labels_nothing():
    engine = FakeEngine()
    sync = _sync(engine)
    outcome = asyncio.run(sync.bring_to(3, "bad-tag"))
    assert not outcome.ok and outcome.status == 500 and outcome.error == "deltasync: the tag is wrong"
    assert engine.calls[-1] == "resume" and engine.label_now is None and sync.served is None
    assert sync.metrics.registry.get_sample_value("deltasync_update_failures_total") == 1


def test_the_follower_runs_the_flow_on_a_fake_engine(tmp_path):
    import torch
    from helpers import small_transformer, train_step

    from deltasync import DeltaPublisher
    from deltasync.server.server_sync import FollowConfig, ServerSync

    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    with DeltaPublisher(tmp_path / "bucket", model, opt) as publisher:
        for v in range(3):
            if v:
                train_step(model, opt, seed=v)
            publisher.publish()
    engine = FakeEngine()
    sync = ServerSync(engine, token="tok", follow=FollowConfig(enabled=True, interval=0.5, bucket=str(tmp_path / "bucket")))
    assert asyncio.run(sync.follow_once()) == 0.5
    tag = update_tag("tok", 2)  # straight to the newest, tagged by the server itself
    pointer = (tmp_path / "bucket" / "latest.json").read_bytes()  # handed to the workers as read
    assert engine.calls == [("deltasync_begin", 2, tag, pointer), "pause", ("deltasync_apply", 2, tag), ("label", 2),
                            "resume"]  # fmt: skip
    assert sync.follow_status()["lag"] == 0 and sync.last_error is None
