"""A tiny random Qwen2 model with a locally trained tokenizer, built offline in seconds.

Tests, examples and benchmarks need a real checkpoint that vLLM can serve and TRL can
train, but nothing may be downloaded. :func:`build_tiny_model` writes one: random bf16
weights from a seed, a byte-level BPE tokenizer trained on a built-in English corpus,
ChatML special tokens and Qwen2.5's chat template (the exact text TRL ships, so TRL's
rollout worker recognises it). The same seed always gives the same weight bytes.

Needs ``torch``, ``transformers`` and ``tokenizers``; never imports vLLM or TRL.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Sequence

from ..errors import ConfigError

__all__ = [
    "TINY_SHAPE",
    "TinyShape",
    "QWEN2_5_CHAT_TEMPLATE",
    "CHATML_SPECIAL_TOKENS",
    "VLLM_CPU_HEAD_SIZES",
    "build_tiny_model",
    "build_tiny_moe_model",
    "fit_tiny_model",
]

#: ``<|endoftext|>`` is also the pad token and ``<|im_end|>`` the end of a turn, as in Qwen2.5.
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Attention head sizes vLLM's CPU attention backend accepts; any other size fails at the
#: first request, long after the server reported healthy.
VLLM_CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})

# Qwen2.5's chat template byte for byte as TRL 1.16 ships it
# (trl/chat_templates/qwen2_5.jinja, trailing newline included). TRL recognises a template
# by string equality (`add_response_schema`), so this must not be reformatted.
QWEN2_5_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
    '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and'
    " arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud."
    " You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first)'
    ' or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

# A few KB of plain English for the tokenizer to learn merges from. Its content does not
# matter beyond giving common words and numbers their own tokens; changing it changes
# every tiny model's tokenizer.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. All that glitters is not gold, and not all those who wander are lost.
Once upon a time there was a small village at the edge of a great forest. The people of the
village were farmers and weavers, and every morning they walked to the river to fetch water.
One day a stranger arrived with a cart full of books. He said that he would trade one book for
one story, and the children ran home to ask their parents for the best stories they knew.
By the end of the week the cart was empty and the village had a library.

You are a helpful assistant. Please answer the question below as clearly as you can.
What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four. What is three times five? It is fifteen.
How many days are there in a week? There are seven days in a week: Monday, Tuesday,
Wednesday, Thursday, Friday, Saturday and Sunday. A year has twelve months and four seasons:
spring, summer, autumn and winter. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 42 100 1000 2024.
Can you write a short poem about the sea? The sea is wide, the sea is deep, it sings the
sailors all to sleep. Thank you! You are welcome. Is there anything else I can help with?

Reinforcement learning trains a policy by rewarding good answers. The trainer samples
completions from the model, scores them with a reward function, and updates the weights.
After every optimizer step the new weights must reach the inference servers that generate
the next batch of rollouts. Most of the weights do not change at all between two steps,
so it is enough to send the few values that did change, together with their positions.
The server loads the new version, checks that the result matches the expected fingerprint,
and only then starts to answer requests with the new weights. If anything goes wrong, the
old weights stay in place and the server keeps serving the version it had before.

Science is the patient study of the world. Water boils at one hundred degrees and freezes at
zero. The earth turns around the sun once a year and around its own axis once a day. Light
travels faster than sound, which is why we see the lightning before we hear the thunder.
Plants turn sunlight, water and air into sugar and oxygen. Good questions matter more than
quick answers, and every answer is the start of a new question.

The kitchen was warm and smelled of fresh bread. She cut two slices, spread them with butter
and honey, and poured a cup of tea. Outside, the rain tapped on the window and the wind moved
the branches of the old apple tree. It was the kind of afternoon that made people want to read
a long book, write a letter to an old friend, or simply sit and listen to the weather.

def add(a, b):
    return a + b

print("hello, world")
for i in range(10):
    total = total + i
if answer == expected:
    reward = 1.0
else:
    reward = 0.0
"""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TinyShape:
    """The tiny model's shape: the defaults of :func:`build_tiny_model`, defined here only."""

    hidden_size: int = 128
    """Width; 128 / 2 heads gives head size 64, which vLLM's CPU backend accepts."""
    num_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    """Fewer than the attention heads, so grouped-query attention is exercised."""
    intermediate_size: int = 256
    vocab_size: int = 512
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02
    """Standard deviation of the random weights (Qwen2's default)."""


