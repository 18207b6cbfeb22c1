"""The Store contract, checked once for every backend (the ``store`` fixture), plus
``open_store`` dispatch and the few behaviours that belong to one backend."""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
from pathlib import Path

import pytest
from fake_hf import BUCKET_ID, USED_METHODS, FakeBucketApi
from helpers import FiveMethodStore
from huggingface_hub import HfApi

from deltasync.errors import ConfigError, NotFoundError, StoreError
from deltasync.stores import (
    BoundedReadStore,
    FsspecStore,
    HfBucketStore,
    LocalStore,
    Store,
    StreamingStore,
    TempCleaningStore,
    open_store,
    read_buffer,
    read_limited,
    write_pieces,
    write_stream,
)

BIG = os.urandom(5 * 1024 * 1024)

# -- the contract ---------------------------------------------------------------------------


def test_is_a_store_with_a_url(store: Store) -> None:
    assert isinstance(store, Store)
    assert isinstance(store.url, str) and "://" in store.url
    assert open_store(store) is store


@pytest.mark.parametrize("data", [b"", b"hello", BIG], ids=["empty", "small", "5MB"])
def test_round_trip(store: Store, data: bytes) -> None:
    store.write_bytes("anchors/00000000.safetensors", data)
    assert store.read_bytes("anchors/00000000.safetensors") == data


def test_round_trip_at_top_level(store: Store) -> None:
    store.write_bytes("latest.json", b'{"version": 3}')
    assert store.read_bytes("latest.json") == b'{"version": 3}'


def test_overwrite_replaces_all_bytes(store: Store) -> None:
    store.write_bytes("latest.json", b"a much longer first version")
    store.write_bytes("latest.json", b"short")
    assert store.read_bytes("latest.json") == b"short"
    assert store.list() == ["latest.json"]


def test_read_missing_names_path_and_bucket(store: Store) -> None:
    with pytest.raises(NotFoundError) as info:
        store.read_bytes("deltas/00000007.safetensors")
    assert "'deltas/00000007.safetensors'" in str(info.value)
    assert store.url in str(info.value)
    assert isinstance(info.value, FileNotFoundError)  # callers may catch the builtin


def test_read_of_a_directory_is_not_found(store: Store) -> None:
    store.write_bytes("anchors/00000000.safetensors", b"x")
    with pytest.raises(NotFoundError, match="'anchors'"):
        store.read_bytes("anchors")


def test_exists(store: Store) -> None:
    assert not store.exists("latest.json")
    store.write_bytes("latest.json", b"")
    store.write_bytes("anchors/00000000.safetensors", b"x")
    assert store.exists("latest.json")
    assert store.exists("anchors/00000000.safetensors")
    assert not store.exists("anchors")  # a directory is not a file
    assert not store.exists("latest")


def test_list_is_sorted_recursive_and_filtered_by_prefix(store: Store) -> None:
    files = [
        "latest.json",
        "deltas/00000002.safetensors",
        "anchors/00000000.safetensors",
        "deltas/00000001.safetensors",
        "deltas/00000010.safetensors",
        "parts/00000002/rank-1.safetensors",
        "parts/00000002/rank-0.safetensors",
    ]
    for path in files:
        store.write_bytes(path, path.encode())
    assert store.list() == sorted(files)
    assert store.list("") == sorted(files)
    assert store.list("deltas/") == [
        "deltas/00000001.safetensors",
        "deltas/00000002.safetensors",
        "deltas/00000010.safetensors",
    ]
    assert store.list("deltas/0000000") == [
        "deltas/00000001.safetensors",
        "deltas/00000002.safetensors",
    ]
    assert store.list("parts") == [
        "parts/00000002/rank-0.safetensors",
        "parts/00000002/rank-1.safetensors",
    ]
    assert store.list("lat") == ["latest.json"]
    assert store.list("nothing/") == []
    assert store.list("latest.json/") == []


def test_list_of_empty_bucket_sees_nothing_outside_its_root(store: Store) -> None:
    assert store.list() == []
    assert store.list("anchors/") == []


