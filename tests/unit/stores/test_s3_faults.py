"""The fault matrix on S3: a real S3-protocol server (moto's) behind a proxy that throttles
(503 SlowDown), fails (500), resets connections, loses answers of requests that landed, cuts
reads short and slows the link (tests/fault_proxy.py). The publisher rides through what clears
within its retry budget (botocore's and s3fs's retries, with backoff), never commits a pointer
to a file that is not whole, and a fault that does not clear fails the version with an error
naming the bucket and the object, having committed nothing; the next version carries its
changes. A follower keeps the version it has and then catches up exactly."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fault_proxy import FaultProxy

from deltasync import DeltaPublisher, DeltaReceiver, StoreError, bf16_state_dict, fingerprint
from deltasync.stores import FsspecStore, Store


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(64, 64, generator=gen).to(torch.bfloat16))


def step(model: Tiny, i: int) -> None:
    with torch.no_grad():
        model.w.view(-1)[i * 7 % 4096 : i * 7 % 4096 + 50] += 1.0


@pytest.fixture(scope="module")
def proxy(s3_server: Any) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.endpoint) as running:
        yield running


@pytest.fixture
def buckets(s3_server: Any, proxy: FaultProxy) -> Iterator[tuple[Store, Store]]:
    """The same bucket twice: through the faulty proxy, and straight to the server (to check)."""
    proxy.clear()
    url = s3_server.url(uuid.uuid4().hex)
    yield FsspecStore(url, **s3_server.storage_options(proxy.endpoint)), FsspecStore(url, **s3_server.storage_options())
    proxy.clear()


def snapshot(store: Store) -> dict[str, bytes]:
    return {path: store.read_bytes(path) for path in store.list()}


def synced(store: Store, model: Tiny) -> None:
    receiver = DeltaReceiver(store)
    receiver.sync()
    assert receiver.fingerprint == fingerprint(bf16_state_dict(model))
    assert receiver.verify()


@pytest.mark.parametrize(
    ("kind", "method", "path"),
    [
        ("503", "PUT", "deltas/"), ("500", "PUT", "latest.json"), ("reset", "PUT", "deltas/"),
        ("lost", "PUT", "latest.json"), ("slow", None, ""), ("truncate", "GET", "latest.json"),
    ],
)  # fmt: skip
def test_the_publisher_rides_through_a_fault_that_clears(buckets: tuple[Store, Store], proxy: FaultProxy, kind: str,
                                                          method: str | None, path: str) -> None:  # fmt: skip
    faulty, direct = buckets
    model = Tiny()
    with DeltaPublisher(faulty, model, None, anchor_bytes_ratio=0) as publisher:
        publisher.publish()
        proxy.add(kind, method, path, count=2, delay=0.3)
        step(model, 1)
        result = publisher.publish()
        assert result.version == 1 and result.kind == "delta"
    assert proxy.injected[kind] >= 1
    proxy.clear()
    synced(direct, model)  # every file the pointer names is whole: sizes and SHA-256 checked
    synced(faulty, model)


def test_a_fault_that_does_not_clear_fails_the_version_and_changes_nothing(s3_server: Any, proxy: FaultProxy) -> None:
    url = s3_server.url(uuid.uuid4().hex)
    direct = FsspecStore(url, **s3_server.storage_options())
    # A small retry budget, so that the test does not wait out the default one (about 45 s).
    faulty = FsspecStore(url, **s3_server.storage_options(proxy.endpoint),
                         config_kwargs={"retries": {"max_attempts": 2, "mode": "standard"}})  # fmt: skip
    faulty.fs.retries = 1  # s3fs's own retries (a class attribute, 5)
    model = Tiny()
    with DeltaPublisher(faulty, model, None, anchor_bytes_ratio=0) as publisher:
        publisher.publish()
        before = snapshot(direct)
        proxy.add("503", "PUT", "deltas/", count=-1)
        step(model, 1)
        with pytest.raises(StoreError) as caught:
            publisher.publish()
        assert f"cannot write 'deltas/00000001.safetensors' to bucket {url}" in str(caught.value)
        assert "reduce your request rate" in str(caught.value)
        assert snapshot(direct) == before  # nothing committed, nothing half written
        receiver = DeltaReceiver(direct)
        assert receiver.sync() == 0 and receiver.verify()
        proxy.clear()
        step(model, 2)
        result = publisher.publish()  # carries the changes of the version that failed
        assert result.version == 1
    synced(direct, model)
    proxy.clear()


def test_a_follower_keeps_its_version_through_faults_then_catches_up(buckets: tuple[Store, Store],
                                                                      proxy: FaultProxy) -> None:  # fmt: skip
    faulty, direct = buckets
    model = Tiny()
    with DeltaPublisher(direct, model, None, anchor_bytes_ratio=0) as publisher:
        publisher.publish()
        store = FsspecStore(faulty.url, **{**faulty.fs.storage_options, "config_kwargs": {"retries": {"max_attempts": 1}}})
        store.fs.retries = 1
        follower = DeltaReceiver(store)
        assert follower.sync() == 0
        served = follower.fingerprint
        step(model, 1)
        publisher.publish()
        proxy.add("500", "GET", "deltas/", count=-1)
        with pytest.raises(StoreError, match=f"bucket {faulty.url}"):
            follower.sync()
        assert (follower.version, follower.fingerprint) == (0, served)
        proxy.clear()
        step(model, 2)
        publisher.publish()
        assert follower.sync() == 2
        assert follower.fingerprint == fingerprint(bf16_state_dict(model))


def test_the_watch_reads_an_s3_pointer_with_one_conditional_get_and_a_receiver_reads_it_no_more(buckets, proxy):
    from deltasync.reader import PointerWatch

    faulty, _ = buckets
    model = Tiny()
    with DeltaPublisher(faulty, model, None) as publisher:
        publisher.publish()
        watch, receiver = PointerWatch(faulty), DeltaReceiver(faulty)
        proxy.take_log()
        assert watch.read().version == 0 and watch.read().version == 0
        reads = [(method, path) for method, path, *_ in proxy.take_log()]
        # One GET each: the second sent If-None-Match and was answered 304, with no body.
        assert reads == [("GET", reads[0][1])] * 2 and reads[0][1].endswith("/latest.json")
        assert (watch.full_reads, watch.tag_reads) == (1, 1)
        step(model, 1)
        publisher.publish()
        pointer = watch.read()
        assert pointer.version == 1 and watch.full_reads == 2
        receiver.offer_pointer(watch.data)  # what a follower hands its workers
        proxy.take_log()
        receiver.sync(pointer.version)
        assert not [path for _, path, *_ in proxy.take_log() if path.endswith("/latest.json")]
    assert receiver.fingerprint == fingerprint(bf16_state_dict(model))
