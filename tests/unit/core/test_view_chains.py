"""Quantized views published beside the bf16 chain: each an exact chain of its own.

Every test checks views against the definition: version N of a view is, bit for bit,
compressed-tensors' quantization (``deltasync.views``) of version N of the bf16 chain, with the
weights the scheme leaves alone in bf16.
"""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
from helpers import small_transformer, train_step

from deltasync import ConfigError, DeltaPublisher, DeltaReceiver, FormatError, VersionError, open_store
from deltasync.cli import main as cli
from deltasync.format import POINTER_PATH, Change, Pointer, encode_delta, sha256_hex, view_names, view_prefix
from deltasync.stores._sub import sub_store
from deltasync.trainer.view_targets import quantized_names
from deltasync.views import get_scheme
from deltasync.views.identity import ViewIdentity

FP8, W8A8 = "FP8_DYNAMIC", "W8A8"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8 if t.element_size() == 1 else torch.int16)


def expected_view(model: torch.nn.Module, bf16: dict[str, torch.Tensor], view: str) -> dict[str, torch.Tensor]:
    """The view of a bf16 state, by the definition."""
    scheme, targets = get_scheme(view), quantized_names(model, list(bf16), ("lm_head",))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in bf16.items():
        if name in targets:
            for suffix, t in scheme.quantize(tensor).items():
                out[name[: -len("weight")] + suffix] = t
        else:
            out[name] = tensor
    return out


def assert_view_exact(bucket, model, view: str, version: int | None = None) -> DeltaReceiver:
    bf16 = DeltaReceiver(bucket)
    bf16.sync(version)
    quant = DeltaReceiver(bucket, view=view)
    quant.sync(version)
    assert quant.version == bf16.version
    want, got = expected_view(model, bf16.state_dict(), view), quant.state_dict()
    assert set(want) == set(got)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert torch.equal(_bits(got[name]), _bits(want[name])), name
    assert quant.verify()
    return quant


def _trainer(tmp_path, **options):
    model = small_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    publisher = DeltaPublisher(tmp_path / "bucket", model, optimizer, views=(FP8, W8A8), **options)
    return model, optimizer, publisher


@pytest.mark.parametrize("capture", ["submit", "overlap"])
def test_every_version_of_each_view_is_the_quantization_of_the_bf16_version(tmp_path, capture):
    model, optimizer, publisher = _trainer(tmp_path, anchor_every=3, capture=capture)
    with publisher:
        first = publisher.publish()
        assert first.view_nbytes.keys() == {FP8, W8A8}
        for step in range(5):
            train_step(model, optimizer, step)
            result = publisher.submit().result()
            assert result.view_nbytes.keys() == {FP8, W8A8} and not result.warnings
            for view in (FP8, W8A8):
                receiver = assert_view_exact(tmp_path / "bucket", model, view)
                assert receiver.fingerprint == publisher.view_fingerprint(view)
    assert view_names(open_store(tmp_path / "bucket")) == [FP8, W8A8]
    # The bf16 chain is the one a publisher without views writes.
    plain = DeltaReceiver(tmp_path / "bucket")
    plain.sync()
    assert plain.verify() and plain.fingerprint == publisher.fingerprint


@pytest.mark.parametrize("part_bytes", [None, 8192], ids=["one-file", "split"])
def test_views_anchor_where_the_bf16_chain_does_and_late_joiners_catch_up(tmp_path, part_bytes):
    split = {} if part_bytes is None else {"anchor_part_bytes": part_bytes}  # anchors as parts at once
    model, optimizer, publisher = _trainer(tmp_path, anchor_every=2, anchor_bytes_ratio=0, **split)
    with publisher:
        publisher.publish()
        follower = DeltaReceiver(tmp_path / "bucket", view=FP8)
        follower.sync()
        for step in range(5):
            train_step(model, optimizer, step)
            publisher.publish()
            publisher.flush()
            follower.sync()
            assert follower.fingerprint == publisher.view_fingerprint(FP8)
    store = open_store(tmp_path / "bucket")
    bf16 = Pointer.from_bytes(store.read_bytes(POINTER_PATH))
    quant = Pointer.from_bytes(sub_store(store, view_prefix(FP8)).read_bytes(POINTER_PATH))
    assert [a.version for a in quant.anchors] == [a.version for a in bf16.anchors]
    assert quant.version == bf16.version
    assert all(len(a.files) > (2 if part_bytes else 0) and bool(a.parts) == bool(part_bytes) for a in (*quant.anchors, *bf16.anchors))
    late = assert_view_exact(tmp_path / "bucket", model, FP8)
    assert late.fingerprint == follower.fingerprint


