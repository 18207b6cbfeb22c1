"""The accelerators' paths: the fingerprint summed where the weights are, the detector's sliced
compare with a bounded number of host synchronizations, the parallel encode, the in-place writer.

Each check runs on the CPU (the sliced compare forced with ``detector.sliced``, the hashes with
:class:`~deltasync.format.fingerprint.DeviceHasher` on CPU tensors) and, marked ``gpu``, on CUDA
where one is present (skipped with that reason elsewhere).
"""

from __future__ import annotations

import filecmp
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from helpers import small_transformer

import deltasync.trainer.scan as scan_module
from deltasync import ConfigError, DeltaPublisher, DeltaReceiver, FormatError
from deltasync.format import Change
from deltasync.format import fingerprint as fp
from deltasync.format.codecs.zstd import zstd_streams
from deltasync.trainer.detector import BF16ChangeDetector
from deltasync.trainer.publisher import PublishOptions

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none is present here)")]
DEVICES = ["cpu", pytest.param("cuda", marks=gpu)]


def special_bf16(n: int, seed: int = 0) -> torch.Tensor:
    """Random bf16 values with NaN payloads (both signs), infinities, -0.0 and +0.0 among them."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(1 << 15), 1 << 15, (n,), dtype=torch.int32, generator=g).to(torch.int16)
    specials = torch.tensor([0x7FC1, 0x7F81, -1, -0x7F, 0x7F80, -0x80, -0x8000, 0], dtype=torch.int16)
    bits[: specials.numel()] = specials
    return bits.view(torch.bfloat16)


# --------------------------------------------------------------------------- fingerprint


@pytest.mark.parametrize("device", DEVICES)
def test_the_fingerprint_on_the_device_is_the_hosts_bit_for_bit(device: str) -> None:
    values = special_bf16(300_001)
    codes = torch.randint(0, 256, (70_000,), dtype=torch.uint8).view(torch.float8_e4m3fn)
    index = torch.sort(torch.randperm(1_000_000)[: values.numel()]).values
    on = torch.device(device)
    # whole tensors (fingerprint), slices at an offset, index shares, and moves
    assert fp.fingerprint({"w": values.to(on), "q": codes.to(on)}) == fp.fingerprint({"w": values, "q": codes})
    hasher = fp.DeviceHasher(on, chunk=1 << 16)  # several chunks
    hasher.add_slice("w", values.to(on), 12345)
    assert hasher.value() == fp.fingerprint_slice_share("w", values, 12345)
    hasher = fp.DeviceHasher(on, chunk=1 << 15)
    hasher.add("w", index.to(on), values.to(on))
    assert hasher.value() == fp._hash_sum("w", fp._index_u64(index), fp._bits_u16(values))
    new = special_bf16(values.numel(), seed=1)
    host_move = fp._move("w", index, values, new) if device == "cuda" else None
    moved = fp.fingerprint_move("w", index.to(on), values.to(on), new.to(on))
    # against the NumPy path, element by element
    expected = (fp._hash_sum("w", fp._index_u64(index), fp._bits_u16(new))
                - fp._hash_sum("w", fp._index_u64(index), fp._bits_u16(values))) % 2**64  # fmt: skip
    assert moved == expected
    assert host_move in (None, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_slices_hashed_together_on_the_device_are_the_hosts_bit_for_bit(device: str) -> None:
    """``DeviceHasher.add_slices``: small slices of many names hashed in shared batches (a batch
    cut between slices, a slice of a chunk or more hashed alone), NaN payloads, -0.0 and
    one-byte codes among them, offsets past 2**32; the same sum as the host's."""
    on = torch.device(device)
    g = torch.Generator().manual_seed(3)
    sizes = [1, 300, 0, 5000, 4096, 4095, 17, 9000, 2]
    slices = [(f"layers.{k}.w", special_bf16(max(n, 8), seed=k)[:n], int(torch.randint(0, 1 << 40, (), generator=g)))
              for k, n in enumerate(sizes)]  # fmt: skip
    slices.append(("view.codes", torch.randint(0, 256, (777,), dtype=torch.uint8).view(torch.float8_e4m3fn), 5))
    want = sum(fp.fingerprint_slice_share(name, values, offset) for name, values, offset in slices) % 2**64
    hasher = fp.DeviceHasher(on, chunk=4096)  # batches of at most 4096 elements
    hasher.add_slices((name, values.to(on), offset) for name, values, offset in slices)
    assert hasher.value() == want
    assert fp.fingerprint_slices([(name, values.to(on), offset) for name, values, offset in slices]) == want


