"""deltasync.views reproduces llm-compressor's checkpoints bit for bit (tests/data/views/README.md)."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
import torch

from deltasync.trainer.view_targets import ignore_list, quantized_names
from deltasync.views import SCHEMES, from_quantization_config, get_scheme

pytest.importorskip("compressed_tensors")
pytest.importorskip("transformers")

GOLDEN = pathlib.Path(__file__).resolve().parents[2] / "data" / "views"
MODELS = ("qwen2", "qwen3_moe")


def _model(name: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(GOLDEN / name))


def _load(path: pathlib.Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("preset", SCHEMES)
def test_views_equal_llm_compressor_checkpoints(model_name: str, preset: str) -> None:
    source = _load(GOLDEN / model_name / "bf16.safetensors")
    want = _load(GOLDEN / model_name / preset / "model.safetensors")
    scheme = get_scheme(preset)
    names = quantized_names(_model(model_name), source)
    assert names == {k for k, v in want.items() if v.dtype == scheme.code_dtype}
    streamed = list(scheme.checkpoint_tensors(source.items(), names))
    got = dict(streamed)
    assert sorted(got) == sorted(want) and len(streamed) == len(got)
    for name, tensor in want.items():
        width = {1: torch.uint8, 2: torch.int16}[tensor.element_size()]
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name].view(width), tensor.view(width)), name


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("preset", SCHEMES)
def test_quantization_config_equals_llm_compressor_config(model_name: str, preset: str) -> None:
    import compressed_tensors

    want = json.loads((GOLDEN / model_name / preset / "quantization_config.json").read_text())
    # llm-compressor also lists its linearized experts' containers (class ExpertMLPWithGate):
    # no weight of their own, left out by ignore_list (see its docstring).
    want["ignore"] = [n for n in want["ignore"] if not re.search(r"\.experts\.\d+$", n)]
    got = get_scheme(preset).quantization_config(ignore_list(_model(model_name), ["lm_head"]))
    assert got.pop("version") == compressed_tensors.__version__  # the golden's: 0.17.1
    want.pop("version")
    assert got == want
    assert from_quantization_config(want) == get_scheme(preset)
