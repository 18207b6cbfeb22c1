"""The codec registry is the one place codecs are known: a codec registered there is written,
read, validated and inspected like the built-in ones, and one unregistered is refused everywhere."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from helpers import small_transformer, train_step
from servers import REPO_ROOT

from deltasync import ConfigError, DeltaPublisher, DeltaReceiver, FormatError, PublishOptions, bf16_state_dict
from deltasync.cli import main
from deltasync.format import (
    CODECS,
    Change,
    Codec,
    decode_delta,
    delta_path,
    encode_delta,
    read_header,
    register_codec,
    unregister_codec,
)
from deltasync.format.codecs import DeltaContext, Table
from deltasync.format.codecs.base import check_index, known_numel

FP0, FP1 = "0" * 16, "1" * 16


class PairsCodec(Codec):
    """A test codec: each parameter's changes as one int64 tensor of (index, value bits) rows."""

    name = "pairs"
    levels = range(0, 2)
    default_level = 0

    def encode(
        self, items: Sequence[tuple[str, Change]], *, numels: Mapping[str, int] | None, level: int | None
    ) -> dict[str, torch.Tensor]:
        assert level in self.levels
        bits = {name: change.new.to(torch.bfloat16).view(torch.int16).to(torch.int64) for name, change in items}
        return {name: torch.stack([change.index.to(torch.int64), bits[name]]) for name, change in items}

    def decode(self, tensors: Mapping[str, torch.Tensor], delta: DeltaContext) -> dict[str, Change]:
        changes = {}
        for name, pairs in tensors.items():
            index = pairs[0].contiguous()
            check_index(index, name, known_numel(name, delta.numels, delta.where), delta.where)
            changes[name] = Change(index=index, new=pairs[1].to(torch.int16).view(torch.bfloat16))
        return changes

    def describe(
        self, tensors: Mapping[str, torch.Tensor], *, names: tuple[str, ...] | None, changed: int
    ) -> list[Table]:
        return [(["parameter", "pairs"], [[name, str(t.shape[1])] for name, t in sorted(tensors.items())])]


@pytest.fixture
def pairs() -> Iterator[None]:
    register_codec(PairsCodec())
    try:
        yield
    finally:
        unregister_codec("pairs")


def one_change() -> dict[str, Change]:
    return {"w": Change(index=torch.tensor([1, 5]), new=torch.tensor([1.5, -2.0], dtype=torch.bfloat16))}


def test_a_registered_codec_publishes_syncs_and_inspects(tmp_path: Path, pairs: None, capsys) -> None:
    assert list(CODECS) == ["raw", "zstd", "pairs"] and "pairs" in CODECS
    with pytest.raises(ConfigError, match=r"zstd_level must be in 0\.\.1, got 5"):
        PublishOptions(codec="pairs", zstd_level=5)
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    publisher = DeltaPublisher(tmp_path, model, opt, codec="pairs", zstd_level=1, anchor_every=100)
    receiver = DeltaReceiver(tmp_path)
    publisher.publish()
    train_step(model, opt, seed=1)
    result = publisher.publish()
    assert receiver.sync() == result.version == 1
    want = bf16_state_dict(model)
    assert all(torch.equal(receiver.state_dict()[name].view(torch.int16), t.view(torch.int16)) for name, t in want.items())
    assert main(["inspect", str(tmp_path / delta_path(1))]) == 0
    out = capsys.readouterr().out
    assert "codec        pairs" in out
    assert "parameter" in out and "pairs" in out and "model.layers.0.self_attn.q_proj.weight" in out
    publisher.close()


def test_an_unregistered_codec_is_refused_everywhere(pairs: None) -> None:
    data = encode_delta(one_change(), version=1, anchor=0, codec="pairs", total=8, fingerprint=FP1, base_fingerprint=FP0)
    header, changes = decode_delta(data, where="d", numels={"w": 8}, base_values=lambda name, index: index)
    assert header.codec == "pairs" and changes["w"].index.tolist() == [1, 5]
    unregister_codec("pairs")
    try:
        assert "pairs" not in CODECS
        with pytest.raises(FormatError, match="codec 'pairs' is unknown"):
            read_header(data, where="d")
        with pytest.raises(FormatError, match="unknown codec 'pairs'"):
            encode_delta(one_change(), version=1, anchor=0, codec="pairs", total=8, fingerprint=FP1, base_fingerprint=FP0)
        with pytest.raises(ConfigError, match="codec 'pairs' is unknown; choose one of raw, zstd"):
            PublishOptions(codec="pairs")
    finally:
        register_codec(PairsCodec())  # for the fixture to unregister


def test_a_codec_name_is_registered_once() -> None:
    class Twin(PairsCodec):
        name = "zstd"

    with pytest.raises(ValueError, match="a codec named 'zstd' is already registered"):
        register_codec(Twin())
    assert list(CODECS) == ["raw", "zstd"]


def test_inspect_raw_delta(tmp_path: Path, capsys) -> None:
    path = tmp_path / "delta.safetensors"
    path.write_bytes(
        encode_delta(one_change(), version=1, anchor=0, codec="raw", total=8, fingerprint=FP1, base_fingerprint=FP0)
    )
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "codec        raw" in out
    assert out.rstrip().splitlines()[-3:] == ["parameter  changed  index dtype", "---------  -------  -----------", "w          2        int32"]


def test_nothing_outside_the_codecs_compares_codec_names_or_reads_their_tensors() -> None:
    """Code outside ``deltasync/format/codecs`` goes through the registry: it never branches on
    a codec's name nor names a codec's tensors."""
    codecs = REPO_ROOT / "deltasync" / "format" / "codecs"
    found = []
    for path in [*(REPO_ROOT / "deltasync").rglob("*.py"), *(REPO_ROOT / "vllm_ext").rglob("*.py")]:
        if codecs in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in ("raw", "zstd")]
                if names:
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} compares with {names}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value.startswith("zstd:") or node.value in (":indices", ":values"):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} names the tensor {node.value!r}")
    assert not found, found