def test_the_device_hash_is_the_documented_one() -> None:
    """h = mix64(((index << 16) | bits) ^ seed), summed: computed here in plain Python."""
    values = special_bf16(9)
    index = torch.arange(5, 14)
    mask = 2**64 - 1
    seed = int(fp._seed("layer.weight"))

    def mix(x: int) -> int:
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & mask
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    bits = values.view(torch.int16).tolist()
    want = sum(mix(((i << 16) | (b & 0xFFFF)) ^ seed) for i, b in zip(index.tolist(), bits)) & mask
    hasher = fp.DeviceHasher(torch.device("cpu"))
    hasher.add_slice("layer.weight", values, 5)
    assert hasher.value() == want


# --------------------------------------------------------------------------- detector


def bf16_model(device: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Linear(200, 7), torch.nn.Linear(7, 1))
    return model.to(device=device, dtype=torch.bfloat16)


def bump(model: torch.nn.Module, step: int, share: float = 0.05) -> None:
    """Move a share of every weight by one ULP (and a few by many, and some to NaN / -0.0)."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            bits = p.view(-1).view(torch.int16)
            n = bits.numel()
            at = torch.randperm(n, generator=g)[: max(1, int(n * share))].to(bits.device)
            bits[at] += 1
            bits[at[:3]] = torch.tensor([0x7FC1, -0x8000, 1234], dtype=torch.int16, device=bits.device)[: at[:3].numel()]


def same_changes(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name].index, b[name].index), name
        for field in ("new", "old"):
            assert torch.equal(getattr(a[name], field).view(torch.int16), getattr(b[name], field).view(torch.int16)), name


@pytest.mark.parametrize("batch", [1 << 22, 7], ids=["one-batch", "batches-of-7"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_sliced_compare_finds_exactly_what_the_chunked_one_does(
    device: str, batch: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(scan_module, "SLICE", 1 << 12)  # several slices per weight
    # 7: the changes of a slice span batches, and a batch holds several weights' changes
    monkeypatch.setattr(scan_module, "BATCH", batch)
    model, twin = bf16_model(device), bf16_model("cpu")
    detector = BF16ChangeDetector(model)
    reference = BF16ChangeDetector(twin)  # the same weights, compared on the CPU in chunks
    detector.sliced = True
    for step in range(3):
        bump(model, step)
        with torch.no_grad():
            for a, b in zip(model.parameters(), twin.parameters()):
                b.copy_(a.detach().cpu())
        got, want = detector.changes(), reference.changes()
        same_changes(got, want)
        # the move summed on the device is the host's
        host = sum(fp.fingerprint_move(n, c.index, c.old, c.new) for n, c in want.items()) % 2**64
        assert detector.last_share == host
        assert reference.last_share is None  # summed on the host by its caller
        detector.commit(got)
        reference.commit(want)
    assert not detector.changes()


def test_a_pinned_snapshot_keeps_commits_aside_on_the_sliced_path() -> None:
    model = bf16_model("cpu")
    detector = BF16ChangeDetector(model)
    detector.sliced = True
    bump(model, 0)
    first = detector.changes()
    detector.pin()
    detector.commit(first)  # kept aside: compared as if written
    assert not detector.changes()
    bump(model, 1)
    during = detector.changes()
    detector.unpin()
    detector.sliced = False
    same_changes(detector.changes(), during)


@pytest.mark.parametrize("device", DEVICES)
def test_the_published_values_of_any_block_include_the_pinned_commits(device: str) -> None:
    """``published_flat(name, begin, end)`` (what a view reads, an expert's block at a time) is
    the committed state while the snapshot is pinned and the commits are kept aside."""
    model = bf16_model(device)
    detector = BF16ChangeDetector(model)
    bump(model, 0)
    detector.pin()
    detector.commit(detector.changes())  # kept aside: the snapshot still holds the values before
    for name, p in model.named_parameters():
        want = p.detach().reshape(-1).view(torch.int16).cpu()
        n = want.numel()
        assert not torch.equal(detector.snapshot_flat(name).view(torch.int16).cpu(), want), name
        for begin, end in ((0, n), (0, n // 3), (n // 3, n - 1), (n - 1, n), (n // 2, n // 2)):
            got = detector.published_flat(name, begin, end).view(torch.int16).cpu()
            assert torch.equal(got, want[begin:end]), (name, begin, end)
    detector.unpin()
    for name, p in model.named_parameters():
        assert torch.equal(detector.snapshot_flat(name).view(torch.int16), p.detach().reshape(-1).view(torch.int16))


class SyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what makes the host wait for an accelerator: ops whose result size or value the
    host must read (``nonzero``, ``item``, ...) and blocking copies to the host."""

    WAITS: ClassVar[set[str]] = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique2", "is_nonzero", "equal"}

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in self.WAITS or (name == "_to_copy" and str(kwargs.get("device", "")) == "cpu" and not kwargs.get("non_blocking", False)):
            self.count += 1
        return func(*args, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
def test_host_synchronizations_do_not_grow_with_the_weights(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most three per device and publish, whatever the size and number of the tensors (the
    chunked path waits once per 256K elements, four times)."""
    monkeypatch.setattr(scan_module, "SLICE", 1 << 10)
    waits = []
    monkeypatch.setattr(scan_module, "sync_point", lambda d, real=scan_module.sync_point: (waits.append(d), real(d)))
    counts = {}
    for width in (40, 400):  # 12K and 1.2M elements: 12 and 1172 slices
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, 3 * width, bias=False) for _ in range(3)])
        model = model.to(device=device, dtype=torch.bfloat16)
        detector = BF16ChangeDetector(model)
        detector.sliced = True
        bump(model, 0)
        waits.clear()
        with SyncCounter() as counter:
            changes = detector.changes()
        assert sum(c.index.numel() for c in changes.values()) > 0
        counts[width] = counter.count + len(waits)
    # the counts' copy and the wait for the values' copies (and, on CUDA, reading the summed
    # fingerprint move out of its page-locked buffer)
    assert counts[40] == counts[400] <= 3, counts


class KernelCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the ops that run a kernel (views, slices and allocations do not)."""

    FREE: ClassVar[set[str]] = {"view", "slice", "alias", "as_strided", "reshape", "_reshape_alias", "detach",
                                "expand", "t", "unsqueeze", "squeeze", "select", "lift_fresh", "empty"}  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ not in self.FREE:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", DEVICES)
def test_the_sliced_compare_queues_a_few_kernels_per_weight(device: str) -> None:
    """On an accelerator the compare is bound by kernel launches, one slice per weight for most
    weights: it counts and compares each slice (ne, sum; ne, nonzero_static), gathers its changes
    into the batch (add, two index_selects) and seeds its run of the hash (one xor); the hash and
    the copies to the host run once per batch. 46 per weight before the batches."""
    torch.manual_seed(0)
    weights = 100
    model = torch.nn.ModuleList([torch.nn.Linear(64, 64, bias=False) for _ in range(weights)])
    model = model.to(device=device, dtype=torch.bfloat16)
    detector = BF16ChangeDetector(model)
    detector.sliced = True
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[::97] += 1.0
    with KernelCounter() as counter:
        changes = detector.changes()
    assert len(changes) == weights
    assert counter.count <= 10 * weights, counter.count / weights


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_cuda_synchronizations_are_counted_by_torch_too(device: str) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 2048) for _ in range(4)]).to(device=device, dtype=torch.bfloat16)
    detector = BF16ChangeDetector(model)
    bump(model, 0)
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            detector.changes()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "called a synchronizing" in str(w.message)]
    assert len(syncs) <= 2, [str(w.message) for w in syncs]


