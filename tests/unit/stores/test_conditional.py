"""Conditional writes (create-if-absent, replace-if-unchanged), the primitive that makes one
writer per bucket enforceable, checked on every backend of the ``store`` fixture: a local
folder, memory://, a real S3-protocol server through s3fs, a directory-based fsspec backend
and the (mocked) Hub, the last two without a guarantee (read, compare, write)."""

from __future__ import annotations

import threading

import pytest

from deltasync import ConflictError, WriterConflictError
from deltasync.stores import LocalStore, Store, TaggedFile, conditional_guarantee, read_tagged, write_if

ATOMIC = {"LocalStore", "memory", "s3"}


def _kind(store: Store) -> str:
    if isinstance(store, LocalStore):
        return "LocalStore"
    return store.url.split("://")[0] if "://" in store.url else type(store).__name__


def test_each_backend_says_what_enforces_its_conditional_writes(store: Store) -> None:
    guarantee = conditional_guarantee(store)
    if _kind(store) in ATOMIC:
        assert guarantee
    else:
        assert guarantee is None  # the Hub's API has no precondition; fsspec's file:// neither


def test_create_if_absent(store: Store) -> None:
    tag = write_if(store, "latest.json", b"first", None, limit=100)
    assert read_tagged(store, "latest.json", 100) == (b"first", tag)
    with pytest.raises(ConflictError) as caught:
        write_if(store, "latest.json", b"second", None, limit=100)
    assert str(caught.value) == (
        f"conditional write of 'latest.json' to bucket {store.url} refused: it exists already, and this "
        "write was to create it; nothing was written"
    )
    assert store.read_bytes("latest.json") == b"first"


def test_replace_if_unchanged(store: Store) -> None:
    first = write_if(store, "views/A/latest.json", b"one", None, limit=100)
    second = write_if(store, "views/A/latest.json", b"two", first, limit=100)
    assert second != first
    assert read_tagged(store, "views/A/latest.json", 100) == (b"two", second)
    with pytest.raises(ConflictError, match="it changed since this writer last read or wrote it"):
        write_if(store, "views/A/latest.json", b"stale", first, limit=100)
    assert store.read_bytes("views/A/latest.json") == b"two"


def test_a_plain_write_by_someone_else_changes_the_tag(store: Store) -> None:
    tag = write_if(store, "latest.json", b"mine", None, limit=100)
    store.write_bytes("latest.json", b"theirs")
    assert read_tagged(store, "latest.json", 100)[1] != tag
    with pytest.raises(ConflictError):
        write_if(store, "latest.json", b"mine again", tag, limit=100)
    assert store.read_bytes("latest.json") == b"theirs"


def test_a_deleted_file_is_a_conflict(store: Store) -> None:
    tag = write_if(store, "latest.json", b"mine", None, limit=100)
    store.delete(["latest.json"])
    with pytest.raises(ConflictError, match="it was deleted since"):
        write_if(store, "latest.json", b"mine again", tag, limit=100)
    assert not store.exists("latest.json")


def test_read_tagged_of_a_missing_file_is_not_found(store: Store) -> None:
    with pytest.raises(FileNotFoundError, match="'latest.json' is not in bucket"):
        read_tagged(store, "latest.json", 100)


def test_read_tagged_reads_at_most_limit_plus_one_bytes(store: Store) -> None:
    store.write_bytes("latest.json", bytes(range(50)))
    data, tag = read_tagged(store, "latest.json", 9)
    assert data == bytes(range(10))
    assert read_tagged(store, "latest.json", 9)[1] == tag
    assert read_tagged(store, "latest.json", 100)[0] == bytes(range(50))


def test_of_racing_writers_exactly_one_wins(store: Store) -> None:
    if _kind(store) not in ATOMIC:
        pytest.skip("no guarantee: racing writers may both land (said at the writer's start)")
    if _kind(store) == "s3":
        # S3 decides a conditional PUT atomically; moto's threaded server checks If-Match, then
        # stores, with no lock between: racing requests would test moto, not deltasync.
        pytest.skip("moto's conditional PUT is not atomic under concurrent requests (S3's is)")
    base = write_if(store, "latest.json", b"base", None, limit=100)
    won: list[bytes] = []
    lost: list[bytes] = []
    start = threading.Barrier(6)

    def writer(n: int) -> None:
        data = f"writer {n}".encode()
        start.wait()
        try:
            write_if(store, "latest.json", data, base, limit=100)
            won.append(data)
        except ConflictError:
            lost.append(data)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 5
    assert store.read_bytes("latest.json") == won[0]


def test_local_lock_files_are_hidden(tmp_path) -> None:
    store = LocalStore(tmp_path)
    write_if(store, "views/A/latest.json", b"x", None, limit=10)
    assert (tmp_path / "views" / "A" / ".latest.json.lock").exists()
    assert store.list() == ["views/A/latest.json"]


def test_a_tagged_file_is_its_writers_until_it_changes_under_it(store: Store) -> None:
    """The one writer's file (a chain's pointer): its own bytes written again stay its own; any
    other change stops the writer for good, in its own words, and nothing more is written."""
    reasons: list[tuple[str, bool]] = []

    def changed(what: str, error: Exception | None) -> str:
        reasons.append((what, error is not None))
        return f"changed while {what}"

    file = TaggedFile(store, "latest.json", limit=100, changed=changed)
    assert not file.known and file.still_ours("checking")  # nothing read yet: nothing to compare
    store.write_bytes("latest.json", b"found")
    assert file.read() == b"found" and file.known
    file.write(b"one", what="committing 1")
    store.write_bytes("latest.json", b"one")  # the same bytes, a new file (a bucket restored from a copy)
    assert file.still_ours("checking")
    file.write(b"two", what="committing 2")
    store.write_bytes("latest.json", b"two")
    file.write(b"three", what="committing 3")  # refused once, then written on the tag of its own bytes
    assert store.read_bytes("latest.json") == b"three" and not reasons
    store.write_bytes("latest.json", b"theirs")
    with pytest.raises(WriterConflictError, match="changed while committing 4"):
        file.write(b"four", what="committing 4")
    assert reasons == [("committing 4", True)] and file.stopped == "changed while committing 4"
    assert not file.still_ours("checking")
    with pytest.raises(WriterConflictError, match="changed while committing 4"):
        file.write(b"five", what="committing 5")  # it stays stopped
    assert store.read_bytes("latest.json") == b"theirs"
    other = TaggedFile(store, "latest.json", limit=100, changed=changed)
    other.read()
    store.write_bytes("latest.json", b"someone else")
    assert not other.still_ours("writing delta 9") and other.stopped == "changed while writing delta 9"
    assert reasons[-1] == ("writing delta 9", False)
