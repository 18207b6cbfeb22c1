"""One ``store`` fixture over every backend, so each conformance test runs against all."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_hf import BUCKET_ID, FakeBucketApi

from deltasync.stores import FsspecStore, HfBucketStore, LocalStore, Store

HF_PREFIX = "runs/r1"


@pytest.fixture(params=["local", "memory", "fsspec-file", "hf", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A fresh, empty store, with files just outside its root that it must never see."""
    if request.param == "local":
        (tmp_path / "bucket-sibling").mkdir()
        (tmp_path / "bucket-sibling" / "decoy").write_bytes(b"decoy")
        (tmp_path / "decoy.json").write_bytes(b"decoy")
        yield LocalStore(tmp_path / "bucket")
    elif request.param == "memory":
        # memory:// is one process-wide filesystem: a unique root per test, removed after.
        root = f"memory://deltasync-test-{uuid.uuid4().hex}"
        decoy = FsspecStore(root + "-sibling")
        decoy.write_bytes("decoy", b"decoy")
        store = FsspecStore(root)
        yield store
        for leftover in (store, decoy):
            if leftover.fs.exists(leftover._root):
                leftover.fs.rm(leftover._root, recursive=True)
    elif request.param == "s3":
        # A real S3-protocol server (moto's, one per session), through s3fs: a prefix per test.
        server = request.getfixturevalue("s3_server")
        name = uuid.uuid4().hex
        FsspecStore(server.url(name + "-sibling")).write_bytes("decoy", b"decoy")
        yield FsspecStore(server.url(name))
    elif request.param == "fsspec-file":
        # A directory-based fsspec backend: parents must be created, paths come back absolute.
        (tmp_path / "bucket-sibling").mkdir()
        (tmp_path / "bucket-sibling" / "decoy").write_bytes(b"decoy")
        yield FsspecStore((tmp_path / "bucket").as_uri())
    else:
        api = FakeBucketApi(buckets=[BUCKET_ID])
        decoy = HfBucketStore(BUCKET_ID, api=api)
        for path in (f"{HF_PREFIX}0/decoy", f"{HF_PREFIX}.json", "latest.json"):
            decoy.write_bytes(path, b"decoy")
        yield HfBucketStore(BUCKET_ID, HF_PREFIX, api=api)


@pytest.fixture
def fake_api() -> FakeBucketApi:
    """A fake Hub that holds one empty bucket, ``fake_hf.BUCKET_ID``."""
    return FakeBucketApi(buckets=[BUCKET_ID])