# --------------------------------------------------------------------------- buckets


def publish_versions(bucket: Path, model: torch.nn.Module, *, sliced: bool, capture: str = "submit",
                     views: tuple[str, ...] = (), part_bytes: int | None = None) -> str:  # fmt: skip
    """Anchor, three deltas, an anchor beside the third, one more delta: the same edits on any device
    (``part_bytes``: anchors written as parts of about that size)."""
    split = {} if part_bytes is None else {"anchor_part_bytes": part_bytes}
    publisher = DeltaPublisher(str(bucket), model, None, options=PublishOptions(
        anchor_every=100, anchor_bytes_ratio=0.0, keep_anchors=2, capture="submit", views=views, **split))  # fmt: skip
    publisher.detector.sliced = sliced
    publisher.publish()
    for step in range(4):
        bump(model, step, share=0.01)
        publisher.publish(anchor=step == 2)
    publisher.flush()
    publisher.close()
    return publisher.fingerprint


def data_files(bucket: Path) -> list[str]:
    return sorted(str(p.relative_to(bucket)) for p in bucket.rglob("*.safetensors"))


@pytest.mark.parametrize("part_bytes", [None, 16384], ids=["one-file", "split"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_bucket_written_on_the_device_is_byte_identical(device: str, part_bytes: int | None, tmp_path: Path) -> None:
    """From the accelerator's path (CUDA weights, or the sliced compare on the CPU) and from
    the CPU's chunked path: the same files, byte for byte, and receivers end equal; anchors
    written as parts at once too."""
    a = publish_versions(tmp_path / "device", bf16_model(device), sliced=True, part_bytes=part_bytes)
    b = publish_versions(tmp_path / "host", bf16_model("cpu"), sliced=False, part_bytes=part_bytes)
    assert a == b
    files = data_files(tmp_path / "host")
    assert files == data_files(tmp_path / "device") and len(files) >= 6
    assert any(".part" in f for f in files) == (part_bytes is not None)
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "device", tmp_path / "host", files, shallow=False)
    assert not mismatch and not errors
    receiver = DeltaReceiver(str(tmp_path / "device"))
    receiver.sync()
    assert receiver.fingerprint == a and receiver.verify()


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_overlap_capture_with_cuda_weights_is_exact(device: str, tmp_path: Path) -> None:
    model = small_transformer().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    publisher = DeltaPublisher(str(tmp_path), model, optimizer, options=PublishOptions(capture="overlap"))
    assert set(publisher.detector.snapshot_devices.values()) == {"cuda:0"}
    publisher.publish()
    ids = torch.randint(0, 256, (4, 16), device=device)
    for _ in range(4):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        publisher.submit()
    publisher.flush()
    receiver = DeltaReceiver(str(tmp_path))
    receiver.sync()
    assert receiver.fingerprint == publisher.fingerprint
    served = receiver.state_dict()
    for name, param in model.named_parameters():
        key = name if name in served else None
        if key is not None:
            assert torch.equal(served[key].view(torch.int16), param.detach().to(torch.bfloat16).cpu().view(torch.int16))
    publisher.close()


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_weights_on_two_devices(device: str, tmp_path: Path) -> None:
    model = bf16_model("cpu")
    model[1].to(device)  # the middle layer on the accelerator, the others on the host
    fingerprint = publish_versions(tmp_path / "mixed", model, sliced=False)
    assert fingerprint == publish_versions(tmp_path / "host", bf16_model("cpu"), sliced=False)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=gpu)])
