from __future__ import annotations

import hashlib
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from servers import REPO_ROOT

from deltasync.errors import ConfigError
from deltasync.examples.tiny import CHATML_SPECIAL_TOKENS, QWEN2_5_CHAT_TEMPLATE, TINY_SHAPE, build_tiny_model, fit_tiny_model


def _digests(path: pathlib.Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


def test_same_seed_gives_same_bytes(tmp_path):
    first = build_tiny_model(tmp_path / "a", seed=3)
    second = build_tiny_model(tmp_path / "b", seed=3)
    assert _digests(first) == _digests(second)


def test_other_seed_changes_weights_only(tmp_path):
    first = _digests(build_tiny_model(tmp_path / "a", seed=0))
    second = _digests(build_tiny_model(tmp_path / "b", seed=1))
    assert first["model.safetensors"] != second["model.safetensors"]
    del first["model.safetensors"], second["model.safetensors"]
    assert first == second


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    build_tiny_model(tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_loads_in_transformers(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = model.config
    assert model.dtype == torch.bfloat16
    shape = TINY_SHAPE
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", shape.hidden_size, shape.num_layers)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (
        shape.num_attention_heads, shape.num_key_value_heads, shape.vocab_size)  # fmt: skip
    assert config.intermediate_size == shape.intermediate_size
    assert config.hidden_size // config.num_attention_heads >= 32
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight

    attn = model.model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and proj.bias.abs().sum() > 0
    assert attn.o_proj.bias is None

    assert len(tokenizer) <= config.vocab_size
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert config.eos_token_id == tokenizer.eos_token_id
    for token in CHATML_SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(token) < 3
        assert tokenizer.tokenize(f"a{token}b").count(token) == 1

    text = "The quick brown fox jumps over the lazy dog."
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids) == text
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config.vocab_size)
    assert torch.isfinite(logits).all()


def test_weights_are_bf16_safetensors_under_hf_names(tiny_model_dir):
    from safetensors import safe_open

    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
        dtypes = {f.get_tensor(n).dtype for n in names}
    assert dtypes == {torch.bfloat16}
    assert "model.layers.1.self_attn.q_proj.bias" in names
    assert "lm_head.weight" not in names  # tied to model.embed_tokens.weight


def test_chat_template_applies(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tokenizer.chat_template == QWEN2_5_CHAT_TEMPLATE
    messages = [{"role": "user", "content": "What is two plus two?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start and ids.count(im_start) == 3


def test_chat_template_is_the_one_trl_recognises(tiny_model_dir):
    chat_template_utils = pytest.importorskip("trl.chat_template_utils")
    from transformers import AutoTokenizer

    assert chat_template_utils.qwen2_5_chat_template == QWEN2_5_CHAT_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat_template_utils.add_response_schema(tokenizer)  # raises on a template TRL does not know


def test_custom_chat_template(tmp_path):
    from transformers import AutoTokenizer

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = build_tiny_model(tmp_path / "m", chat_template=template)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "hi"


def test_shape_options(tiny_model_factory):
    path = tiny_model_factory(hidden_size=256, num_layers=1, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=400, tie_word_embeddings=False)  # fmt: skip
    config = json.loads((path / "config.json").read_text())
    assert config["hidden_size"] // config["num_attention_heads"] == 64
    assert (config["num_hidden_layers"], config["vocab_size"], config["tie_word_embeddings"]) == (1, 400, False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hidden_size": 64, "num_attention_heads": 4}, "head size 16, which vLLM's CPU backend does not support"),
        ({"hidden_size": 100, "num_attention_heads": 3}, "not a multiple of num_attention_heads=3"),
        ({"num_attention_heads": 2, "num_key_value_heads": 3}, "not a multiple of num_key_value_heads=3"),
        ({"vocab_size": 100}, "vocab_size=100 is too small"),
        ({"num_layers": 0}, "num_layers=0"),
    ],
)
def test_rejects_bad_shapes(tmp_path, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build_tiny_model(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_imports_neither_vllm_nor_trl(tmp_path):
    code = (
        "import sys; from deltasync.examples.tiny import build_tiny_model; "
        f"build_tiny_model({str(tmp_path / 'm')!r}); "
        "bad = sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'trl'}); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, capture_output=True)


def test_fit_lowers_the_loss_on_its_texts_and_is_reproducible(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = ["the sea is wide and deep", "one two three four"]

    def loss(path) -> float:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            return model(**batch, labels=batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)).loss.item()

    first, second = (build_tiny_model(tmp_path / name, seed=1) for name in ("a", "b"))
    before = loss(first)
    for path in (first, second):
        fit_tiny_model(path, texts, steps=15, batch_size=4, seed=2)
    assert loss(first) < before / 2
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    with pytest.raises(ConfigError, match="steps >= 1"):
        fit_tiny_model(first, texts, steps=0)
