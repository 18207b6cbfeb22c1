"""The worker's update logic without a server: what is checked, what is sent, what is kept.

The vLLM reload is replaced by a recorder, so these tests pin down the decisions (fused
groups, refusals, restore after a failed load, prefetch reuse) in seconds; the server
tests check that the real reload is exact.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from types import SimpleNamespace

import pytest
import torch
from helpers import small_transformer
from servers import requires_vllm

from deltasync import DeltaPublisher, bf16_state_dict, fingerprint
from deltasync.protocol.auth import update_tag
from deltasync.protocol.messages import PrefetchState, UpdateAnswer, WorkerStatus

pytestmark = requires_vllm

QWEN2_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


# --------------------------------------------------------------------------- groups and checkpoint


def test_module_groups_follow_packed_modules_mapping():
    from deltasync.server.groups import module_groups, reload_groups

    names = [
        "model.embed_tokens.weight",
        *(f"model.layers.0.self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")),
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.1.self_attn.q_proj.weight",
        "model.norm.weight",
    ]
    groups = module_groups(names, QWEN2_PACKED)
    assert groups["model.layers.0.self_attn.qkv_proj"] == names[1:7]
    assert groups["model.layers.0.mlp.gate_up_proj"] == names[8:10]
    assert groups["model.norm"] == ["model.norm.weight"]
    assert reload_groups(["model.layers.0.self_attn.k_proj.bias"], names, QWEN2_PACKED) == names[1:7]
    assert reload_groups(["model.layers.0.mlp.up_proj.weight", "model.norm.weight"], names, QWEN2_PACKED) == [
        *names[8:10],
        "model.norm.weight",
    ]
    # Layer 1's q_proj is its own group: layer numbers are part of the module path.
    assert reload_groups(["model.layers.1.self_attn.q_proj.weight"], names, QWEN2_PACKED) == [names[-2]]
    assert reload_groups(["model.layers.0.self_attn.o_proj.weight"], names, {}) == [names[7]]


def test_checkpoint_shapes_come_from_the_safetensors_headers(tiny_model_factory, tmp_path):
    from safetensors.torch import save_file

    from deltasync import FormatError
    from deltasync.server.checkpoint import read_checkpoint_shapes, resolve_model_dir

    model_dir = tiny_model_factory(seed=0)
    shapes = read_checkpoint_shapes(model_dir)
    model = _trainer(model_dir)
    assert shapes == {name: tuple(t.shape) for name, t in bf16_state_dict(model).items()}
    assert "lm_head.weight" not in shapes  # tied: the checkpoint holds the embedding once
    assert resolve_model_dir(str(model_dir)) == model_dir
    assert resolve_model_dir(str(tmp_path / "nowhere")) is None

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a.weight": torch.zeros(2, 3)}, sharded / "part-1.safetensors")
    save_file({"b.weight": torch.zeros(4)}, sharded / "part-2.safetensors")
    save_file({"ignored": torch.zeros(1)}, sharded / "consolidated.safetensors")
    index = {"weight_map": {"a.weight": "part-1.safetensors", "b.weight": "part-2.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert read_checkpoint_shapes(sharded) == {"a.weight": (2, 3), "b.weight": (4,)}
    with pytest.raises(FormatError, match="no \\*.safetensors files"):
        read_checkpoint_shapes(tmp_path)


# --------------------------------------------------------------------------- the update flow


def _trainer(model_dir: pathlib.Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


class Recorder:
    """Stands in for vllm_ext._reload.reload_weights (as vLLM's worker calls it): records
    what would be loaded."""

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        self.fail_on: set[int] = set()
        self.partial_on: set[int] = set()

    def __call__(self, model, vllm_config, weights):
        number = len(self.calls)
        self.calls.append({name: tensor.clone() for name, tensor in weights})
        if number in self.fail_on:
            raise AssertionError("Attempted to load weight (torch.Size([128, 256])) into parameter (torch.Size([0]))")
        partial = ["model.layers.0.self_attn.qkv_proj"] if number in self.partial_on else []
        return set(self.calls[-1]), partial


class World:
    """A tiny model directory, a bucket with version 0, a trainer and a worker updater."""

    def __init__(self, model_dir: pathlib.Path, root: pathlib.Path, monkeypatch, *, token: str | None = "tok") -> None:
        from vllm_ext import _worker

        self.model_dir = model_dir
        self.bucket = root / "bucket"
        self.model = _trainer(model_dir)
        self.publisher = DeltaPublisher(self.bucket, self.model, None)
        self.publisher.publish()
        self.reload = Recorder()
        monkeypatch.setattr(_worker, "reload_weights", self.reload)
        self.token = token
        self.updater = self.make_updater(bucket=str(self.bucket), token=token)

    def make_updater(self, *, bucket: str | None, token: str | None):
        from deltasync.server.updater import ServerConfig, WorkerUpdater
        from vllm_ext._worker import VllmWorker

        served = torch.nn.Module()
        served.packed_modules_mapping = QWEN2_PACKED
        model_config = SimpleNamespace(
            model=str(self.model_dir), revision=None, hf_text_config=SimpleNamespace(tie_word_embeddings=True)
        )
        worker = VllmWorker(served, SimpleNamespace(model_config=model_config))
        return WorkerUpdater(worker, ServerConfig(bucket=bucket, token=token))

    def tag(self, version: int) -> str | None:
        return None if self.token is None else update_tag(self.token, version)

    def update(self, version: int):
        return self.updater.update(version, self.tag(version))

    def edit(self, name: str, rows: slice = slice(0, 4), amount: float = 0.05) -> int:
        with torch.no_grad():
            self.model.get_parameter(name)[rows] += amount
        return self.publisher.publish().version

    def state(self) -> dict[str, torch.Tensor]:
        return bf16_state_dict(self.model)


@pytest.fixture
def world(tiny_model_factory, tmp_path, monkeypatch):
    return World(tiny_model_factory(seed=0), tmp_path, monkeypatch)


def _assert_sent_exactly(sent: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> None:
    for name, tensor in sent.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor.view(torch.int16), state[name].view(torch.int16)), name


def test_first_update_loads_every_parameter_then_deltas_send_whole_fused_groups(world):
    result = world.update(0)
    assert (result["version"], result["kind"], result["sent"]) == (0, "anchor", len(world.state()))
    assert set(world.reload.calls[0]) == set(world.state())
    _assert_sent_exactly(world.reload.calls[0], world.state())

    version = world.edit("model.layers.0.self_attn.q_proj.weight")
    result = world.update(version)
    assert (result["kind"], result["changed"], result["sent"]) == ("delta", 1, 6)
    assert sorted(world.reload.calls[1]) == sorted(
        f"model.layers.0.self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")
    )
    _assert_sent_exactly(world.reload.calls[1], world.state())

    version = world.edit("model.layers.1.mlp.gate_proj.weight")
    result = world.update(version)
    assert sorted(world.reload.calls[2]) == ["model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"]
    _assert_sent_exactly(world.reload.calls[2], world.state())
    status = world.updater.status()
    assert (status["version"], status["fingerprint"]) == (version, fingerprint(world.state()))
    assert status["last_update"]["version"] == version and status["auth"] is True
    # The answers are the typed messages' plain data: they parse back whole.
    typed = WorkerStatus.from_answer(status)
    assert typed.last_update is not None and typed.last_update.time is not None
    assert dataclasses.replace(typed.last_update, time=None) == UpdateAnswer.from_answer(result)
    assert (typed.mode, typed.last_update.mode, typed.last_update.kind) == ("reload", "reload", "delta")

    # The same version again is a no-op that loads nothing.
    assert world.update(version)["kind"] == "none"
    assert len(world.reload.calls) == 3


def _refused(world, version, auth, match):
    from deltasync.server.updater import UpdateError

    before = (world.updater.status()["version"], world.updater.status()["fingerprint"], len(world.reload.calls))
    with pytest.raises(UpdateError, match=match):
        world.updater.update(version, auth)
    after = (world.updater.status()["version"], world.updater.status()["fingerprint"], len(world.reload.calls))
    assert after == before  # nothing was loaded, nothing committed


def test_refusals_change_nothing(world):
    world.update(0)
    version = world.edit("model.layers.0.self_attn.q_proj.weight")
    _refused(world, version, None, r"refused \(AuthError\): the update to version 1 carries no auth tag")
    _refused(world, version, update_tag("other", version), r"auth tag of the update to version 1 is wrong")
    _refused(world, version, world.tag(version - 1), "is wrong")  # a tag for another version
    _refused(world, 7, world.tag(7), r"refused \(VersionError\): version 7 is not committed in file:.* \(the newest is 1\)")
    _refused(world, "1", world.tag(1), "must be a non-negative integer, got '1'")
    _refused(world, True, None, "must be a non-negative integer")

    path = world.bucket / "deltas" / f"{version:08d}.safetensors"
    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    path.write_bytes(bytes(flipped))
    _refused(world, version, world.tag(version), r"IntegrityError.*SHA-256 .* \(corrupted or tampered\); still serving version 0")
    path.write_bytes(good[:-10])
    _refused(world, version, world.tag(version), r"bytes, the pointer says \d+ \(truncated or replaced\)")
    path.unlink()
    _refused(world, version, world.tag(version), r"NotFoundError")
    path.write_bytes(good)
    assert world.update(version)["version"] == version


def test_versions_from_another_model_are_refused_before_loading(world, tiny_model_factory, tmp_path):
    other = tmp_path / "other"
    DeltaPublisher(other, small_transformer(), None).publish()  # other sizes, same names
    updater = world.make_updater(bucket=str(other), token=None)
    with pytest.raises(Exception, match=r"version 0: model.embed_tokens.weight has shape \[256, 64\], the served checkpoint's is \[512, 128\]; "
                                        "still serving the checkpoint it started with"):
        updater.update(0)
    fewer = tmp_path / "fewer"
    DeltaPublisher(fewer, _trainer(tiny_model_factory(seed=0, num_layers=1)), None).publish()
    updater = world.make_updater(bucket=str(fewer), token=None)
    with pytest.raises(Exception, match=r"version 0 does not fit the served model .*: 12 parameters of the served "
                                        r"checkpoint are missing \(e.g. model.layers.1"):
        updater.update(0)
    assert world.reload.calls == []


def test_a_server_without_a_bucket_or_token(world):
    updater = world.make_updater(bucket=None, token=None)
    with pytest.raises(Exception, match="this server follows no bucket: start it with DELTASYNC_BUCKET=<bucket URL>"):
        updater.update(0)
    assert updater.status()["version"] is None
    open_server = world.make_updater(bucket=str(world.bucket), token=None)
    assert open_server.update(0, "any tag is ignored without a token")["version"] == 0


def test_a_failed_load_restores_the_previous_state(world):
    from deltasync.server.updater import UpdateError

    world.update(0)
    version = world.edit("model.layers.1.self_attn.v_proj.bias", rows=slice(0, 8))
    world.reload.fail_on = {1}
    old = world.updater.status()["fingerprint"]
    with pytest.raises(UpdateError, match=r"loading version 1 into the model failed \(AssertionError: Attempted to "
                                          r"load.*the weights were restored: still serving version 0"):
        world.update(version)
    assert world.updater.status()["version"] == 0 and world.updater.status()["fingerprint"] == old
    restore = world.reload.calls[2]
    assert len(restore) == len(world.state())  # every parameter, at version 0
    assert fingerprint(restore) == old
    assert world.update(version)["version"] == version


def test_a_partially_loaded_module_triggers_a_full_reload(world):
    world.update(0)
    version = world.edit("model.layers.0.self_attn.q_proj.weight")
    world.reload.partial_on = {1}
    result = world.update(version)
    assert result["version"] == version and result["sent"] == len(world.state())
    assert len(world.reload.calls[1]) == 6 and len(world.reload.calls[2]) == len(world.state())
    _assert_sent_exactly(world.reload.calls[2], world.state())


def test_prefetch_stages_in_the_background_and_update_reuses_it(world):
    from deltasync.server.updater import UpdateError

    world.update(0)
    version = world.edit("model.norm.weight", rows=slice(0, 64))
    started = world.updater.prefetch(version, world.tag(version))
    assert started["version"] == version and started["state"] in ("running", "ready")
    world.updater._prefetch.thread.join()
    assert world.updater.status()["prefetch"]["state"] == "ready"
    result = world.update(version)
    assert result["prefetched"] is True and sorted(world.reload.calls[1]) == ["model.norm.weight"]
    assert world.updater.status()["prefetch"] is None

    with pytest.raises(UpdateError, match="prefetch of version 9 refused: version 9 is not committed"):
        world.updater.prefetch(9, world.tag(9))
    with pytest.raises(UpdateError, match="prefetch of version 2 refused: the auth tag"):
        world.updater.prefetch(2, world.tag(3))
    assert world.updater.prefetch(version, world.tag(version))["state"] == "applied"

    # A prefetch staged before another update is stale: the update stages again.
    second = world.edit("model.norm.weight", rows=slice(0, 64))
    world.updater.prefetch(second, world.tag(second))
    world.updater._prefetch.thread.join()
    world.updater._prefetch.staged.from_version = -1  # as if another update had happened since
    result = world.update(second)
    assert result["prefetched"] is False and result["version"] == second


def test_begin_is_prefetch_and_status_in_one_call_and_never_raises(world, monkeypatch):
    world.update(0)
    version = world.edit("model.norm.weight", rows=slice(0, 64))
    begun = WorkerStatus.from_answer(world.updater.begin(version, world.tag(version)))
    assert begun.version == 0 and begun.prefetch.version == version and begun.prefetch.state in ("running", "ready")
    world.updater._prefetch.thread.join()
    with monkeypatch.context() as patch:
        # Staged already: found without reading the bucket again (the call runs between engine steps).
        patch.setattr(world.updater._receiver, "latest", lambda: pytest.fail("the pointer was read again"))
        again = WorkerStatus.from_answer(world.updater.begin(version, world.tag(version)))
        assert again.prefetch.state == "ready" and again.prefetch.stage_s > 0
        # A refusal is the answer's prefetch state, on the last worker too (it raises from prefetch).
        refused = WorkerStatus.from_answer(world.updater.begin(version, world.tag(version + 1)))
        assert refused.prefetch.state == "refused" and "the auth tag" in refused.prefetch.error
        assert refused.version == 0 and world.updater.status()["prefetch"]["state"] == "ready"  # the staged job kept
    assert world.update(version)["prefetched"] is True
    assert WorkerStatus.from_answer(world.updater.begin(version, world.tag(version))).prefetch.state == "applied"


def test_begin_with_the_followers_pointer_reads_no_pointer_and_drops_a_bad_one(world, monkeypatch, caplog):
    from deltasync.reader import receiver as receiver_module

    world.update(0)
    version = world.edit("model.norm.weight", rows=slice(0, 64))
    pointer = (world.bucket / "latest.json").read_bytes()
    real_read = receiver_module.read_pointer
    with monkeypatch.context() as patch:
        patch.setattr(receiver_module, "read_pointer", lambda store: pytest.fail("the pointer was read again"))
        begun = WorkerStatus.from_answer(world.updater.begin(version, world.tag(version), pointer))
        assert begun.prefetch.version == version and begun.prefetch.state in ("running", "ready")
        world.updater._prefetch.thread.join()
        assert world.updater.status()["prefetch"]["state"] == "ready"
        result = world.update(version)
    assert result["prefetched"] is True and result["version"] == version
    assert torch.equal(world.reload.calls[-1]["model.norm.weight"].view(torch.int16),
                       world.state()["model.norm.weight"].view(torch.int16))  # fmt: skip

    # Bytes that are not a pointer are dropped with a warning: the worker reads the bucket's.
    version = world.edit("model.norm.weight", rows=slice(64, 128))
    reads: list[str] = []
    monkeypatch.setattr(receiver_module, "read_pointer", lambda store: reads.append(store.url) or real_read(store))
    with caplog.at_level("WARNING", logger="deltasync.server.updater"):
        begun = WorkerStatus.from_answer(world.updater.begin(version, world.tag(version), b'{"format": 1, "versio'))
    assert begun.prefetch.state in ("running", "ready") and "is not used" in caplog.text
    world.updater._prefetch.thread.join()
    assert world.update(version)["version"] == version and reads

    # An offer a stage did not use is forgotten by the next call without one: never read stale.
    stale = (world.bucket / "latest.json").read_bytes()
    world.updater.begin(version, world.tag(version), stale)  # applied already: nothing staged
    newer = world.edit("model.norm.weight", rows=slice(0, 8))
    assert world.updater.prefetch(newer, world.tag(newer))["version"] == newer
    world.updater._prefetch.thread.join()
    assert world.update(newer)["version"] == newer


class _TwoWorkers:
    """A fake tensor-parallel group of two: this worker and a peer whose errors we script."""

    world_size = 2
    rank_in_group = 1
    cpu_group = None


def test_with_several_workers_all_agree_and_only_the_last_raises(world, monkeypatch):
    from vllm_ext import _ranks
    from deltasync.server.updater import UpdateError

    peer_errors = iter([None, None, "(IntegrityError): the peer read a bad file", None,
                        "loading version 1 into the model failed (RuntimeError: peer out of memory)"])  # fmt: skip

    def all_gather_object(out, obj, group=None):
        out[:] = [[next(peer_errors)], obj]  # each worker sends the list of what it holds so far

    monkeypatch.setattr(_ranks, "parallel_groups", lambda: [_TwoWorkers()])
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    world.update(0)  # two agreements: staged everywhere, loaded everywhere

    version = world.edit("model.layers.0.mlp.down_proj.weight")
    with pytest.raises(UpdateError, match=r"update to version 1 refused \(IntegrityError\): the peer read a bad file"):
        world.update(version)
    assert len(world.reload.calls) == 1  # nothing loaded anywhere

    # The peer's load fails after ours worked: we put version 0 back before anyone commits.
    with pytest.raises(UpdateError, match=r"peer out of memory\); the weights were restored: still serving version 0"):
        world.update(version)
    assert [len(c) for c in world.reload.calls[1:]] == [1, len(world.state())]
    assert world.updater.status()["version"] == 0

    # A worker that is not the last returns the error instead of raising it, so that vLLM
    # reads every worker's answer (it stops at the first error).
    world.updater.last_rank = False
    monkeypatch.setattr(_ranks, "parallel_groups", lambda: [])
    answer = world.update(99)
    assert answer["version"] == 99 and "version 99 is not committed" in answer["error"]
    assert world.updater.status()["last_error"]["error"] == answer["error"]
    refused = PrefetchState.from_answer(world.updater.prefetch(99, world.tag(99)))
    assert refused.state == "refused" and "is not committed" in refused.error


def test_a_failed_prefetch_is_reported_and_retried(world):
    from deltasync.server.updater import UpdateError

    world.update(0)
    version = world.edit("model.norm.weight", rows=slice(0, 64))
    path = world.bucket / "deltas" / f"{version:08d}.safetensors"
    good = path.read_bytes()
    path.write_bytes(good[:-1])
    world.updater.prefetch(version, world.tag(version))
    world.updater._prefetch.thread.join()
    state = world.updater.status()["prefetch"]
    assert state["state"] == "failed" and state["error"].startswith("IntegrityError: ")
    path.write_bytes(good)
    assert world.updater.prefetch(version, world.tag(version))["state"] in ("running", "ready")  # tried again
    world.updater._prefetch.thread.join()
    assert world.update(version)["prefetched"] is True
    # A failed prefetch never hides the real error of the update.
    second = world.edit("model.norm.weight", rows=slice(0, 64))
    (world.bucket / "deltas" / f"{second:08d}.safetensors").write_bytes(b"junk")
    world.updater.prefetch(second, world.tag(second))
    with pytest.raises(UpdateError, match=r"update to version 2 refused \(IntegrityError\): .*\(version 2\): 4 bytes, "
                                          r"the pointer says \d+ \(truncated or replaced\); still serving version 1"):
        world.update(second)


def test_a_corrupt_or_missing_delta_beside_an_anchor_is_healed_and_reported(world):
    """A delta file that is corrupt (then one that is missing) with an anchor of its version
    beside it: the update loads the anchor, is exact, and its answer and the worker's status
    say so (typed), naming the file."""
    from deltasync import open_store

    world.update(0)
    store = open_store(world.bucket)
    assert world.updater.status()["last_heal"] is None
    for damage in ("corrupt", "missing"):
        with torch.no_grad():
            world.model.get_parameter("model.norm.weight")[:4] += 0.05
        version = world.publisher.publish(anchor=True).version
        world.publisher.flush()
        path = f"deltas/{version:08d}.safetensors"
        if damage == "corrupt":
            data = bytearray(store.read_bytes(path))
            data[len(data) // 2] ^= 1
            store.write_bytes(path, bytes(data))
        else:
            store.delete([path])
        answer = UpdateAnswer.from_answer(world.update(version))
        assert (answer.version, answer.kind, answer.fingerprint) == (version, "anchor", fingerprint(world.state()))
        assert answer.healed is not None and (answer.healed.version, answer.healed.anchor) == (version, version)
        assert path in answer.healed.error and answer.healed.error.startswith(
            "IntegrityError" if damage == "corrupt" else "NotFoundError"
        )
        status = WorkerStatus.from_answer(world.updater.status())
        assert status.last_heal == answer.healed and status.version == version
    # The next update uses its delta: not marked, and the last heal stays reported.
    version = world.edit("model.norm.weight", rows=slice(0, 4))
    answer = UpdateAnswer.from_answer(world.update(version))
    assert (answer.kind, answer.healed) == ("delta", None)
    assert WorkerStatus.from_answer(world.updater.status()).last_heal is not None