def test_views_from_cuda_weights_are_byte_identical(device: str, tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors")

    def model_on(d: str) -> torch.nn.Module:
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.Linear(128, 64))
        return m.to(device=d, dtype=torch.bfloat16)

    publish_versions(tmp_path / "device", model_on(device), sliced=True, views=("FP8_DYNAMIC",))
    publish_versions(tmp_path / "host", model_on("cpu"), sliced=False, views=("FP8_DYNAMIC",))
    files = data_files(tmp_path / "host")
    assert any(f.startswith("views/") for f in files)
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "device", tmp_path / "host", files, shallow=False)
    assert not mismatch and not errors


# --------------------------------------------------------------------------- encode


def test_the_parallel_encode_writes_the_same_bytes() -> None:
    g = torch.Generator().manual_seed(0)
    items = []
    for k in range(7):
        n = 200_000 + 999 * k
        index = torch.sort(torch.randperm(5 * n, generator=g)[:n]).values
        old = special_bf16(n, seed=k)
        new = (old.view(torch.int16) + torch.randint(1, 3, (n,), dtype=torch.int16, generator=g)).view(torch.bfloat16)
        items.append((f"w{k}", Change(index=index, new=new, old=old)))
    one, counts1 = zstd_streams(items, workers=1)
    many, counts4 = zstd_streams(items, workers=4)
    assert counts1 == counts4 and one == many
    assert all(isinstance(v, bytes) for v in many.values()) and np.frombuffer(many["gap_lo"], np.uint8).size == sum(counts1)


