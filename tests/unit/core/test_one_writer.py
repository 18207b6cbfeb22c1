"""One writer per bucket, enforced: a second publisher is refused before it writes a byte, a
takeover is explicit, a writer whose pointer changed under it stops, and every refusal leaves
the committed chain readable end to end. On every store that can enforce it (a local folder,
memory://, a real S3-protocol server through s3fs) and on the mocked Hub, whose API has no
precondition (checked by reading, said at the start)."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import time
import uuid
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher, DeltaReceiver, FormatError, WriterConflictError, open_store
from deltasync.cli import main as cli_main
from deltasync.format import CLAIM_PATH, POINTER_PATH, Pointer
from deltasync.stores import HfBucketStore, Store

SHAPES = {"w": (8, 16), "b": (16,)}


class Tiny(torch.nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(SHAPES["w"], generator=gen).to(torch.bfloat16))
        self.b = torch.nn.Parameter(torch.randn(SHAPES["b"], generator=gen).to(torch.bfloat16))


def step(model: Tiny, i: int) -> None:
    with torch.no_grad():
        model.w.view(-1)[i % 128] += 1.0


def _fake_hf():
    spec = importlib.util.spec_from_file_location("fake_hf", Path(__file__).parents[1] / "stores" / "fake_hf.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["local", "memory", "s3", "hf"])
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return open_store(tmp_path / "bucket")
    if request.param == "memory":
        return open_store(f"memory://one-writer-{uuid.uuid4().hex}")
    if request.param == "s3":
        return open_store(request.getfixturevalue("s3_server").url())
    fake = _fake_hf()
    return HfBucketStore(fake.BUCKET_ID, "runs/one-writer", api=fake.FakeBucketApi(buckets=[fake.BUCKET_ID]))


def snapshot(store: Store) -> dict[str, bytes]:
    return {path: store.read_bytes(path) for path in store.list()}


def readable_end_to_end(store: Store, version: int, fingerprint: str | None) -> None:
    """A fresh receiver syncs the committed chain, and every file of it checks out."""
    receiver = DeltaReceiver(store)
    assert receiver.sync() == version
    assert receiver.fingerprint == fingerprint
    assert receiver.verify()
    if not isinstance(store, HfBucketStore):  # the mocked Hub lives in this test only, not at a URL
        assert cli_main(["verify", store.url]) == 0


def test_a_second_writer_is_refused_before_it_writes_a_byte(bucket: Store) -> None:
    first_model = Tiny()
    first = DeltaPublisher(bucket, first_model, None)
    first.publish()
    step(first_model, 0)
    first.publish()
    first.flush()  # the background anchor too
    before = snapshot(bucket)
    with pytest.raises(WriterConflictError) as caught:
        DeltaPublisher(bucket, Tiny(seed=1), None)
    message = str(caught.value)
    assert f"bucket {bucket.url} is held by another writer (host {socket.gethostname()!r}, process {os.getpid()}, started " in message
    assert "its last commit: version 1 at " in message
    assert "This publisher wrote nothing" in message and "take_over=True" in message
    assert snapshot(bucket) == before
    readable_end_to_end(bucket, 1, first.fingerprint)
    step(first_model, 1)
    assert first.publish().version == 2  # the first writer goes on, untroubled
    first.flush()
    readable_end_to_end(bucket, 2, first.fingerprint)
    first.close()


def test_take_over_skips_a_version_and_the_old_writer_stops(bucket: Store) -> None:
    old_model = Tiny()
    old = DeltaPublisher(bucket, old_model, None)
    old.publish()
    step(old_model, 0)
    old.publish()
    old.flush()
    new = DeltaPublisher(bucket, Tiny(seed=1), None, take_over=True)
    first = new.publish()
    assert (first.version, first.kind) == (3, "anchor")  # version 2 stays unused: no number is reused
    new.flush()
    committed = snapshot(bucket)
    step(old_model, 1)
    with pytest.raises(WriterConflictError) as caught:
        old.publish()
    message = str(caught.value)
    assert f"the pointer {bucket.url}/latest.json changed under this writer" in message
    assert "it now names version 3, committed at " in message
    assert f" by host {socket.gethostname()!r}, process {os.getpid()}, started " in message
    assert "this publisher stops and writes nothing more" in message
    assert snapshot(bucket) == committed  # the stale writer changed nothing
    with pytest.raises(WriterConflictError):
        old.publish()  # and it stays stopped
    # Its retention (after an anchor) deletes nothing: the pointer is another writer's now.
    warnings = old._retention.housekeep(1)
    assert len(warnings) == 1 and "is no longer this writer's; nothing deleted" in warnings[0]
    assert snapshot(bucket) == committed
    readable_end_to_end(bucket, 3, new.fingerprint)
    assert new.publish().version == 4
    new.flush()
    readable_end_to_end(bucket, 4, new.fingerprint)
    history = [json.loads(line) for line in bucket.read_bytes("history.jsonl").decode().splitlines()]
    writers = {r["version"]: r["writer"]["token"] for r in history}
    assert writers[0] == writers[1] != writers[3] == writers[4]
    assert Pointer.from_bytes(bucket.read_bytes(POINTER_PATH)).writer.token == writers[4]  # type: ignore[union-attr]


def test_a_pointer_changed_under_a_writer_stops_it(bucket: Store) -> None:
    model = Tiny()
    publisher = DeltaPublisher(bucket, model, None)
    publisher.publish()
    publisher.flush()
    # Someone else commits a pointer (here: the same chain, rewritten by another tool).
    foreign = Pointer.from_bytes(bucket.read_bytes(POINTER_PATH))
    bucket.write_bytes(POINTER_PATH, foreign.to_bytes().replace(b'"lease_ms": ', b'"lease_ms": 1'))
    before = snapshot(bucket)
    step(model, 0)
    with pytest.raises(WriterConflictError, match="changed under this writer .* while writing delta 1"):
        publisher.publish()
    assert snapshot(bucket) == before  # refused before its delta was written
    readable_end_to_end(bucket, 0, foreign.fingerprint)


def test_a_closed_writer_lets_go_and_the_next_goes_on_at_once(bucket: Store) -> None:
    model = Tiny()
    with DeltaPublisher(bucket, model, None) as first:
        first.publish()
    pointer = Pointer.from_bytes(bucket.read_bytes(POINTER_PATH))
    assert pointer.writer is not None and pointer.writer.lease_ms == 0
    step(model, 0)
    with DeltaPublisher(bucket, model, None) as second:
        assert second.publish().version == 1  # no version skipped: the first let go
    readable_end_to_end(bucket, 1, second.fingerprint)


def test_after_the_lease_another_writer_takes_over(bucket: Store, caplog: pytest.LogCaptureFixture) -> None:
    old = DeltaPublisher(bucket, Tiny(), None, lease_seconds=0.2)
    old.publish()
    time.sleep(0.3)
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        new = DeltaPublisher(bucket, Tiny(seed=1), None)
    assert "taking bucket" in caplog.text and "its lease ended" in caplog.text
    assert new.publish().version == 2
    new.flush()
    with pytest.raises(WriterConflictError):
        old.publish()
    readable_end_to_end(bucket, 2, new.fingerprint)


def test_each_store_says_whether_it_enforces_the_rule(bucket: Store, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        DeltaPublisher(bucket, Tiny(), None).close()
    warned = "cannot write conditionally" in caplog.text
    assert warned == isinstance(bucket, HfBucketStore)  # the Hub's bucket API has no precondition


def test_verify_reports_two_writers_for_one_version(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = Tiny()
    with DeltaPublisher(tmp_path, model, None) as publisher:
        publisher.publish()
        step(model, 0)
        publisher.publish()
    assert cli_main(["verify", str(tmp_path)]) == 0
    lines = (tmp_path / "history.jsonl").read_text().splitlines()
    other = json.loads(lines[1])
    other["writer"] = {"host": "elsewhere", "pid": 7, "token": "f" * 32}
    other["fingerprint"] = "0" * 16
    (tmp_path / "history.jsonl").write_text("\n".join([*lines, json.dumps(other, sort_keys=True)]) + "\n")
    capsys.readouterr()
    assert cli_main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "history.jsonl names two writers for version 1" in err
    assert "host 'elsewhere', process 7" in err


def test_the_writer_record_round_trips_and_is_checked(tmp_path: Path) -> None:
    model = Tiny()
    with DeltaPublisher(tmp_path, model, None) as publisher:
        publisher.publish()
        written = publisher.pointer
    data = (tmp_path / POINTER_PATH).read_bytes()
    pointer = Pointer.from_bytes(data)
    assert pointer.writer is not None and written is not None and written.writer is not None
    assert pointer.writer.token == written.writer.token and len(pointer.writer.token) == 32
    assert (pointer.writer.host, pointer.writer.pid, pointer.writer.lease_ms) == (socket.gethostname(), os.getpid(), 0)
    assert Pointer.from_bytes(pointer.to_bytes()) == pointer
    body = json.loads(data)
    for key, value, message in [
        ("token", "XYZ", "writer.token must be 32 lower-case hex digits"),
        ("host", "", "writer.host must be a string of 1 to 255 characters"),
        ("pid", -1, "writer.pid"),
        ("lease_ms", True, "writer.lease_ms"),
    ]:
        bad = {**body, "writer": {**body["writer"], key: value}}
        with pytest.raises(FormatError, match=message):
            Pointer.from_bytes(json.dumps(bad).encode())
    with pytest.raises(FormatError, match="writer must be an object"):
        Pointer.from_bytes(json.dumps({**body, "writer": [1]}).encode())
    # A pointer without the record (a writer before it) reads as one with no writer.
    del body["writer"]
    assert Pointer.from_bytes(json.dumps(body).encode()).writer is None


def test_a_pointer_restored_with_its_own_bytes_is_still_the_writers(bucket: Store) -> None:
    # A bucket put back from a copy (the hostile-bucket tests do it): the same bytes, a new file.
    model = Tiny()
    with DeltaPublisher(bucket, model, None) as publisher:
        publisher.publish()
        publisher.flush()
        bucket.write_bytes(POINTER_PATH, bucket.read_bytes(POINTER_PATH))
        step(model, 0)
        assert publisher.publish().version == 1
        publisher.flush()
        bucket.write_bytes(POINTER_PATH, bucket.read_bytes(POINTER_PATH))
        step(model, 1)
        assert publisher.publish().version == 2
        publisher.flush()
    readable_end_to_end(bucket, 2, publisher.fingerprint)


# ---------------------------------------------------------------- an empty bucket's claim


def _claim(bucket: Store) -> dict:
    return json.loads(bucket.read_bytes(CLAIM_PATH))["writer"]


def test_two_writers_on_an_empty_bucket_the_second_is_refused_before_it_writes_a_byte(bucket: Store) -> None:
    first_model = Tiny()
    first = DeltaPublisher(bucket, first_model, None)
    assert bucket.list() == [CLAIM_PATH]  # claimed before a byte of data
    assert _claim(bucket)["pid"] == os.getpid() and _claim(bucket)["lease_ms"] > 0
    before = snapshot(bucket)
    with pytest.raises(WriterConflictError) as caught:
        DeltaPublisher(bucket, Tiny(seed=1), None)
    message = str(caught.value)
    assert f"bucket {bucket.url} is held by another writer (host {socket.gethostname()!r}, process {os.getpid()}" in message
    assert "it claimed the empty bucket at " in message and "has committed nothing yet" in message
    assert "This publisher wrote nothing" in message
    assert snapshot(bucket) == before
    assert first.publish().version == 0
    first.flush()
    assert CLAIM_PATH not in bucket.list()  # the pointer names the writer now
    step(first_model, 0)
    assert first.publish().version == 1
    first.flush()
    readable_end_to_end(bucket, 1, first.fingerprint)
    first.close()


def test_a_writer_that_read_no_pointer_before_another_committed_is_refused(bucket: Store) -> None:
    """The other order: the second writer read no pointer, then the first claimed, committed and
    deleted its claim; the second's claim then succeeds, and its read of the pointer after it
    finds the first's chain: refused, and its claim deleted."""
    from deltasync.trainer.ownership import ChainOwnership

    late = ChainOwnership(bucket, lease_s=60, take_over=False)
    assert late.read() is None
    model = Tiny()
    first = DeltaPublisher(bucket, model, None)
    first.publish()
    first.flush()
    before = snapshot(bucket)
    with pytest.raises(WriterConflictError, match="is held by another writer .* its last commit: version 0"):
        late.claim(None)
    assert snapshot(bucket) == before  # its claim came and went
    step(model, 0)
    assert first.publish().version == 1
    first.flush()
    readable_end_to_end(bucket, 1, first.fingerprint)
    first.close()