def test_the_view_keeps_at_most_one_byte_per_quantized_weight_plus_scales(tmp_path):
    model, _optimizer, publisher = _trainer(tmp_path)
    with publisher:
        publisher.publish()
        view = publisher._views[0]  # noqa: SLF001 - what the publisher holds for the view
        targets = quantized_names(model, [n for n, _ in model.named_parameters()], ("lm_head",))
        weights = sum(model.get_parameter(n).numel() for n in targets)
        held = sum(t.nbytes for layer in view.quantized.values() for t in layer.values())
        scales = sum(layer["weight_scale"].nbytes for layer in view.quantized.values())
        assert held == weights + scales


class _FailingViews:
    """A local bucket whose writes into one view's folder fail while ``fail`` is set."""

    def __init__(self, root, view: str) -> None:
        self.inner = open_store(root)
        self.url = self.inner.url
        self.prefix = view_prefix(view)
        self.fail = False

    def read_bytes(self, path, limit=None):
        return self.inner.read_bytes(path, limit)

    def write_bytes(self, path, data):
        if self.fail and path.startswith(self.prefix):
            raise OSError(f"injected failure writing {path}")
        self.inner.write_bytes(path, data)

    def exists(self, path):
        return self.inner.exists(path)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, paths):
        self.inner.delete(paths)


def test_a_view_that_fails_a_version_is_reported_and_starts_a_new_chain(tmp_path):
    store = _FailingViews(tmp_path / "bucket", FP8)
    model = small_transformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DeltaPublisher(store, model, optimizer, views=(FP8,)) as publisher:
        publisher.publish()
        train_step(model, optimizer, 0)
        publisher.publish()
        follower = DeltaReceiver(tmp_path / "bucket", view=FP8)
        follower.sync()
        store.fail = True
        train_step(model, optimizer, 1)
        failed = publisher.publish()
        assert failed.kind == "delta" and FP8 not in failed.view_nbytes
        assert any(f"view {FP8}: version {failed.version} was not written" in w for w in failed.warnings)
        store.fail = False
        train_step(model, optimizer, 2)
        healed = publisher.publish()
        assert FP8 in healed.view_nbytes and not healed.warnings
        # A new chain rooted at an anchor of that version: the follower rebuilds from it.
        pointer = Pointer.from_bytes(sub_store(open_store(tmp_path / "bucket"), view_prefix(FP8)).read_bytes(POINTER_PATH))
        assert pointer.root == healed.version
        assert follower.sync() == healed.version
        assert follower.fingerprint == publisher.view_fingerprint(FP8)
    assert_view_exact(tmp_path / "bucket", model, FP8)


def test_unknown_schemes_and_bad_options_are_refused_by_name(tmp_path):
    model = small_transformer()
    with pytest.raises(ConfigError, match="FP9_MAGIC"):
        DeltaPublisher(tmp_path / "a", model, None, views=("FP9_MAGIC",))
    with pytest.raises(ConfigError, match="tuples of names"):
        DeltaPublisher(tmp_path / "b", model, None, views="FP8_DYNAMIC")
    with pytest.raises(ConfigError, match="twice"):
        DeltaPublisher(tmp_path / "c", model, None, views=(FP8, FP8))


def _tampered(bucket, view: str, spoil) -> int:
    """Commit a delta that ``spoil(state)`` makes into ``view``'s chain; its version."""
    from dataclasses import replace

    from deltasync.format import ChainEntry

    store = sub_store(open_store(bucket), view_prefix(view))
    pointer = Pointer.from_bytes(store.read_bytes(POINTER_PATH))
    reader = DeltaReceiver(bucket, view=view)
    reader.sync()
    state = reader.state_dict()
    changes = spoil(state)
    version = pointer.version + 1
    data = encode_delta(changes, version=version, anchor=pointer.root, codec="raw", total=pointer.total,
                        fingerprint=pointer.fingerprint, base_fingerprint=pointer.fingerprint,
                        numels={n: t.numel() for n, t in state.items()}, manifest=pointer.manifest,
                        extra_metadata=ViewIdentity.of(view).metadata())  # fmt: skip
    path = f"deltas/{version:08d}.safetensors"
    store.write_bytes(path, data)
    entry = ChainEntry(version=version, kind="delta", path=path, nbytes=len(data), sha256=sha256_hex(data),
                       fingerprint=pointer.fingerprint, changed=1)  # fmt: skip
    store.write_bytes(POINTER_PATH, replace(pointer, version=version, chain=(*pointer.chain, entry)).to_bytes())
    return version


