"""The store round trip against the real Hub, which the fake can only imitate.

Opt-in: set ``HF_TOKEN`` and ``DELTASYNC_TEST_BUCKET`` (e.g. ``hf://buckets/me/deltasync-test``,
a bucket the token may write) and run ``pytest -m live``. Everything happens under a fresh
``deltasync-test-<uuid>/`` prefix inside that bucket, and is deleted afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from deltasync.errors import NotFoundError
from deltasync.stores import HfBucketStore, open_store

pytestmark = pytest.mark.live

_MISSING = [name for name in ("HF_TOKEN", "DELTASYNC_TEST_BUCKET") if not os.environ.get(name)]


@pytest.fixture
def live_store() -> Iterator[HfBucketStore]:
    if _MISSING:
        pytest.skip(f"live Hub test: set {' and '.join(_MISSING)} to run it")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        pytest.skip("live Hub test: HF_HUB_OFFLINE is set")
    base = open_store(os.environ["DELTASYNC_TEST_BUCKET"])
    if not isinstance(base, HfBucketStore):
        pytest.fail(
            f"DELTASYNC_TEST_BUCKET={base.url!r} is not a Hub bucket; "
            "use hf://buckets/<namespace>/<name>"
        )
    prefix = "/".join(p for p in (base.prefix, f"deltasync-test-{uuid.uuid4().hex[:12]}") if p)
    store = HfBucketStore(base.bucket_id, prefix, token=os.environ["HF_TOKEN"])
    try:
        yield store
    finally:
        store.delete(store.list())


def test_live_round_trip(live_store: HfBucketStore) -> None:
    store = live_store
    big = os.urandom(5 * 1024 * 1024)
    assert store.list() == []

    store.write_bytes("anchors/00000000.safetensors", big)
    store.write_bytes("deltas/00000001.safetensors", b"")
    store.write_bytes("latest.json", b'{"version": 0}')
    assert store.read_bytes("anchors/00000000.safetensors") == big
    assert store.read_bytes("deltas/00000001.safetensors") == b""

    store.write_bytes("latest.json", b'{"version": 1}')
    assert store.read_bytes("latest.json") == b'{"version": 1}'

    assert store.exists("latest.json")
    assert not store.exists("anchors")
    assert store.list() == [
        "anchors/00000000.safetensors",
        "deltas/00000001.safetensors",
        "latest.json",
    ]
    assert store.list("deltas/") == ["deltas/00000001.safetensors"]
    assert store.list("lat") == ["latest.json"]

    with pytest.raises(NotFoundError, match=r"'deltas/00000002\.safetensors'"):
        store.read_bytes("deltas/00000002.safetensors")

    store.delete(["deltas/00000001.safetensors", "deltas/00000009.safetensors"])
    assert not store.exists("deltas/00000001.safetensors")
    assert store.list("deltas/") == []