def test_delete(store: Store) -> None:
    for path in ("latest.json", "deltas/00000001.safetensors", "deltas/00000002.safetensors"):
        store.write_bytes(path, b"x")
    store.delete(["deltas/00000001.safetensors", "latest.json"])
    assert store.list() == ["deltas/00000002.safetensors"]
    assert not store.exists("latest.json")
    with pytest.raises(NotFoundError):
        store.read_bytes("latest.json")


def test_delete_of_missing_files_is_not_an_error(store: Store) -> None:
    store.write_bytes("deltas/00000002.safetensors", b"x")
    store.delete([])
    store.delete(["deltas/00000009.safetensors"])
    store.delete(path for path in ["nope/a", "deltas/00000002.safetensors", "nope/b"])
    assert store.list() == []


def test_write_after_delete(store: Store) -> None:
    store.write_bytes("latest.json", b"1")
    store.delete(["latest.json"])
    store.write_bytes("latest.json", b"2")
    assert store.read_bytes("latest.json") == b"2"


BAD_PATHS = ["", "/abs/x", "../x", "a/../b", "a//b", "a/", "a\\b", "./a", "a/./b", ".."]


@pytest.mark.parametrize("path", BAD_PATHS)
def test_bad_paths_are_config_errors_naming_the_path(store: Store, path: str) -> None:
    store.write_bytes("keep", b"kept")
    operations = {
        "read_bytes": lambda: store.read_bytes(path),
        "write_bytes": lambda: store.write_bytes(path, b"x"),
        "exists": lambda: store.exists(path),
        "delete": lambda: store.delete(["keep", path]),
    }
    for name, operation in operations.items():
        with pytest.raises(ConfigError) as info:
            operation()
        assert repr(path) in str(info.value), name
    assert store.list() == ["keep"]  # the delete with a bad path removed nothing


@pytest.mark.parametrize("prefix", ["/abs", "../", "a/../", "a//b", "a\\b", "./"])
def test_bad_list_prefixes_are_config_errors(store: Store, prefix: str) -> None:
    with pytest.raises(ConfigError, match="invalid list prefix"):
        store.list(prefix)


def test_non_str_path_is_a_config_error(store: Store) -> None:
    with pytest.raises(ConfigError, match="must be a str"):
        store.read_bytes(Path("latest.json"))  # type: ignore[arg-type]


# -- open_store -------------------------------------------------------------------------------


def test_open_store_reopens_the_same_bucket_from_its_url(store: Store) -> None:
    store.write_bytes("latest.json", b"1")
    reopened = open_store(store.url)
    expected = LocalStore if store.url.startswith("file://") else type(store)
    assert type(reopened) is expected
    assert reopened.url == store.url
    if not isinstance(store, HfBucketStore):  # the reopened one would talk to the real Hub
        assert reopened.read_bytes("latest.json") == b"1"


def test_open_store_plain_path_is_local_and_lazy(tmp_path: Path) -> None:
    root = tmp_path / "not" / "yet"
    store = open_store(str(root))
    assert isinstance(store, LocalStore)
    assert store.url == root.as_uri()
    assert store.list() == [] and not root.exists()  # created on first write only
    store.write_bytes("a/b", b"x")
    assert (root / "a" / "b").read_bytes() == b"x"


