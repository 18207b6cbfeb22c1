"""The view schemes against compressed-tensors' own arithmetic, shard-local quantization, validation."""

from __future__ import annotations

import pytest
import torch

from deltasync import ConfigError, FormatError
from deltasync.views import SCHEMES, check_codes, check_scale, from_quantization_config, get_scheme

ct = pytest.importorskip("compressed_tensors")

SHAPES = [(300, 200), (130, 257), (128, 128), (1, 5), (257, 129)]


def _weight(shape: tuple[int, int], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen) * 0.02
    w[min(3, shape[0] - 1)] = 0.0  # an all-zero row: a zero scale must become eps
    if shape[0] > 7:
        w[7] *= 500  # a wide row, clamped codes
        w[6, ::3] = -0.0
    return w.to(torch.bfloat16)


def _reference(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' own result, spelled out: the preset's args, per-row or per-block
    min/max of the (zero-padded) weight, calculate_qparams, quantize with the zero point,
    codes cut back to the weight's shape."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams, maybe_pad_tensor_for_block_quant

    args = preset_name_to_scheme(name, ["Linear"]).weights
    if args.block_structure is None:
        low, high = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        x = w
    else:
        bh, bw = args.block_structure
        x = maybe_pad_tensor_for_block_quant(w, (bh, bw))
        blocks = x.reshape(x.shape[0] // bh, bh, x.shape[1] // bw, bw).transpose(1, 2).flatten(-2)
        low, high = blocks.amin(-1), blocks.amax(-1)
    scale, zp = calculate_qparams(low, high, args)
    codes = quantize(x, scale, zp, args, dtype=args.pytorch_dtype())[: w.shape[0], : w.shape[1]]
    return {"weight": codes, "weight_scale": scale}


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(width), b.contiguous().view(width))


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_is_compressed_tensors_bit_for_bit(name: str, shape: tuple[int, int]) -> None:
    w = _weight(shape, seed=sum(shape))
    got = get_scheme(name).quantize(w)
    want = _reference(name, w)
    assert sorted(got) == ["weight", "weight_scale"]  # symmetric: no zero point is stored
    assert got["weight"].dtype == get_scheme(name).code_dtype
    assert got["weight_scale"].dtype == torch.bfloat16
    assert got["weight_scale"].shape == get_scheme(name).scale_shape(shape)
    assert _equal(got["weight"], want["weight"])
    assert _equal(got["weight_scale"], want["weight_scale"])
    assert bool((got["weight_scale"] > 0).all())  # the all-zero row got eps, not zero
    check_codes("w", got["weight"])
    check_scale("w", got["weight_scale"])


def test_negative_zero_codes_like_llm_compressor() -> None:
    # llm-compressor passes the (zero) zero point, so -0.0 quantizes to +0 code.
    w = torch.full((2, 4), -0.0, dtype=torch.bfloat16)
    w[0, 0] = 1.0
    codes = get_scheme("FP8_DYNAMIC").quantize(w)["weight"].view(torch.uint8)
    assert codes[0, 1:].tolist() == [0, 0, 0] and codes[1].tolist() == [0, 0, 0, 0]


def _splits(rows: int, ranks: int) -> list[tuple[int, int]]:
    """Uneven row shards as FSDP2 makes them (ceil-sized chunks, the last ones short or empty)."""
    chunk = -(-rows // ranks)
    return [(min(r * chunk, rows), min((r + 1) * chunk, rows)) for r in range(ranks)]


@pytest.mark.parametrize("name", SCHEMES)
@pytest.mark.parametrize("shape,splits", [
    ((300, 200), _splits(300, 3)),   # 100-row shards: block 0 straddles ranks 0/1, block 1 ranks 1/2
    ((300, 200), _splits(300, 4)),   # 75-row shards
    ((300, 130), [(0, 7), (7, 7), (7, 256), (256, 257), (257, 300)]),  # an empty shard, one-row shards
    ((257, 129), _splits(257, 2)),
], ids=["300x3", "300x4", "ragged", "257x2"])  # fmt: skip
def test_row_shards_concatenate_to_the_full_result(name: str, shape: tuple[int, int], splits) -> None:
    scheme = get_scheme(name)
    w = _weight(shape, seed=1)
    full = scheme.quantize(w)
    amax = None
    if scheme.strategy == "block":
        parts = [scheme.block_absmax_rows(w[a:b], a, shape) for a, b in splits]
        amax = torch.stack(parts).amax(0)  # what an all-reduce MAX gives
        with pytest.raises(ConfigError, match="block_amax"):
            scheme.quantize_rows(w[:10], 0, shape)
    outs = [scheme.quantize_rows(w[a:b], a, shape, block_amax=amax) for a, b in splits]
    for (a, b), out in zip(splits, outs):
        assert out["weight"].shape == (b - a, shape[1])
        begin, end = scheme.scale_rows(a, b - a)
        assert out["weight_scale"].shape[0] == end - begin
    assert _equal(torch.cat([o["weight"] for o in outs]), full["weight"])
    assert _equal(torch.cat([o["weight_scale"] for o in outs]), full["weight_scale"])


def test_block_scale_rows_belong_to_the_rank_with_the_first_row() -> None:
    scheme = get_scheme("FP8_BLOCK")
    assert [scheme.scale_rows(a, b - a) for a, b in _splits(300, 3)] == [(0, 1), (1, 2), (2, 3)]
    assert [scheme.scale_rows(a, b - a) for a, b in [(0, 128), (128, 129), (129, 300)]] == [(0, 1), (1, 2), (2, 3)]
    assert scheme.scale_rows(1, 127) == (1, 1)  # holds rows of block 0 only, but not its first


def test_block_absmax_of_a_shard_is_zero_outside_it() -> None:
    scheme = get_scheme("FP8_BLOCK")
    w = _weight((300, 200), seed=2)
    part = scheme.block_absmax_rows(w[100:200], 100, (300, 200))
    assert part.shape == (3, 2)
    assert part.dtype == torch.float32  # exact for bf16, and gloo all-reduces it
    assert torch.equal(part[2], torch.zeros(2))
    assert torch.equal(part[0, 0], w[100:128, :128].abs().amax().float())
    assert torch.equal(part[1, 1], w[128:200, 128:].abs().amax().float())
    with pytest.raises(ConfigError, match="FP8_DYNAMIC"):
        get_scheme("FP8_DYNAMIC").block_absmax_rows(w, 0, (300, 200))


def test_bad_rows_are_refused() -> None:
    scheme = get_scheme("FP8_DYNAMIC")
    with pytest.raises(ConfigError, match=r"rows of shape \(10, 5\) at row 295"):
        scheme.quantize_rows(torch.zeros(10, 5, dtype=torch.bfloat16), 295, (300, 5))
    with pytest.raises(ConfigError, match="2-D"):
        scheme.quantize(torch.zeros(2, 3, 4, dtype=torch.bfloat16))


def test_unknown_scheme_names_the_supported_ones() -> None:
    with pytest.raises(ConfigError, match=r"unknown view 'FP9'.*FP8_DYNAMIC, FP8_BLOCK, W8A8"):
        get_scheme("FP9")
    with pytest.raises(ConfigError, match=r"'NVFP4' is a compressed-tensors preset that deltasync does not support"):
        get_scheme("NVFP4")
    assert get_scheme("fp8_dynamic") == get_scheme("FP8_DYNAMIC")
    assert (get_scheme("FP8_BLOCK").strategy, get_scheme("FP8_BLOCK").block) == ("block", (128, 128))
    assert get_scheme("W8A8").code_dtype == torch.int8


@pytest.mark.parametrize("name", SCHEMES)
def test_quantization_config_round_trips(name: str) -> None:
    cfg = get_scheme(name).quantization_config(["lm_head", "re:.*mlp.gate$"])
    assert cfg["quant_method"] == "compressed-tensors" and cfg["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    assert cfg["format"] == ("int-quantized" if name == "W8A8" else "float-quantized")
    assert from_quantization_config(cfg) == get_scheme(name)


def test_a_config_matching_no_view_is_named() -> None:
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

    cfg = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W4A16", ["Linear"])}).model_dump()
    cfg["quant_method"] = "compressed-tensors"
    with pytest.raises(ConfigError, match=r"group 'group_0' \(weights 4-bit int group\) matches no supported view"):
        from_quantization_config(cfg)
    with pytest.raises(ConfigError, match="quant_method 'fp8'"):
        from_quantization_config({"quant_method": "fp8"})
    two = dict(get_scheme("FP8_DYNAMIC").quantization_config([]))
    two["config_groups"] = {**two["config_groups"], "group_1": two["config_groups"]["group_0"]}
    with pytest.raises(ConfigError, match="2 config groups"):
        from_quantization_config(two)


def test_fp8_nan_codes_are_refused() -> None:
    codes = torch.zeros(4, 4, dtype=torch.uint8)
    check_codes("ok", codes.view(torch.float8_e4m3fn))
    for bad in (0x7F, 0xFF):
        codes[2, 1] = bad
        with pytest.raises(FormatError, match=rf"model.w.weight: fp8 code at flat index 9 is NaN \(0x{bad:02X}\)"):
            check_codes("model.w.weight", codes.view(torch.float8_e4m3fn))
    check_codes("int8", torch.tensor([-128, 127, 0], dtype=torch.int8))  # every int8 is a code
    with pytest.raises(FormatError, match="codes are torch.bfloat16"):
        check_codes("x", torch.zeros(2, dtype=torch.bfloat16))


def test_int8_codes_reach_minus_128() -> None:
    # compressed-tensors' int8 range is [-128, 127] with scale = absmax / 127.5 (rounded to bf16):
    # a row whose minimum is its abs-max gives -128 or -127, depending on how the scale rounded.
    w = torch.full((200, 2), 0.1, dtype=torch.bfloat16)
    w[:, 0] = -torch.linspace(0.5, 2, 200)
    codes = get_scheme("W8A8").quantize(w)["weight"][:, 0]
    assert set(codes.tolist()) == {-128, -127}


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.0])
def test_bad_scales_are_refused(value: float) -> None:
    scale = torch.ones(3, 1, dtype=torch.bfloat16)
    check_scale("ok", scale)
    scale[1, 0] = value
    with pytest.raises(FormatError, match=r"layers.0.q_proj.weight_scale: scale at flat index 1 is"):
        check_scale("layers.0.q_proj.weight_scale", scale)


def test_scale_names() -> None:
    from deltasync.views import scale_name

    assert (
        scale_name("model.layers.0.mlp.experts.3.down_proj.weight")
        == "model.layers.0.mlp.experts.3.down_proj.weight_scale"
    )
    with pytest.raises(ConfigError, match="'model.norm.bias' is no weight name"):
        scale_name("model.norm.bias")