def test_encodes_at_once_share_the_encode_threads_and_write_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bf16 chain and the views encode in threads of their own, over one pool of encode
    threads whose tasks wait for others (the gap streams' compression waits for the gaps):
    many encodes at once, on two threads, each with many units, all finish with the bytes of
    one thread."""
    import deltasync.format.codecs.zstd as zstd_module

    monkeypatch.setattr(zstd_module, "ENCODE_CHUNK", 1 << 12)
    g = torch.Generator().manual_seed(1)
    deltas = []
    for d in range(6):
        items = []
        for k in range(3):
            n = 20_000 + 777 * k + 1000 * d
            index = torch.sort(torch.randperm(3 * n, generator=g)[:n]).values
            old = special_bf16(n, seed=10 * d + k)
            new = (old.view(torch.int16) + torch.randint(1, 4, (n,), dtype=torch.int16, generator=g)).view(torch.bfloat16)
            items.append((f"w{k}", Change(index=index, new=new, old=old)))
        deltas.append(items)
    want = [zstd_streams(items, workers=1) for items in deltas]
    with ThreadPoolExecutor(len(deltas)) as callers:
        jobs = [callers.submit(zstd_streams, items, workers=2) for items in deltas * 3]
        got = [job.result(timeout=120) for job in jobs]  # a deadlock fails here, not forever
    assert got == want * 3


@pytest.mark.parametrize("workers", [1, 3])
def test_the_encoders_first_error_is_the_same_for_any_thread_count(workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unchanged element in an early unit and indices out of order in a later one: the
    indices are named, whatever the thread count (errors in the indices come first, each kind in
    unit order)."""
    import deltasync.format.codecs.zstd as zstd_module

    monkeypatch.setattr(zstd_module, "ENCODE_CHUNK", 8)
    old = special_bf16(16)
    new = (old.view(torch.int16) + 1).view(torch.bfloat16)
    new[2] = old[2]  # unchanged, in the first unit
    index = torch.arange(0, 32, 2)
    index[12] = index[11]  # repeated, in the second unit
    same = Change(index=torch.arange(0, 32, 2), new=new, old=old)
    with pytest.raises(FormatError, match="parameter 'b': .*strictly increasing"):
        zstd_streams([("a", same), ("b", Change(index=index, new=(old.view(torch.int16) + 1).view(torch.bfloat16), old=old))],
                     workers=workers)  # fmt: skip
    with pytest.raises(FormatError, match="parameter 'a': .*new value equals its old one"):
        zstd_streams([("a", same)], workers=workers)


# --------------------------------------------------------------------------- bad input


def test_weights_on_the_meta_device_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match="meta device"):
        DeltaPublisher(str(tmp_path), model, None)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_budget_that_cannot_hold_the_snapshot(device: str, tmp_path: Path) -> None:
    model = bf16_model(device)
    numel = sum(p.numel() for p in model.parameters())
    with pytest.raises(ConfigError, match=r"snapshot_budget=100 bytes"):
        DeltaPublisher(str(tmp_path), model, None, options=PublishOptions(snapshot_device=None, snapshot_budget=100))
    assert not list(tmp_path.iterdir())
    fits = BF16ChangeDetector(model, snapshot_device=None, snapshot_budget=2 * numel)
    assert set(fits.snapshot_devices.values()) == {str(next(model.parameters()).device)}
    # "auto" keeps it on the host instead (weights on the CPU always keep it there)
    auto = BF16ChangeDetector(model, snapshot_budget=100)
    assert set(auto.snapshot_devices.values()) == {"cpu"}
    with pytest.raises(ConfigError, match="snapshot_budget must be >= 0"):
        BF16ChangeDetector(model, snapshot_budget=-1)