def test_open_store_relative_path_is_made_absolute(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_store("bucket")
    assert store.url == (tmp_path / "bucket").as_uri()


def test_open_store_pathlike_and_file_urls(tmp_path: Path) -> None:
    for bucket in (tmp_path, tmp_path.as_uri(), f"file://localhost{tmp_path}"):
        store = open_store(bucket)
        assert isinstance(store, LocalStore) and store.url == tmp_path.as_uri(), bucket
    spaced = tmp_path / "with space"
    assert open_store(spaced.as_uri()).url == spaced.as_uri()


def test_open_store_hf_buckets() -> None:
    store = open_store("hf://buckets/me/policy-sync")
    assert isinstance(store, HfBucketStore)
    assert (store.bucket_id, store.prefix) == ("me/policy-sync", "")
    assert store.url == "hf://buckets/me/policy-sync"
    store = open_store("hf://buckets/me/policy-sync/runs/r1/")
    assert (store.bucket_id, store.prefix) == ("me/policy-sync", "runs/r1")
    assert store.url == "hf://buckets/me/policy-sync/runs/r1"


def test_open_store_fsspec_urls() -> None:
    store = open_store("memory://deltasync-open-store")
    assert isinstance(store, FsspecStore) and store.url == "memory://deltasync-open-store"


@pytest.mark.parametrize(
    ("bucket", "message"),
    [
        ("hf://datasets/me/data", "names a dataset repo, not a Hugging Face bucket"),
        ("hf://spaces/me/app", "names a Space, not a Hugging Face bucket"),
        ("hf://me/model", "names a model repo, not a Hugging Face bucket"),
        ("hf://buckets/onlyns", "needs both a namespace and a bucket name"),
        ("hf://buckets/", "needs both a namespace and a bucket name"),
        ("hf://buckets/me/b@main", "buckets have no revisions"),
        ("hf://buckets/me/b/../x", "invalid prefix in bucket 'me/b'"),
        ("nosuchscheme://x", "unknown scheme 'nosuchscheme'"),
        ("file://otherhost/x", "names the host 'otherhost'"),
        ("", "bucket is empty"),
    ],
)
def test_open_store_rejects_with_a_fix(bucket: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        open_store(bucket)
    assert message in str(info.value)


def test_open_store_rejects_other_types() -> None:
    with pytest.raises(ConfigError, match="must be a path, a URL or a Store, not int"):
        open_store(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("bucket_id", ["me", "me/b/c", "/b", "me/", "me/b@main"])
def test_hf_store_rejects_bad_bucket_ids(bucket_id: str, fake_api: FakeBucketApi) -> None:
    with pytest.raises(ConfigError, match="must be '<namespace>/<name>'"):
        HfBucketStore(bucket_id, api=fake_api)


# -- LocalStore -------------------------------------------------------------------------------


def test_local_write_interrupted_before_rename_keeps_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalStore(tmp_path)
    store.write_bytes("latest.json", b"old")

    def crash(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(StoreError, match=r"cannot write 'latest\.json' to bucket file://") as info:
        store.write_bytes("latest.json", b"new")
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    assert store.read_bytes("latest.json") == b"old"
    assert store.list() == ["latest.json"]
    assert sorted(os.listdir(tmp_path)) == ["latest.json"]  # the temp file was removed too


def test_local_list_hides_temp_files_of_crashed_writers(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.write_bytes("anchors/00000000.safetensors", b"x")
    (tmp_path / "anchors" / ".00000001.safetensors.4242.0a1b2c3d4e5f.tmp").write_bytes(b"half")
    assert store.list() == ["anchors/00000000.safetensors"]


def test_local_files_are_readable_by_other_users(tmp_path: Path) -> None:
    # Rollout servers may run as another user: files follow the umask, not mkstemp's 0600.
    old = os.umask(0o022)
    try:
        LocalStore(tmp_path).write_bytes("latest.json", b"1")
    finally:
        os.umask(old)
    assert (tmp_path / "latest.json").stat().st_mode & 0o777 == 0o644


def test_local_readers_never_see_a_partial_file(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    versions = [bytes([i]) * (256 * 1024) for i in range(2)]
    store.write_bytes("latest.json", versions[0])
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            store.write_bytes("latest.json", versions[i % 2])

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        for _ in range(200):
            assert store.read_bytes("latest.json") in versions
    finally:
        stop.set()
        thread.join()
    assert store.list() == ["latest.json"]


# -- HfBucketStore ----------------------------------------------------------------------------


def test_hf_missing_bucket_says_how_to_create_it() -> None:
    store = HfBucketStore("me/no-such-bucket", api=FakeBucketApi(buckets=[]))
    for operation in (
        lambda: store.read_bytes("latest.json"),
        lambda: store.write_bytes("latest.json", b"1"),
        lambda: store.exists("latest.json"),
        lambda: store.list(),
        lambda: store.delete(["latest.json"]),
    ):
        with pytest.raises(StoreError, match="hf buckets create me/no-such-bucket") as info:
            operation()
        assert not isinstance(info.value, NotFoundError)  # a config problem, not a missing file


def test_hf_store_writes_under_its_prefix(fake_api: FakeBucketApi) -> None:
    HfBucketStore(BUCKET_ID, "runs/r1", api=fake_api).write_bytes("latest.json", b"1")
    assert list(fake_api.files[BUCKET_ID]) == ["runs/r1/latest.json"]


def test_hf_store_passes_its_token_on_every_call(fake_api: FakeBucketApi, monkeypatch) -> None:
    seen: list[object] = []
    for name in USED_METHODS:
        method = getattr(fake_api, name)

        def spy(*args, _method=method, **kwargs):
            seen.append(kwargs.get("token"))
            return _method(*args, **kwargs)

        monkeypatch.setattr(fake_api, name, spy)
    store = HfBucketStore(BUCKET_ID, token="hf_secret", api=fake_api)
    store.write_bytes("a", b"1")
    store.read_bytes("a")
    store.exists("a")
    store.list()
    store.delete(["a"])
    assert seen == ["hf_secret"] * 5


@pytest.mark.parametrize("name", USED_METHODS)
def test_fake_matches_real_signatures(name: str) -> None:
    """The fake must not drift from huggingface_hub: same parameter names, kinds, defaults."""

    def shape(function: object) -> list[tuple[str, object, object]]:
        parameters = inspect.signature(function).parameters.values()
        return [(p.name, p.kind, p.default) for p in parameters]

    assert shape(getattr(FakeBucketApi, name)) == shape(getattr(HfApi, name))
    real_is_generator = inspect.isgeneratorfunction(inspect.unwrap(getattr(HfApi, name)))
    assert inspect.isgeneratorfunction(getattr(FakeBucketApi, name)) == real_is_generator


@pytest.mark.parametrize("limit", [0, 4, 5, 6, 64, 2**50])
def test_read_with_a_limit_returns_at_most_limit_plus_one_bytes(store: Store, limit: int) -> None:
    # A reader that knows a file's size reads one byte more than it, never a hostile 2 GB.
    store.write_bytes("deltas/00000001.safetensors", b"hello")
    assert store.read_bytes("deltas/00000001.safetensors", limit=limit) == b"hello"[: limit + 1]
    with pytest.raises(NotFoundError):
        store.read_bytes("deltas/00000002.safetensors", limit=limit)


# --------------------------------------------------------------------------- streaming


def test_every_backend_streams(store: Store) -> None:
    assert isinstance(store, StreamingStore)


def test_write_stream_round_trip_with_size_and_digest(store: Store) -> None:
    chunks = [b"abc", memoryview(bytearray(b"defg")), b"", bytes(range(256)) * 40]
    size, digest = write_stream(store, "anchors/00000003.safetensors", iter(chunks))
    whole = b"".join(bytes(c) for c in chunks)
    assert (size, digest) == (len(whole), hashlib.sha256(whole).hexdigest())
    assert store.read_bytes("anchors/00000003.safetensors") == whole
    buffer = read_buffer(store, "anchors/00000003.safetensors", len(whole))
    assert isinstance(buffer, bytearray) and buffer == whole
    assert read_buffer(store, "anchors/00000003.safetensors", 10) == whole[:11]


def test_failed_stream_leaves_the_old_file(store: Store) -> None:
    store.write_bytes("anchors/00000003.safetensors", b"old")

    def broken():
        yield b"new bytes"
        raise RuntimeError("the trainer died mid-anchor")

    with pytest.raises(RuntimeError, match="mid-anchor"):
        write_stream(store, "anchors/00000003.safetensors", broken())
    assert store.read_bytes("anchors/00000003.safetensors") == b"old"
    assert store.list("anchors/") == ["anchors/00000003.safetensors"]


def test_write_pieces_round_trip_with_size_and_digest(store: Store, monkeypatch) -> None:
    """A file held in memory as pieces (a delta): a local folder streams them where they lie, any
    other backend gets one ``write_bytes`` of them joined (a remote one would spool a stream to a
    local file first); the file, its size and its digest are the same."""
    pieces = [b"header", memoryview(bytearray(b"\x00\x01")), b"", BIG]
    whole = b"".join(bytes(p) for p in pieces)
    calls: list[str] = []
    for method in ("write_bytes", "write_stream"):
        real = getattr(store, method)
        monkeypatch.setattr(store, method, lambda *a, real=real, method=method: calls.append(method) or real(*a))
    size, digest = write_pieces(store, "deltas/00000004.safetensors", pieces)
    assert (size, digest) == (len(whole), hashlib.sha256(whole).hexdigest())
    assert store.read_bytes("deltas/00000004.safetensors") == whole
    assert calls[0] == ("write_stream" if type(store).__name__ == "LocalStore" else "write_bytes")


def test_a_sub_store_writes_pieces_as_its_parent_does(tmp_path: Path) -> None:
    from deltasync.stores._sub import sub_store

    assert sub_store(LocalStore(tmp_path), "views/FP8_DYNAMIC/").streams_in_place  # type: ignore[attr-defined]
    five = FiveMethodStore()
    view = sub_store(five, "views/FP8_DYNAMIC/")
    assert not getattr(view, "streams_in_place", False)
    assert write_pieces(view, "deltas/x", [b"ab", memoryview(b"c")]) == (3, hashlib.sha256(b"abc").hexdigest())
    assert five.files["views/FP8_DYNAMIC/deltas/x"] == b"abc"


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this platform")
def test_a_local_stream_has_the_disk_start_on_its_bytes_as_they_are_written(tmp_path: Path, monkeypatch) -> None:
    import deltasync.stores._local as local

    advised: list[tuple[int, int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(local, "_WRITEBACK", 1000)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, length, advice: advised.append((offset, length, advice)) or real(fd, offset, length, advice))
    store = LocalStore(tmp_path / "b")
    chunks = [bytes([k]) * 700 for k in range(7)]
    write_stream(store, "anchors/00000001.safetensors", iter(chunks))
    assert store.read_bytes("anchors/00000001.safetensors") == b"".join(chunks)
    # Every 1000 bytes or more written, the bytes since the last call: 0..1400, 1400..2800, 2800..4200.
    expected = [(0, 1400), (1400, 1400), (2800, 1400)] if local.sys.platform.startswith("linux") else []
    assert [(o, n) for o, n, _ in advised] == expected
    assert all(a == os.POSIX_FADV_DONTNEED for _, _, a in advised)


def test_read_buffer_of_a_missing_file_is_not_found(store: Store) -> None:
    with pytest.raises(NotFoundError, match="latest.json"):
        read_buffer(store, "latest.json", 100)
    with pytest.raises(NotFoundError, match="latest.json"):
        store.open_read("latest.json").__enter__()  # type: ignore[attr-defined]


def test_open_read_reads_in_pieces_into_the_callers_buffers(store: Store) -> None:
    whole = bytes(range(256)) * 40
    store.write_bytes("anchors/00000003.safetensors", whole)
    got = bytearray(len(whole))
    with store.open_read("anchors/00000003.safetensors") as f:  # type: ignore[attr-defined]
        view, filled = memoryview(got), 0
        for size in (8, 1000, 3000, len(whole)):  # pieces of the reader's choosing
            while filled < min(size, len(whole)):
                n = f.readinto(view[filled : min(size, len(whole))])
                assert n > 0
                filled += n
        del view
        assert f.read(1) == b""
    assert got == whole


def test_every_backend_declares_its_optional_capabilities(store: Store) -> None:
    assert isinstance(store, BoundedReadStore) and isinstance(store, StreamingStore)
    assert isinstance(store, TempCleaningStore) == (type(store).__name__ == "LocalStore")
    store.write_bytes("a/b", b"hello")
    assert read_limited(store, "a/b", 2) == b"hel"


def test_a_five_method_store_still_streams_and_reads_buffers() -> None:
    store = FiveMethodStore()
    assert isinstance(store, Store)
    assert not isinstance(store, (StreamingStore, BoundedReadStore, TempCleaningStore))
    store.write_bytes("a/b", b"hello")
    assert read_limited(store, "a/b", 2) == b"hello"  # read whole: the caller refuses it for its size
    size, digest = write_stream(store, "a/b", iter([b"x", memoryview(b"yz")]))
    assert (size, store.files["a/b"]) == (3, b"xyz")
    assert digest == hashlib.sha256(b"xyz").hexdigest()
    assert read_buffer(store, "a/b", 10) == bytearray(b"xyz")