#: The shape :func:`build_tiny_model` builds unless told otherwise.
TINY_SHAPE = TinyShape()


def build_tiny_model(
    out_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    hidden_size: int = TINY_SHAPE.hidden_size,
    num_layers: int = TINY_SHAPE.num_layers,
    num_attention_heads: int = TINY_SHAPE.num_attention_heads,
    num_key_value_heads: int = TINY_SHAPE.num_key_value_heads,
    intermediate_size: int = TINY_SHAPE.intermediate_size,
    vocab_size: int = TINY_SHAPE.vocab_size,
    tie_word_embeddings: bool = TINY_SHAPE.tie_word_embeddings,
    initializer_range: float = TINY_SHAPE.initializer_range,
    chat_template: str | None = None,
) -> pathlib.Path:
    """Write a random Qwen2 causal LM with its tokenizer to ``out_dir`` and return its path.

    The weights are bf16 safetensors (``save_pretrained``), drawn from ``seed`` without
    touching the caller's global RNG state; the same arguments give the same weight bytes.
    The tokenizer is a byte-level BPE trained on a built-in corpus up to ``vocab_size``
    tokens, with ``<|im_end|>`` as eos, ``<|endoftext|>`` as pad and ``chat_template``
    (default: :data:`QWEN2_5_CHAT_TEMPLATE`). ``out_dir`` is created if missing; files
    already in it are overwritten. Shape defaults: :data:`TINY_SHAPE`.
    """
    _check_shape(hidden_size, num_attention_heads, num_key_value_heads, vocab_size, num_layers)

    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer, (bos_id, eos_id, pad_id) = _chat_tokenizer(vocab_size, chat_template)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        use_sliding_window=False,
        initializer_range=initializer_range,
        dtype="bfloat16",
    )
    return _save_random(Qwen2ForCausalLM, config, tokenizer, out_dir, seed)


def build_tiny_moe_model(
    out_dir: str | os.PathLike[str],
    *,
    architecture: str = "qwen3_moe",
    seed: int = 0,
    num_experts: int = 4,
    experts_per_token: int = 2,
    moe_intermediate_size: int = 64,
    tie_word_embeddings: bool = False,
    chat_template: str | None = None,
) -> pathlib.Path:
    """Write a random mixture-of-experts causal LM with the tiny tokenizer to ``out_dir``.

    ``architecture``: "qwen3_moe" (Qwen3-MoE: experts ``mlp.experts.{e}.gate_proj`` /
    ``up_proj`` / ``down_proj`` on disk) or "mixtral" (``block_sparse_moe.experts.{e}.w1`` /
    ``w2`` / ``w3``). transformers 5 holds both fused in memory (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``); the checkpoint is per expert. Width, layers, heads and vocabulary
    are :data:`TINY_SHAPE`'s; every layer is sparse. Same arguments, same weight bytes.
    """
    if architecture not in ("qwen3_moe", "mixtral"):
        raise ConfigError(f"architecture {architecture!r}: choose 'qwen3_moe' or 'mixtral'")
    if not 1 <= experts_per_token <= num_experts:
        raise ConfigError(f"experts_per_token={experts_per_token} must be in 1..num_experts={num_experts}")
    shape = TINY_SHAPE
    tokenizer, (bos_id, eos_id, pad_id) = _chat_tokenizer(shape.vocab_size, chat_template)
    common = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.hidden_size // shape.num_attention_heads, max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        initializer_range=shape.initializer_range, num_experts_per_tok=experts_per_token, dtype="bfloat16",
    )
    if architecture == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            **common, num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
            intermediate_size=shape.intermediate_size, norm_topk_prob=True,
        )
        return _save_random(Qwen3MoeForCausalLM, config, tokenizer, out_dir, seed)
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**common, num_local_experts=num_experts, intermediate_size=moe_intermediate_size)
    return _save_random(MixtralForCausalLM, config, tokenizer, out_dir, seed)