SCALE = "model.layers.0.mlp.down_proj.weight_scale"
CODES = "model.layers.0.mlp.down_proj.weight"
ONE = torch.tensor([0])
BAD_VIEW_DELTAS = {
    "NaN scale": (lambda s: {SCALE: Change(ONE, torch.tensor([float("nan")], dtype=torch.bfloat16))}, "NaN"),
    "infinite scale": (lambda s: {SCALE: Change(ONE, torch.tensor([float("inf")], dtype=torch.bfloat16))}, "inf"),
    "zero scale": (lambda s: {SCALE: Change(ONE, torch.zeros(1, dtype=torch.bfloat16))}, "finite and positive"),
    "NaN code": (lambda s: {CODES: Change(ONE, torch.tensor([0x7F], dtype=torch.uint8).view(torch.float8_e4m3fn))}, "is NaN"),
    "bf16 values for codes": (lambda s: {CODES: Change(ONE, torch.ones(1, dtype=torch.bfloat16))}, "float8_e4m3fn"),
}


@pytest.mark.parametrize("case", BAD_VIEW_DELTAS)
def test_bad_codes_scales_and_dtypes_are_refused_by_name_and_change_nothing(tmp_path, case):
    _model, _optimizer, publisher = _trainer(tmp_path)
    with publisher:
        publisher.publish()
        receiver = DeltaReceiver(tmp_path / "bucket", view=FP8)
        receiver.sync()
        before = {n: _bits(t).clone() for n, t in receiver.state_dict().items()}
        spoil, message = BAD_VIEW_DELTAS[case]
        version = _tampered(tmp_path / "bucket", FP8, spoil)
        with pytest.raises(FormatError) as info:
            receiver.sync()
        assert message in str(info.value) and f"deltas/{version:08d}.safetensors" in str(info.value)
        assert receiver.version == 0
        assert all(torch.equal(_bits(t), before[n]) for n, t in receiver.state_dict().items())


def test_a_bf16_receiver_refuses_a_view_anchor_for_its_weights(tmp_path):
    _model, _optimizer, publisher = _trainer(tmp_path)
    with publisher:
        publisher.publish()
    bf16 = DeltaReceiver(tmp_path / "bucket")
    bf16.sync()
    # Pointed at the view's folder, a receiver of the bf16 chain refuses its pointer, with or
    # without the manifest of the weights it serves.
    folder = sub_store(open_store(tmp_path / "bucket"), view_prefix(FP8))
    for confused in (DeltaReceiver(folder, expected={n: t.shape for n, t in bf16.state_dict().items()}),
                     DeltaReceiver(folder)):  # fmt: skip
        with pytest.raises(FormatError, match="views/FP8_DYNAMIC/latest.json: the bf16 chain was asked for, the "
                           "pointer names view FP8_DYNAMIC"):  # fmt: skip
            confused.sync()
        assert confused.version is None


