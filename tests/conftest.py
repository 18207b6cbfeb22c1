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