def _chat_tokenizer(vocab_size: int, chat_template: str | None):
    """The tiny tokenizer with its chat template, and its (bos, eos, pad) ids."""
    tokenizer = _train_tokenizer(vocab_size)
    tokenizer.chat_template = QWEN2_5_CHAT_TEMPLATE if chat_template is None else chat_template
    # As in Qwen2.5: <|endoftext|> is bos and pad, <|im_end|> ends a turn.
    pad_id = bos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer, (bos_id, eos_id, pad_id)


def _save_random(model_class, config, tokenizer, out_dir: str | os.PathLike[str], seed: int) -> pathlib.Path:
    """A model of ``config`` with random weights from ``seed`` (bf16), saved with ``tokenizer``."""
    import torch
    from transformers import GenerationConfig

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        # Initialise in fp32 and round once, so the bf16 bytes depend on the seed alone.
        model = model_class(config)
        # Biases start at zero and norms at one; perturb them so that a sync path that drops
        # or mangles them changes the model's outputs and fails tests.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, config.initializer_range)
                elif name.endswith("norm.weight"):
                    param.add_(torch.randn_like(param), alpha=config.initializer_range)
        model = model.to(torch.bfloat16)
    ids = (config.bos_token_id, config.eos_token_id, config.pad_token_id)
    model.generation_config = GenerationConfig(bos_token_id=ids[0], eos_token_id=[ids[1], ids[2]], pad_token_id=ids[2])
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def fit_tiny_model(
    model_dir: str | os.PathLike[str],
    texts: Sequence[str],
    *,
    steps: int = 60,
    learning_rate: float = 3e-3,
    batch_size: int = 16,
    seed: int = 0,
) -> pathlib.Path:
    """Fit the model in ``model_dir`` to ``texts`` (next-token loss, AdamW) and save it in place.

    A random tiny model learns nothing at a realistic RL learning rate; a few seconds of
    supervised fitting first give it a policy that RL can then move with small steps, as it
    does a pretrained model. Trains in fp32, one thread's worth of work, on ``steps`` batches of
    ``batch_size`` texts drawn with ``seed``, and writes bf16 weights back. The same arguments
    give the same weight bytes on the same machine.
    """
    if steps < 1 or batch_size < 1 or not texts:
        raise ConfigError(f"fit_tiny_model needs steps >= 1, batch_size >= 1 and texts; got {steps}, {batch_size}, "
                          f"{len(texts)} texts")
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = pathlib.Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    rng = random.Random(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
        model.train()
        for _ in range(steps):
            batch = tokenizer([rng.choice(texts) for _ in range(batch_size)], return_tensors="pt", padding=True)
            labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
            model(**batch, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    model.eval()
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def _check_shape(
    hidden_size: int, num_attention_heads: int, num_key_value_heads: int, vocab_size: int, num_layers: int
) -> None:
    if num_layers < 1:
        raise ConfigError(f"num_layers={num_layers}: a model needs at least one layer")
    if hidden_size % num_attention_heads:
        raise ConfigError(
            f"hidden_size={hidden_size} is not a multiple of num_attention_heads={num_attention_heads}; "
            "pick sizes whose ratio (the head size) is a whole number"
        )
    head_dim = hidden_size // num_attention_heads
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ConfigError(
            f"hidden_size={hidden_size} / num_attention_heads={num_attention_heads} gives head size {head_dim}, "
            f"which vLLM's CPU backend does not support; use one of {sorted(VLLM_CPU_HEAD_SIZES)}"
        )
    if num_attention_heads % num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads={num_attention_heads} is not a multiple of num_key_value_heads={num_key_value_heads}"
        )
    # The 256 byte symbols and the special tokens must fit, with room for some merges.
    if vocab_size < 300:
        raise ConfigError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer; use at least 300")


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(CHATML_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