def test_export_writes_loadable_checkpoints_of_the_bf16_chain_and_of_a_view(tmp_path, tiny_model_dir, capsys):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    model, optimizer, publisher = _trainer(tmp_path)
    with publisher:
        publisher.publish()
        train_step(model, optimizer, 0)
        publisher.publish()
    like = tmp_path / "like"
    like.mkdir()
    (like / "config.json").write_text(json.dumps(model.config.to_dict()))
    (like / "tokenizer.json").write_text((tiny_model_dir / "tokenizer.json").read_text())
    assert cli(["export", str(tmp_path / "bucket"), str(tmp_path / "fp8"), "--view", FP8, "--version", "0",
                "--like", str(like)]) == 0  # fmt: skip
    assert "version 0" in capsys.readouterr().out
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["quantization_config"] == get_scheme(FP8).quantization_config(["lm_head"])
    assert AutoConfig.from_pretrained(tmp_path / "fp8").quantization_config["quant_method"] == "compressed-tensors"
    assert (tmp_path / "fp8" / "tokenizer.json").is_file()
    receiver = DeltaReceiver(tmp_path / "bucket", view=FP8)
    receiver.sync(0)
    saved = load_file(tmp_path / "fp8" / "model.safetensors")
    assert set(saved) == set(receiver.state_dict())
    assert all(torch.equal(_bits(saved[n]), _bits(t)) for n, t in receiver.state_dict().items())
    assert cli(["export", str(tmp_path / "bucket"), str(tmp_path / "bf16"), "--like", str(like)]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "bf16" / "config.json").read_text())
    bf16 = DeltaReceiver(tmp_path / "bucket")
    bf16.sync()
    saved = load_file(tmp_path / "bf16" / "model.safetensors")
    assert all(torch.equal(_bits(saved[n]), _bits(t)) for n, t in bf16.state_dict().items())
    with pytest.raises(VersionError, match="views/FP8_BLOCK/latest.json: no version is committed"):
        DeltaReceiver(tmp_path / "bucket", view="FP8_BLOCK").sync()