@pytest.mark.parametrize("bucket", ["local", "memory", "s3"], indirect=True)  # the Hub's API has no precondition
def test_two_writers_starting_at_once_on_an_empty_bucket_one_writes(bucket: Store) -> None:
    import threading

    barrier = threading.Barrier(2)
    outcome: dict[int, object] = {}

    def start(seed: int) -> None:
        barrier.wait()
        try:
            outcome[seed] = DeltaPublisher(bucket, Tiny(seed=seed), None)
        except WriterConflictError as exc:
            outcome[seed] = exc

    threads = [threading.Thread(target=start, args=(seed,)) for seed in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [o for o in outcome.values() if isinstance(o, WriterConflictError)]
    (winner,) = [o for o in outcome.values() if isinstance(o, DeltaPublisher)]
    assert len(refused) == 1 and "wrote nothing" in str(refused[0])
    assert winner.publish().version == 0
    winner.flush()
    readable_end_to_end(bucket, 0, winner.fingerprint)
    winner.close()


def test_a_claim_whose_writer_is_gone_is_taken(bucket: Store, caplog: pytest.LogCaptureFixture) -> None:
    # Closed before its first commit: it let go of its claim.
    DeltaPublisher(bucket, Tiny(), None).close()
    assert bucket.list() == []
    # A claim whose process is gone (this host), and one that cannot be read: taken, version 0.
    gone = json.loads(json.dumps({"writer": {
        "host": socket.gethostname(), "pid": 2**22 + 17, "started_ms": 1, "token": "0" * 32,
        "committed_ms": int(time.time() * 1000), "lease_ms": 600_000}}))  # fmt: skip
    for data in (json.dumps(gone).encode(), b"{not json"):
        bucket.write_bytes(CLAIM_PATH, data)
        with DeltaPublisher(bucket, Tiny(), None) as publisher:
            assert _claim(bucket)["pid"] == os.getpid()
        assert bucket.list() == []
    # Another host's claim whose lease ended: taken, and version 0 left to it (it may still be writing).
    gone["writer"].update(host="elsewhere", committed_ms=1)
    bucket.write_bytes(CLAIM_PATH, json.dumps(gone).encode())
    with caplog.at_level(logging.WARNING, logger="deltasync"):
        publisher = DeltaPublisher(bucket, Tiny(), None)
    assert "taking the claim of empty bucket" in caplog.text and "its lease ended" in caplog.text
    first = publisher.publish()
    assert (first.version, first.kind) == (1, "anchor")
    publisher.flush()
    assert CLAIM_PATH not in bucket.list()
    readable_end_to_end(bucket, 1, publisher.fingerprint)
    publisher.close()


def test_take_over_takes_a_live_claim_and_the_claimant_stops(bucket: Store) -> None:
    claimant = DeltaPublisher(bucket, Tiny(), None)
    new = DeltaPublisher(bucket, Tiny(seed=1), None, take_over=True)
    assert (new.publish().version, _claim_gone(bucket)) == (1, True)
    new.flush()
    committed = snapshot(bucket)
    with pytest.raises(WriterConflictError):
        claimant.publish()  # its first commit is refused: the pointer exists now
    assert snapshot(bucket) == committed  # refused before its anchor of version 0 was written
    readable_end_to_end(bucket, 1, new.fingerprint)
    new.close()


def _claim_gone(bucket: Store) -> bool:
    return CLAIM_PATH not in bucket.list()
