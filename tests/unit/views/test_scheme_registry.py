"""A view scheme is one definition and one registration: a scheme that only this file knows
(int8 codes by plain rounding, held transposed by the serving engine) is published, read,
exported and written in place like the built-in ones, without a line of deltasync changed.

The scheme is registered by the ``registered`` fixture (and forgotten after), the one place it
is known; everything else finds it through the registry."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from helpers import small_transformer, train_step

from deltasync import ConfigError, DeltaPublisher, DeltaReceiver
from deltasync.cli import main as cli
from deltasync.trainer.view_targets import quantized_names
from deltasync.views import (
    SCHEMES,
    LiveLayout,
    ViewScheme,
    checkpoint_view,
    from_quantization_config,
    get_scheme,
    register_scheme,
    unregister_scheme,
)
from deltasync.views.identity import ViewIdentity

NAME = "TEST_INT8_ROUND"


@dataclass(frozen=True)
class RoundedInt8(ViewScheme):
    """int8 codes ``round(w / s)`` with ``s = max|w| / 127`` of each row (bf16, at least bf16's eps)."""

    def compress(self, weight: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> dict[str, torch.Tensor]:
        amax = torch.maximum(low.abs(), high.abs()).float()
        scale = (amax / 127).clamp(min=torch.finfo(torch.bfloat16).eps).to(weight.dtype)
        codes = torch.round(weight.float() / scale.float()).clamp(-128, 127).to(self.code_dtype)
        return {"weight": codes, "weight_scale": scale}

    def quantization_config(self, ignore: Sequence[str]) -> dict[str, Any]:
        return {"quant_method": "deltasync-test", "scheme": self.name, "ignore": list(ignore)}

    def matches(self, config: Mapping[str, Any]) -> bool:
        return config.get("quant_method") == "deltasync-test" and config.get("scheme") == self.name


SCHEME = RoundedInt8(NAME, torch.int8, "channel", live=LiveLayout(codes="transposed", scales="widened"))


@pytest.fixture
def registered() -> Iterator[ViewScheme]:
    register_scheme(SCHEME)
    try:
        yield SCHEME
    finally:
        unregister_scheme(NAME)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def _same(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(_bits(got[name]), _bits(t)), name


def test_a_registered_scheme_is_found_by_name_and_by_its_config(registered) -> None:
    assert get_scheme(NAME.lower()) is registered and NAME in SCHEMES and list(SCHEMES)[-1] == NAME
    config = registered.quantization_config(["lm_head"])
    assert from_quantization_config(config) is registered
    assert from_quantization_config(get_scheme("W8A8").quantization_config(["lm_head"])).name == "W8A8"
    assert ViewIdentity.of(NAME).to_json() == {"scheme": NAME, "codes": "I8", "scales": "BF16", "scale_layout": "channel"}
    with pytest.raises(ValueError, match="already registered"):
        register_scheme(SCHEME)
    with pytest.raises(ValueError, match="is no view name"):
        register_scheme(replace(SCHEME, name="lower"))
    with pytest.raises(ConfigError, match="a view's codes are one byte"):
        replace(SCHEME, code_dtype=torch.bfloat16)
    unregister_scheme(NAME)
    try:
        assert NAME not in SCHEMES
        with pytest.raises(ConfigError, match=rf"unknown view '{NAME}'; supported views .*: FP8_DYNAMIC, FP8_BLOCK, W8A8$"):
            get_scheme(NAME)
        with pytest.raises(ConfigError, match="quant_method 'deltasync-test'"):
            from_quantization_config(config)
    finally:
        register_scheme(SCHEME)


# ---------------------------------------------------------------------- a served model


class ServedLinear(torch.nn.Module):
    """A quantized linear layer as an engine keeps it in the scheme's live layout: the codes as
    the ``[in, out]`` transpose of the ``[out, in]`` storage its loader filled, the bf16 scale
    widened into float32. Its loader takes the parameters as they were at load time (vLLM's
    ``weight_loader``): only the stand-ins ``load_time_params`` puts back fit it."""

    def __init__(self, out: int, cols: int, scheme: ViewScheme) -> None:
        super().__init__()
        self.scheme = scheme.name  # an engine's quantized layer carries its scheme
        self.weight = torch.nn.Parameter(torch.zeros(out, cols, dtype=scheme.code_dtype).t(), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.zeros(scheme.scale_shape((out, cols))), requires_grad=False)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)


class ServedModel(torch.nn.Module):
    """A model holding a view's state: a :class:`ServedLinear` per quantized weight, bf16
    parameters for the rest, loaded by checkpoint name."""

    def __init__(self, state: Mapping[str, torch.Tensor], scheme: ViewScheme) -> None:
        super().__init__()
        quantized = {name for name in state if name + "_scale" in state}
        for name in sorted(state, key=lambda n: n not in quantized):  # the quantized layers first
            module_name, _, attr = name.rpartition(".")
            if name in quantized:
                self._module(module_name.rpartition(".")[0]).add_module(
                    module_name.rpartition(".")[2], ServedLinear(*state[name].shape, scheme)
                )
            elif attr != "weight_scale":
                param = torch.nn.Parameter(torch.zeros_like(state[name]), requires_grad=False)
                self._module(module_name).register_parameter(attr, param)

    def _module(self, name: str) -> torch.nn.Module:
        module: torch.nn.Module = self
        for part in filter(None, name.split(".")):
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        return module

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            module_name, _, attr = name.rpartition(".")
            module = self.get_submodule(module_name)
            param = getattr(module, attr)
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor)
            else:
                param.data.copy_(tensor)
            loaded.add(name)
        return loaded

    def served(self) -> dict[str, torch.Tensor]:
        """The view's state as this model holds it (codes back to ``[out, in]``, scales to bf16)."""
        out = {}
        for name, param in self.named_parameters():
            module = self.get_submodule(name.rpartition(".")[0])
            held = param.detach()
            if isinstance(module, ServedLinear) and name.endswith(".weight"):
                held = held.t()
            elif isinstance(module, ServedLinear) and name.endswith(".weight_scale"):
                held = held.to(torch.bfloat16)  # exact: the float32 holds a bf16 value
            out[name] = held
        return out


@pytest.fixture
def vllm_parallel_state() -> Iterator[None]:
    """vLLM's parameter classes (the load-time stand-ins) need its tensor-parallel group: one
    rank over gloo, torn down after."""
    pytest.importorskip("vllm")
    from vllm_ext.testing import one_rank

    if torch.distributed.is_initialized():
        pytest.skip("torch.distributed is initialized already in this process")
    with one_rank():
        yield


def _expected(model: torch.nn.Module, bf16: Mapping[str, torch.Tensor], scheme: ViewScheme) -> dict[str, torch.Tensor]:
    """The view of a bf16 state, by the definition: the scheme's quantization of each Linear weight."""
    targets = quantized_names(model, list(bf16), ("lm_head",))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in bf16.items():
        if name in targets:
            for suffix, t in scheme.quantize(tensor).items():
                out[name[: -len("weight")] + suffix] = t
        else:
            out[name] = tensor
    return out


def test_a_test_only_scheme_round_trips_through_publisher_reader_export_and_in_place_writer(
    registered, vllm_parallel_state, tmp_path
) -> None:
    from deltasync.reader.chain import ChainReader
    from deltasync.server.inplace import InPlaceState
    from vllm_ext._quantized import load_time_params
    from deltasync.server.weight_map import discover

    bucket = tmp_path / "bucket"
    model = small_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DeltaPublisher(bucket, model, optimizer, views=(NAME,), anchor_every=100, anchor_bytes_ratio=0) as publisher:
        # The publisher writes the view's chain; the reader follows it, exactly the definition.
        publisher.publish()
        publisher.flush()
        receiver = DeltaReceiver(bucket, view=NAME)
        receiver.sync()
        bf16 = DeltaReceiver(bucket)
        bf16.sync()
        _same(receiver.state_dict(), _expected(model, bf16.state_dict(), registered))
        assert receiver.fingerprint == publisher.view_fingerprint(NAME) and receiver.verify()
        anchor = receiver.state_dict()
        assert anchor["model.layers.0.mlp.up_proj.weight"].dtype == torch.int8

        # The server's in-place writer, on a model holding the view as the live layout says.
        served = ServedModel(anchor, registered)
        shapes = {n: tuple(t.shape) for n, t in anchor.items()}
        dtypes = {n: t.dtype for n, t in anchor.items()}
        with load_time_params(served, replace(registered, live=LiveLayout(codes="as_loaded"))) as swapped:
            assert swapped == 0  # another layout: nothing to put back, and the loader cannot map the codes
            unmapped = discover(served, shapes, dtypes=dtypes, widen=True)
        assert "model.layers.0.mlp.up_proj.weight" in unmapped.fallback
        with load_time_params(served, registered) as swapped:
            assert swapped == 2 * sum(n.endswith("_scale") for n in anchor)
            served.load_weights(anchor.items())  # the checkpoint the server started from
            wmap = discover(served, shapes, dtypes=dtypes, widen=True, values=anchor.get)
        assert not wmap.fallback and set(wmap.pieces) == set(anchor)
        _same(served.served(), anchor)

        def load_dense(weights: Any) -> None:
            with load_time_params(served, registered):
                served.load_weights(weights)

        live = InPlaceState(served, wmap, lambda obj: [obj], 0, load_dense, dtypes=dtypes)
        assert live.fingerprint == receiver.fingerprint
        live.commit(0, receiver.fingerprint or "")
        for step in range(3):
            train_step(model, optimizer, step)
            result = publisher.publish()
            publisher.flush()
            receiver.sync()
            staged = live.stage_deltas(ChainReader(receiver.store, receiver.pointer(), view=NAME), result.version)
            assert staged.changed
            fingerprint = live.check_chain(staged, [staged.shares])
            live.write(staged)
            live.commit(result.version, fingerprint)
            assert fingerprint == receiver.fingerprint == publisher.view_fingerprint(NAME) == live.full_fingerprint()
            _same(served.served(), receiver.state_dict())
        bf16.sync()
        _same(receiver.state_dict(), _expected(model, bf16.state_dict(), registered))

    # deltasync export writes the view's checkpoint, with the scheme's quantization_config,
    # and a server started from it follows this view.
    from safetensors.torch import load_file

    like = tmp_path / "like"
    like.mkdir()
    (like / "config.json").write_text(json.dumps(model.config.to_dict()))
    out = tmp_path / "export"
    assert cli(["export", str(bucket), str(out), "--view", NAME, "--like", str(like)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "deltasync-test"
    assert checkpoint_view(out) == NAME
    _same(load_file(out / "model.safetensors"), receiver.state_dict())