def test_moe_views_quantize_each_expert_as_the_checkpoint_holds_it(tmp_path):
    from moe_helpers import moe_model, routed_step, saved_state

    from deltasync.examples.tiny import build_tiny_moe_model
    from deltasync.trainer.view_targets import ignore_list

    model = moe_model(build_tiny_moe_model(tmp_path / "moe", num_experts=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DeltaPublisher(tmp_path / "bucket", model, optimizer, views=(FP8,)) as publisher:
        publisher.publish()
        routed_step(model, optimizer, 0)
        publisher.publish()
        config = publisher._views[0].config  # noqa: SLF001 - what the view's anchors carry
    state = saved_state(model)  # save_pretrained's per-expert tensors, in bf16
    want = expected_view(model, state, FP8)
    assert any(".experts.3.down_proj.weight_scale" in name for name in want)
    quant = DeltaReceiver(tmp_path / "bucket", view=FP8)
    quant.sync()
    got = quant.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(_bits(got[n]), _bits(want[n])) for n in want)
    # The routers stay bf16 and the config names them, as llm-compressor writes it.
    assert config["ignore"] == ignore_list(model, ("lm_head",))
    assert any(name.endswith("mlp.gate") for name in config["ignore"])


@pytest.mark.parametrize("part_bytes", [None, 4096], ids=["one-file", "split"])
def test_a_moe_view_reads_each_fused_expert_tensor_a_block_at_a_time(tmp_path, part_bytes):
    """A fused experts tensor serves one checkpoint name per expert, and a view's names of two
    fused tensors alternate (``experts.0.down_proj``, ``experts.0.gate_proj``, ...): each name
    reads its own block of the snapshot, so a version's view copies about the model once, not
    once per expert."""
    from moe_helpers import moe_model, routed_step

    from deltasync.examples.tiny import build_tiny_moe_model

    model = moe_model(build_tiny_moe_model(tmp_path / "moe", num_experts=8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    split = {} if part_bytes is None else {"anchor_part_bytes": part_bytes}
    with DeltaPublisher(tmp_path / "bucket", model, optimizer, views=(FP8,), anchor_every=1, **split) as publisher:
        copied = []
        read = publisher.detector.published_flat

        def counted(*args):
            out = read(*args)
            copied.append(out.numel())
            return out

        publisher.detector.published_flat = counted
        publisher.publish()
        routed_step(model, optimizer, 0)
        publisher.publish()  # a delta and an anchor
    elements = sum(p.numel() for p in model.parameters())
    # Version 0's anchor, then version 1's delta and anchor: each reads a target at most twice
    # (its block scales, then its codes).
    assert 0 < sum(copied) <= 3 * 2 * elements
    assert_view_exact(tmp_path / "bucket", model, FP8)


def test_a_view_pointer_changed_under_its_writer_stops_that_view_and_changes_nothing(tmp_path):
    """A view's commits are conditional, as the bf16 chain's: its own bytes written again are
    still its own; another writer's pointer stops the view (said in the result's warnings), and
    nothing of the view's folder changes after, while the bf16 chain goes on."""
    model, optimizer, publisher = _trainer(tmp_path, anchor_every=1000)
    store = open_store(tmp_path / "bucket")
    folder = view_prefix(FP8)
    pointer_path = folder + POINTER_PATH
    with publisher:
        publisher.publish()
        store.write_bytes(pointer_path, store.read_bytes(pointer_path))  # same bytes, a new tag
        train_step(model, optimizer, 0)
        result = publisher.publish()
        assert not result.warnings and result.view_nbytes.keys() == {FP8, W8A8}
        assert_view_exact(tmp_path / "bucket", model, FP8, 1)
        foreign = store.read_bytes(pointer_path).replace(b"{", b"{ ", 1)  # another writer's commit
        Pointer.from_bytes(foreign)  # still a valid pointer
        store.write_bytes(pointer_path, foreign)
        files = {path: store.read_bytes(path) for path in store.list(folder)}
        for step in (1, 2):
            train_step(model, optimizer, step)
            result = publisher.publish()
            (warning,) = result.warnings
            assert f"view {FP8}: the pointer {store.url}/{pointer_path} changed under this writer" in warning
            assert "another writer commits this view" in warning, warning
            assert result.view_nbytes.keys() == {W8A8}  # the other view goes on
            assert {path: store.read_bytes(path) for path in store.list(folder)} == files
        assert_view_exact(tmp_path / "bucket", model, W8A8, 3)
        assert DeltaReceiver(tmp_path / "bucket").sync() == 3
        assert DeltaReceiver(tmp_path / "bucket", view=FP8).sync() == 1  # the chain it found, whole


def test_a_view_chain_has_a_history_naming_its_writer_per_version_and_verify_checks_it(tmp_path, capsys):
    """Each view's folder has the history the bf16 chain has: a record of each version naming the
    publisher that committed it, carried on by the next publisher; ``verify --view`` reports a
    history that names two writers for one version of the view."""
    bucket = tmp_path / "bucket"
    model, optimizer, publisher = _trainer(tmp_path, anchor_every=2)
    with publisher:
        for step in range(4):
            if step:
                train_step(model, optimizer, step)
            publisher.publish()
        publisher.flush()
    with DeltaPublisher(bucket, model, optimizer, views=(FP8, W8A8)) as second:
        train_step(model, optimizer, 4)
        assert second.publish().version == 4  # the first let go: no version skipped
    tokens = {r["version"]: r["writer"]["token"] for r in map(json.loads, (bucket / "history.jsonl").read_text().splitlines())}
    assert tokens[0] == tokens[3] != tokens[4]
    for view in (FP8, W8A8):
        folder = bucket / view_prefix(view)
        records = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
        pointer = Pointer.from_bytes((folder / POINTER_PATH).read_bytes())
        assert pointer.writer is None and pointer.view is not None  # the view's pointer, as before: its identity
        assert [r["version"] for r in records] == [0, 1, 2, 3, 4]
        # A new publisher starts the view anew: an anchor of its first version.
        assert [r["kind"] for r in records] == ["anchor", "delta", "delta", "delta", "anchor"]
        assert {r["version"]: r["writer"]["token"] for r in records} == tokens
        assert all((r["writer"]["host"], r["writer"]["pid"]) == (socket.gethostname(), os.getpid()) for r in records)
        assert "anchor_nbytes" in records[2]  # the anchor beside version 2's delta
        # Capture to commit, written with the next commit (the last publisher's last version has none).
        assert all(r["seconds"] > 0 for r in records[:3]) and records[3]["seconds"] == 0.0
        assert records[4]["fingerprint"] == pointer.fingerprint and pointer.version == 4
        assert cli(["verify", str(bucket), "--view", view]) == 0
    # Another writer's record of version 1 of a view: verify names both writers.
    path = bucket / view_prefix(FP8) / "history.jsonl"
    lines = path.read_text().splitlines()
    other = {**json.loads(lines[1]), "writer": {"host": "elsewhere", "pid": 7, "token": "f" * 32}, "fingerprint": "0" * 16}
    path.write_text("\n".join([*lines, json.dumps(other, sort_keys=True)]) + "\n")
    capsys.readouterr()
    assert cli(["verify", str(bucket), "--view", FP8]) == 1
    err = capsys.readouterr().err
    assert f"views/{FP8}/history.jsonl names two writers for version 1" in err, err
    assert "host 'elsewhere', process 7" in err
    assert cli(["verify", str(bucket), "--view", W8A8]) == 0  # each chain's history is its own
    assert cli(["verify", str(bucket)]) == 0
