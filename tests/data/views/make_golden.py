"""Make the golden quantized checkpoints of tests/unit/views/test_views_golden.py with llm-compressor.

Run with a Python that has llmcompressor installed (NOT the project's environment), e.g.:

    python -m venv /tmp/llmc
    /tmp/llmc/bin/pip install --no-deps llmcompressor==0.12.0 loguru   # torch, transformers,
    #   compressed-tensors from the project's venv (see README.md next to this file)
    /tmp/llmc/bin/python tests/data/views/make_golden.py tests/data/views

For each model (a tiny Qwen2 and a tiny Qwen3-MoE, random bf16, built offline) it writes the
model's bf16 weights (``<model>/bf16.safetensors`` + ``config.json``) and, for each preset, what
``oneshot(QuantizationModifier(targets="Linear", scheme=PRESET, ignore=["lm_head"]))`` saves:
``<model>/<PRESET>/model.safetensors`` and its ``config.json``'s ``quantization_config``.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import tempfile

import torch

PRESETS = ("FP8_DYNAMIC", "FP8_BLOCK", "W8A8")


def _models():
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=48, hidden_size=32, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
                  max_position_embeddings=64, tie_word_embeddings=False)
    dense = Qwen2ForCausalLM(Qwen2Config(intermediate_size=136, **common))
    moe = Qwen3MoeForCausalLM(Qwen3MoeConfig(head_dim=32, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                                             intermediate_size=16, **common))
    out = {}
    for name, model in (("qwen2", dense), ("qwen3_moe", moe)):
        with torch.no_grad():
            for p in model.parameters():  # wide range, some all-zero rows: every rounding path
                p.normal_(0, 0.05)
                if p.ndim >= 2 and p.numel() // p.shape[-1] > 5:
                    p.view(-1, p.shape[-1])[3].zero_()
                    p.view(-1, p.shape[-1])[5] *= 40
        out[name] = model.to(torch.bfloat16)
    return out


def main(target: pathlib.Path) -> None:
    import llmcompressor
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from safetensors.torch import load_file, save_file

    for name, model in _models().items():
        root = target / name
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            save_file(load_file(f"{tmp}/model.safetensors"), root / "bf16.safetensors")
            shutil.copy(f"{tmp}/config.json", root / "config.json")
            for preset in PRESETS:
                fresh = type(model).from_pretrained(tmp, dtype=torch.bfloat16)
                out = pathlib.Path(tmp) / preset
                oneshot(model=fresh, recipe=QuantizationModifier(targets="Linear", scheme=preset, ignore=["lm_head"]),
                        output_dir=str(out))
                (root / preset).mkdir(exist_ok=True)
                tensors = {}
                for path in sorted(out.glob("*.safetensors")):
                    tensors.update(load_file(path))
                save_file(tensors, root / preset / "model.safetensors")
                config = json.loads((out / "config.json").read_text())["quantization_config"]
                (root / preset / "quantization_config.json").write_text(json.dumps(config, indent=1, sort_keys=True) + "\n")
    (target / "VERSIONS.json").write_text(json.dumps(
        {"llmcompressor": llmcompressor.__version__, "compressed-tensors": __import__("compressed_tensors").__version__,
         "torch": torch.__version__, "transformers": __import__("transformers").__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