def test_a_view_on_a_device_without_its_dtype(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("compressed_tensors")
    import deltasync.trainer.view_publishing as view_publishing

    real = torch.Tensor.to

    def no_fp8(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.float8_e4m3fn in args or kwargs.get("dtype") is torch.float8_e4m3fn:
            raise RuntimeError('"copy_" not implemented for Float8_e4m3fn')
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", no_fp8)
    with pytest.raises(ConfigError, match=r"view 'FP8_DYNAMIC': the weights are on cpu, which has no torch.float8_e4m3fn"):
        view_publishing.check_device_dtype(torch.device("cpu"), torch.float8_e4m3fn, "FP8_DYNAMIC")
    model = torch.nn.Sequential(torch.nn.Linear(64, 32)).to(torch.bfloat16)
    with pytest.raises(ConfigError, match="which has no torch.float8_e4m3fn"):
        DeltaPublisher(str(tmp_path), model, None, options=PublishOptions(views=("FP8_DYNAMIC",)))
    # Nothing but the hidden lock file of the empty bucket's claim, which it made and deleted.
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [".writer.json.lock"]


# --------------------------------------------------------------------------- in-place writer


class LiveModel(torch.nn.Sequential):
    """The served model: :func:`bf16_model`'s layers, loaded as a vLLM model loads checkpoints."""

    def __init__(self, device: str) -> None:
        super().__init__(*bf16_model(device, seed=1))

    def load_weights(self, weights: Any) -> set[str]:
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


@pytest.mark.parametrize("device", DEVICES)
def test_the_in_place_writer_on_device_tensors_is_exact(device: str, tmp_path: Path, monkeypatch) -> None:
    """After every delta and every anchor, the fingerprint of the live tensors (hashed where they
    are) is the bucket's, and the values are the trainer's. One delta's indices are located once,
    on the device, by the read; its write uses those positions. Two deltas staged at once (a
    server one version behind) take the general path."""
    from deltasync.server import weight_map
    from deltasync.server.inplace import InPlaceState
    from deltasync.server.weight_map import discover

    located, depth = [0], [0]

    def counting(real):  # type: ignore[no-untyped-def]  # a location asked for (locate uses locate_run)
        def counted(self, index, **kwargs):  # type: ignore[no-untyped-def]
            located[0] += depth[0] == 0
            depth[0] += 1
            try:
                return real(self, index, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    monkeypatch.setattr(weight_map.Piece, "locate", counting(weight_map.Piece.locate))
    monkeypatch.setattr(weight_map.Piece, "locate_run", counting(weight_map.Piece.locate_run))

    from deltasync.reader.chain import ChainReader, read_pointer
    from deltasync.stores import LocalStore

    trainer = bf16_model("cpu")
    publisher = DeltaPublisher(str(tmp_path), trainer, None, options=PublishOptions(anchor_every=100, anchor_bytes_ratio=0.0))
    publisher.publish()
    receiver = DeltaReceiver(str(tmp_path))
    receiver.sync()
    state = receiver.state_dict()
    live_model = LiveModel(device)  # other values: the anchor must load
    live = InPlaceState(live_model, discover(live_model, {n: tuple(t.shape) for n, t in state.items()}), lambda o: [o], 0,
                        live_model.load_weights)  # fmt: skip
    store = LocalStore(str(tmp_path))
    live.load_anchor(list(state.items()))
    live.commit(0, receiver.fingerprint or "")
    assert live.full_fingerprint() == receiver.fingerprint
    for step in range(6):
        bump(trainer, step, share=0.02)
        result = publisher.publish(anchor=step == 1)
        publisher.flush()
        if step == 3:
            continue  # staged with the next one
        pointer = read_pointer(store)
        located[0] = 0
        staged = live.stage_deltas(ChainReader(store, pointer), result.version)
        if step != 4:  # one delta: one locate per changed name, by the read
            assert located[0] == len(staged.names) > 0
        fingerprint = live.check_chain(staged, [staged.shares])
        live.write(staged)
        live.commit(result.version, fingerprint)
        assert fingerprint == result.fingerprint == live.full_fingerprint()
        for (_, want), got in zip(trainer.named_parameters(), live_model.parameters()):
            assert torch.equal(got.detach().cpu().view(torch.int16), want.detach().view(torch.int16))
    # an anchor loaded densely is exact too
    receiver.sync()
    live.load_anchor(list(receiver.state_dict().items()))
    assert live.verify()["ok"] and live.fingerprint == publisher.fingerprint
    publisher.close()
