"""write_checkpoint: shards, index, config.json and tokenizer files, atomic writes, progress."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from safetensors.torch import load_file

from deltasync import ConfigError
from deltasync.views import get_scheme, write_checkpoint

pytest.importorskip("compressed_tensors")


def _like(root: pathlib.Path) -> pathlib.Path:
    like = root / "like"
    like.mkdir()
    (like / "config.json").write_text(json.dumps({"model_type": "qwen2", "quantization_config": {"old": 1}}))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        (like / name).write_text(name)
    (like / "model.safetensors").write_bytes(b"not copied")
    return like


def _tensors() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 48, generator=gen) * 0.02).to(torch.bfloat16)
    view = get_scheme("FP8_DYNAMIC").quantize(w)
    big = torch.arange(4096, dtype=torch.int32)
    return [("a.weight", view["weight"]), ("a.weight_scale", view["weight_scale"]), ("b", big[1000:1100]),
            ("c", w.t()), ("d", torch.ones(3, dtype=torch.bfloat16))]  # fmt: skip


def test_one_shard_with_config_and_files(tmp_path: pathlib.Path) -> None:
    like = _like(tmp_path)
    tensors = _tensors()
    cfg = get_scheme("FP8_DYNAMIC").quantization_config(["lm_head"])
    seen: list[tuple[int, int]] = []
    written = write_checkpoint(tmp_path / "out", tensors, quantization_config=cfg, like=like,
                               progress=lambda d, t: seen.append((d, t)))  # fmt: skip
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in written) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]  # fmt: skip
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    assert seen == [(total, total)]
    got = load_file(out / "model.safetensors")
    for name, tensor in tensors:  # views and transposes are written as their values
        assert got[name].dtype == tensor.dtype and torch.equal(
            got[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)
        )
    config = json.loads((out / "config.json").read_text())
    assert config == {"model_type": "qwen2", "quantization_config": cfg}
    assert (out / "tokenizer.json").read_text() == "tokenizer.json"


def test_shards_and_index(tmp_path: pathlib.Path) -> None:
    like = _like(tmp_path)
    tensors = _tensors()
    seen: list[tuple[int, int]] = []
    written = write_checkpoint(tmp_path / "out", iter(tensors), quantization_config=None, like=like, max_shard_bytes=2000,
                               progress=lambda d, t: seen.append((d, t)), total_bytes=sum(t.nbytes for _, t in tensors))  # fmt: skip
    out = tmp_path / "out"
    shards = sorted(out.glob("model-*.safetensors"))
    # 3072 B of codes alone, then scales + b (128 + 400), then c (6144 B) alone, then d
    assert [p.name for p in shards] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == seen[-1][0] == seen[-1][1]
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) == 4
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(shard)
        assert all(index["weight_map"][k] == shard.name for k in part)
        merged.update(part)
    assert sorted(merged) == sorted(n for n, _ in tensors) == sorted(index["weight_map"])
    assert "quantization_config" not in json.loads((out / "config.json").read_text())  # bf16: removed
    assert out / "model.safetensors.index.json" in written
    assert not list(out.glob(".*"))  # no temporary file left


def test_without_like_writes_tensors_and_warns(tmp_path: pathlib.Path) -> None:
    with pytest.warns(UserWarning, match="tensors only"):
        written = write_checkpoint(tmp_path, _tensors(), quantization_config=None, like=None)
    assert [p.name for p in written] == ["model.safetensors"]


def test_refusals_leave_no_final_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="given twice"):
        write_checkpoint(tmp_path / "dup", [("x", torch.ones(2)), ("x", torch.ones(2))], quantization_config=None,
                         like=_like(tmp_path), max_shard_bytes=4)  # fmt: skip
    assert list((tmp_path / "dup").iterdir()) == []  # the first shard was only a temporary file
    with pytest.raises(ConfigError, match="has no config.json"):
        write_checkpoint(tmp_path / "x", [], quantization_config=None, like=tmp_path / "dup")
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="already holds model-00001-of-00002.safetensors"):
        write_checkpoint(tmp_path / "old", [], quantization_config=None, like=None)


def test_a_failing_source_leaves_no_final_file(tmp_path: pathlib.Path) -> None:
    def tensors():
        yield "a", torch.ones(1000)
        yield "b", torch.ones(1000)
        raise OSError("bucket went away")

    with pytest.raises(OSError, match="bucket went away"):
        write_checkpoint(
            tmp_path, tensors(), quantization_config=None, like=None, max_shard_bytes=4000, total_bytes=12000
        )
    assert list(tmp_path.iterdir()) == []


def test_files_have_the_umask_mode_not_0600(tmp_path: pathlib.Path) -> None:
    # A server running as another user (or in a container) must be able to read an export.
    old = os.umask(0o027)
    try:
        written = write_checkpoint(tmp_path / "out", iter(_tensors()), quantization_config=None, like=_like(tmp_path),
                                   max_shard_bytes=2000)  # fmt: skip
    finally:
        os.umask(old)
    shards = [p for p in written if p.suffix == ".safetensors"]
    assert len(shards) > 1
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {oct(0o640)}
    os.umask(0o022)
    try:
        written = write_checkpoint(tmp_path / "one", iter(_tensors()), quantization_config=None, like=tmp_path / "like")
    finally:
        os.umask(old)
    assert {oct(p.stat().st_mode & 0o777) for p in written} == {oct(0o644)}
