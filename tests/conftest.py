"""Shared fixtures and a clean, offline environment for every test."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

torch.set_num_threads(1)  # servers and trainers share two cores with the test process

from helpers import small_transformer  # noqa: E402  (tests/ is on pythonpath)


@pytest.fixture
def model() -> torch.nn.Module:
    return small_transformer()
