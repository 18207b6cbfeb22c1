"""What each rank runs in the sharded-publish tests (imported by spawned processes).

Everything here runs inside one gloo process group per world size; the full model is gathered
only to check what the receiver holds, never by the code under test.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from deltasync import (
    BF16ChangeDetector,
    ConfigError,
    DeltaPublisher,
    DeltaReceiver,
    PublishError,
    bf16_state_dict,
    fingerprint,
    open_store,
)
from deltasync.format import (
    POINTER_PATH,
    Change,
    Pointer,
    anchor_path,
    encode_anchor,
    encode_delta,
    part_path,
    tensors_manifest,
)
from deltasync.stores import Store


class Net(nn.Module):
    """A small Qwen2 LM with tied embeddings (vocab 259: no world size divides it) and a
    ``Linear(5, 1)`` whose single row leaves every rank but the first with an empty shard."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(seed)
        config = Qwen2Config(
            vocab_size=259,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
        self.lm = Qwen2ForCausalLM(config).float()
        self.extra = nn.Linear(5, 1)

    def forward(self, ids: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=ids).loss + 0.1 * self.extra(side).square().mean()


def step(net: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (2, 12), generator=gen)
    side = torch.randn(2, 5, generator=gen)
    net(ids, side).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def gathered(net: nn.Module) -> dict[str, torch.Tensor]:
    """The full bf16 model, for checking only (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in net.named_parameters():
        full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        out[name.removeprefix("module.")] = full.to(torch.bfloat16)
    return out


def follow(receiver: DeltaReceiver, version: int) -> None:
    """Sync a follower to ``version``: by the deltas after its own version only (it never reads
    an anchor, whichever are written beside)."""
    staged = receiver.stage()
    assert (staged.kind, staged.versions) == ("delta", list(range(staged.from_version + 1, version + 1))), staged
    receiver.apply(staged)


def assert_exact(receiver: DeltaReceiver, want: dict[str, torch.Tensor], where: str) -> None:
    got = receiver.state_dict()
    assert set(got) == set(want), (where, sorted(set(got) ^ set(want)))
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, (where, name)
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), (where, name)
    assert receiver.fingerprint == fingerprint(want), where


class FlakyStore(Store):
    """A local bucket whose writes fail on purpose when ``fail`` matches (one shot)."""

    def __init__(self, root: Path) -> None:
        self.inner = open_store(root)
        self.url = self.inner.url
        self.fail: str | None = None

    def read_bytes(self, path: str) -> bytes:
        return self.inner.read_bytes(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        if self.fail is not None and self.fail in path:
            self.fail = None
            raise OSError(f"injected failure writing {path}")
        self.inner.write_bytes(path, data)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def delete(self, paths: list[str]) -> None:
        self.inner.delete(paths)

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)


def _fsdp(net: Net, mesh: object) -> Net:
    from torch.distributed.fsdp import fully_shard

    for layer in net.lm.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _refusals(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    net = _fsdp(Net(), mesh)
    partial = torch.optim.AdamW([p for n, p in net.named_parameters() if not n.startswith("extra.")], lr=1e-4)
    try:
        BF16ChangeDetector(net, partial)
    except ConfigError as exc:
        assert "not in the optimizer (extra.weight, extra.bias)" in str(exc) and f"FSDP2, {world} shards" in str(exc), exc
    else:
        raise AssertionError("parameters outside the optimizer were accepted")
    tp = nn.Linear(6, 4)
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Shard(1)]))
    try:
        BF16ChangeDetector(tp)
    except ConfigError as exc:
        assert "parameter 'weight' is placed ['S(1)']" in str(exc) or "Shard(dim=1)" in str(exc), exc
    else:
        raise AssertionError("a Shard(1) parameter was accepted")


def _fsdp_runs(rank: int, world: int, root: Path) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    net = _fsdp(Net(), mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-5)
    report: dict[str, object] = {}

    # -------- run A: publish after every step, zstd, an anchor beside every 10th version, failures injected
    store = FlakyStore(root / "a")
    pub = DeltaPublisher(store, net, opt, anchor_every=10, anchor_bytes_ratio=0)
    layout = pub.detector.layout
    assert layout is not None and layout.parts == world and layout.writer and layout.part == rank
    local = sum(s.end - s.begin for s in layout.slices.values())
    snapshots = layout.all_gather((pub.detector.snapshot_bytes, local))
    receiver = DeltaReceiver(root / "a") if rank == 0 else None
    result = pub.publish()
    want = gathered(net)
    total = sum(t.numel() for t in want.values())
    assert pub.detector.snapshot_bytes == 2 * local, (pub.detector.snapshot_bytes, local)
    snapshots = layout.all_gather((pub.detector.snapshot_bytes, local))
    assert sum(b for b, _ in snapshots) == 2 * total
    report["snapshot_bytes"] = [b for b, _ in snapshots]
    report["total"] = total
    if receiver is not None:
        receiver.sync()
        assert_exact(receiver, want, "anchor 0")
        assert result.fingerprint == fingerprint(want)
    # (version at which to fail, what to fail, rank that fails): a delta part or the pointer fails
    # the version, nothing is committed; an anchor part fails only the anchor beside version 10
    # (its delta is committed, and the next version gets an anchor at once).
    failures = {4: ("deltas/", world - 1), 9: (POINTER_PATH, 0), 10: ("anchors/", world - 1)}
    kinds, failed, scheduled, warnings = [], [], [], []
    split_files = world if world > 1 else 0
    for i in range(1, 33):
        step(net, opt, seed=1000 * i + rank)
        next_version = pub.version + 1
        plan = failures.pop(next_version, None) if i > 1 else None
        if plan is not None and rank == plan[1]:
            store.fail = plan[0]
        if plan is not None and plan[0] != "anchors/":
            try:
                pub.publish()
            except PublishError as exc:
                assert f"failed on 1 of {world} ranks, nothing was committed" in str(exc), exc
                assert f"rank {plan[1]}: OSError: injected failure writing {plan[0]}" in str(exc), exc
                failed.append(next_version)
            else:
                raise AssertionError(f"the injected failure at version {next_version} was not reported")
            assert pub.version == next_version - 1
            if receiver is not None:
                assert receiver.latest() == next_version - 1  # nothing was committed
                assert receiver.sync() == next_version - 1
            continue
        result = pub.publish()
        pub.flush()  # the anchor beside it, if one is due, commits (or fails) before the next version
        kinds.append(result.kind)
        warnings.extend(result.warnings)
        if result.anchor_scheduled:
            scheduled.append(result.version)
        want = gathered(net)
        if receiver is not None:
            follow(receiver, result.version)
            assert_exact(receiver, want, f"version {result.version}")
            assert result.fingerprint == fingerprint(want)
            pointer = Pointer.from_bytes(open_store(root / "a").read_bytes(POINTER_PATH))
            assert len(pointer.chain[-1].parts) == split_files
            assert all(len(a.parts) == split_files for a in pointer.anchors)
            assert (pointer.anchor == 0) == (result.version < 11), (pointer.anchor, result.version)
    assert failed == [4, 9], failed
    assert set(kinds) == {"delta"} and scheduled == [10, 11, 21], (kinds, scheduled)
    (lost,) = [w for w in warnings if w.startswith("the anchor of version 10 was not committed (the deltas are): ")]
    assert f"failed on 1 of {world} ranks" in lost and f"injected failure writing anchors/00000010.part{world - 1}." in lost, lost
    if rank == 0:
        late = DeltaReceiver(root / "a")  # catch up from a split anchor and split deltas
        staged = late.stage()
        assert (staged.kind, staged.versions) == ("anchor", list(range(21, pub.version + 1))), staged.versions
        late.apply(staged)
        assert_exact(late, want, "late receiver")
        pointer = Pointer.from_bytes(open_store(root / "a").read_bytes(POINTER_PATH))
        report["versions_a"] = pub.version
        report["anchors_a"] = [a.version for a in pointer.anchors]
        report["base_a"] = pointer.base
        report["chain_a"] = len(pointer.chain)
        # Retention after anchor 21: the parts of anchor 0, of the anchor 11 and of the failed
        # anchor 10 (one part was written) are gone, and the deltas up to the base.
        files = open_store(root / "a").list("anchors/") + open_store(root / "a").list("deltas/")
        kept = [part_path("anchor", 21, p) for p in range(world)]
        kept += [part_path("delta", v, p) for v in range(pointer.base + 1, pub.version + 1) for p in range(world)]
        assert sorted(files) == sorted(kept), sorted(set(files) ^ set(kept))
    pub.close()

    # -------- run B: publish every 3rd step, raw codec, anchors by size
    pub = DeltaPublisher(root / "b", net, opt, codec="raw", anchor_every=100, anchor_bytes_ratio=0.5)
    receiver = DeltaReceiver(root / "b") if rank == 0 else None
    pub.publish()
    if receiver is not None:
        receiver.sync()
    for i in range(1, 31):
        step(net, opt, seed=7000 * i + rank)
        if i % 3:
            continue
        result = pub.publish()
        want = gathered(net)
        if receiver is not None:
            follow(receiver, result.version)
            assert_exact(receiver, want, f"run B version {result.version}")
    pub.close()  # the anchors in flight commit
    if receiver is not None:
        late = DeltaReceiver(root / "b")  # from the newest anchor the size rule wrote
        staged = late.stage()
        assert staged.kind == "anchor" and staged.versions[0] > 0, staged.versions
        late.apply(staged)
        assert_exact(late, want, "run B late receiver")
    report["versions_b"] = pub.version
    return report


VIEWS = ("FP8_DYNAMIC", "FP8_BLOCK")


def view_model() -> nn.Module:
    """A small Qwen2 LM (tied embeddings) whose MLP weights have 320 rows or columns: their
    128x128 blocks straddle every rank boundary at 2 and 3 ranks, as do all of the layer's other
    weights (under 128 rows). ``extra``, a ``Linear(5, 1)``, leaves every rank but the first an
    empty shard of a quantized weight."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=259, hidden_size=64, intermediate_size=320, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).float()
    model.extra = nn.Linear(5, 1)
    return model


def view_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 259, (2, 12), generator=gen)
    side = torch.randn(2, 5, generator=gen)
    loss = model(input_ids=ids, labels=ids).loss
    if hasattr(model, "extra"):  # under DDP it stays as it is (an unused parameter)
        loss = loss + 0.1 * model.extra(side).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


_VIEW_TARGETS: set[str] | None = None


def expected_view(view: str, bf16: dict[str, torch.Tensor], targets: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The view of a full bf16 state, by the definition: compressed-tensors' quantization of every
    target (each Linear's weight but ``lm_head``; default: :func:`view_model`'s) of the whole
    tensor, the rest in bf16."""
    from deltasync.trainer.view_targets import quantized_names
    from deltasync.views import get_scheme

    global _VIEW_TARGETS
    if targets is None:
        if _VIEW_TARGETS is None:
            _VIEW_TARGETS = quantized_names(view_model(), list(bf16), ("lm_head",))
            assert len(_VIEW_TARGETS) == 15, sorted(_VIEW_TARGETS)  # 7 per layer, and extra
        targets = _VIEW_TARGETS
    scheme = get_scheme(view)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in bf16.items():
        if name in targets and tensor.ndim == 2:
            for suffix, t in scheme.quantize(tensor).items():
                out[name[: -len("weight")] + suffix] = t
        else:
            out[name] = tensor
    return out


def assert_view_exact(receiver: DeltaReceiver, want: dict[str, torch.Tensor], where: str) -> None:
    got = receiver.state_dict()
    assert set(got) == set(want), (where, sorted(set(got) ^ set(want)))
    for name, tensor in want.items():
        assert (got[name].dtype, got[name].shape) == (tensor.dtype, tensor.shape), (where, name)
        width = torch.uint8 if tensor.element_size() == 1 else torch.int16
        assert torch.equal(got[name].view(width), tensor.view(width)), (where, name)
    assert receiver.verify(), where


def _exported_view_is_exact(bucket: Path, out: Path, view: str, bf16: dict[str, torch.Tensor]) -> None:
    """``deltasync export --view`` of a view written in parts: the checkpoint's tensors are the view."""
    from safetensors.torch import load_file

    from deltasync.cli import main as cli

    assert cli(["export", str(bucket), str(out), "--view", view]) == 0
    (shard,) = out.glob("*.safetensors")
    got, want = load_file(shard), expected_view(view, bf16)
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for name, tensor in want.items():
        width = torch.uint8 if tensor.element_size() == 1 else torch.int16
        assert got[name].dtype == tensor.dtype and torch.equal(got[name].view(width), tensor.view(width)), name


def _view_runs(rank: int, world: int, root: Path) -> dict[str, object]:
    """FSDP2 with views: each rank writes its rows' codes and scales as part ``rank`` of each view
    version (block scales after an all-reduce of the blocks' abs-max), rank 0 commits. Rank 0's
    view receivers (deltas only) and late receivers (split anchors) hold compressed-tensors'
    quantization of the gathered bf16 weights, bit for bit. A view part that fails on one rank
    fails that view version on every rank; the view starts a new chain at the next version."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    net = view_model()
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)  # big steps: codes and scales move
    store = FlakyStore(root / "views")
    pub = DeltaPublisher(store, net, opt, views=VIEWS, anchor_every=3, anchor_bytes_ratio=0)
    receivers = {v: DeltaReceiver(root / "views", view=v) for v in VIEWS} if rank == 0 else {}
    states, fingerprints, changed = [], [], dict.fromkeys(VIEWS, 0)
    for i in range(5):
        if i:
            view_step(net, opt, seed=4000 * i + rank)
        if i == 2 and rank == world - 1:  # the last rank's FP8_BLOCK part of version 2 fails
            store.fail = "views/FP8_BLOCK/deltas/"
        result = pub.publish()
        pub.flush()
        if i == 2:  # on every rank: the bf16 chain and FP8_DYNAMIC have it, FP8_BLOCK does not
            (lost,) = result.warnings
            assert lost.startswith("view FP8_BLOCK: version 2 was not written") and f"failed on 1 of {world} ranks" in lost, lost
            assert set(result.view_nbytes) == {"FP8_DYNAMIC"}, result.view_nbytes
        else:
            assert not result.warnings, result.warnings
            assert set(result.view_nbytes) == set(VIEWS), result.view_nbytes
        full = gathered(net)
        # Memory: each rank keeps 1 byte per quantized element it owns plus its scale rows; the
        # ranks together hold each scale once.
        layout = pub.detector.layout
        for chain in pub._views:
            owned = sum(s.end - s.begin for n, s in pub._layout.slices.items() if n in chain.targets)
            codes = sum(layer["weight"].nbytes for layer in chain.quantized.values())
            scales = sum(layer["weight_scale"].nbytes for layer in chain.quantized.values())
            assert codes == owned, (chain.name, codes, owned)
            held = sum(b for b in layout.all_gather(scales))
            want_scales = expected_view(chain.name, full)
            assert held == sum(want_scales[n[: -len("weight")] + "weight_scale"].nbytes for n in chain.targets), chain.name
        fps = {v: pub.view_fingerprint(v) for v in VIEWS}
        assert all(f == fps for f in pub.detector.layout.all_gather(fps)), "ranks disagree on a view's fingerprint"
        if rank != 0:
            continue
        states.append(full)
        fingerprints.append({**fps, "FP8_BLOCK": None} if i == 2 else fps)
        for view, receiver in receivers.items():
            if view == "FP8_BLOCK" and i == 2:
                assert receiver.latest() == 1  # no rank's part was committed
                continue
            if view == "FP8_BLOCK" and i == 3:  # the view starts a new chain: an anchor of 3
                staged = receiver.stage()
                assert (staged.kind, staged.versions) == ("anchor", [3]), staged
                receiver.apply(staged)
            elif i:
                follow(receiver, result.version)
            else:
                receiver.sync()
            assert_view_exact(receiver, expected_view(view, full), f"view {view} version {result.version}")
            assert receiver.fingerprint == fps[view]
            pointer = Pointer.from_bytes(open_store(root / "views" / "views" / view).read_bytes(POINTER_PATH))
            entry = pointer.entry(result.version)
            assert [p.path for p in entry.parts] == [part_path(entry.kind, result.version, r) for r in range(world)]
            changed[view] += entry.changed if i else 0
    if rank == 0:
        assert all(changed.values()), changed  # the deltas moved codes or scales
        for view in VIEWS:
            late = DeltaReceiver(root / "views", view=view)  # from the split anchor beside version 3
            staged = late.stage()
            assert (staged.kind, staged.versions) == ("anchor", [3, 4]), staged.versions
            late.apply(staged)
            assert_view_exact(late, expected_view(view, states[-1]), f"view {view} late receiver")
            _exported_view_is_exact(root / "views", root / f"export-{view}", view, states[-1])
        torch.save({"states": states, "fingerprints": fingerprints}, root.parent / "views.pt")
    pub.close()

    # DDP: rank 0 alone keeps and writes the views, one file a version; the other ranks hold none.
    from torch.nn.parallel import DistributedDataParallel

    model = view_model()
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    pub = DeltaPublisher(root / "ddp-views", ddp, opt, views=VIEWS, anchor_every=2, anchor_bytes_ratio=0)
    receivers = {v: DeltaReceiver(root / "ddp-views", view=v) for v in VIEWS} if rank == 0 else {}
    for i in range(3):
        if i:
            view_step(ddp, opt, seed=i)
        result = pub.publish()
        pub.flush()
        assert not result.warnings, result.warnings
        full = gathered(ddp)
        assert (pub.view_fingerprint("FP8_BLOCK") is None) == (rank != 0)
        for view, receiver in receivers.items():
            receiver.sync()
            assert_view_exact(receiver, expected_view(view, full), f"DDP view {view} version {result.version}")
            assert receiver.fingerprint == pub.view_fingerprint(view)
            assert not receiver.pointer().chain or not receiver.pointer().chain[-1].parts
    if rank == 0:
        files = open_store(root / "ddp-views").list("views/")
        assert files and not any(".part" in f for f in files), files
    pub.close()
    return {"view_changed": changed}


def _ddp_and_hsdp(rank: int, world: int, root: Path) -> None:
    """DDP: rank 0 alone writes, single files byte-identical to a single process's. HSDP with
    one shard per replica group: the first replica group (rank 0) alone writes."""
    from torch.nn.parallel import DistributedDataParallel

    net = DistributedDataParallel(Net())
    opt = torch.optim.AdamW(net.parameters(), lr=3e-5)
    pub = DeltaPublisher(root / "ddp", net, opt, anchor_every=4, anchor_bytes_ratio=0)
    assert pub.detector.layout is not None and pub.detector.layout.writer == (rank == 0)
    assert (pub.detector.snapshot_bytes > 0) == (rank == 0)
    receiver = DeltaReceiver(root / "ddp") if rank == 0 else None
    before = bf16_state_dict(net)
    scheduled = []
    for i in range(8):
        if i:
            step(net, opt, seed=i)
        result = pub.publish()
        pub.flush()
        after = bf16_state_dict(net)
        if result.anchor_scheduled:
            scheduled.append(result.version)
        if rank == 0:
            data = open_store(root / "ddp").read_bytes(result.path)
            if result.anchor_scheduled:  # the anchor beside: a single process's bytes too
                assert open_store(root / "ddp").read_bytes(anchor_path(result.version)) == encode_anchor(
                    after, version=result.version, fingerprint=fingerprint(after), manifest=tensors_manifest(after)
                ), f"DDP anchor {result.version} differs from a single process's bytes"
            if result.kind == "anchor":
                assert result.version == 0
                expected = encode_anchor(
                    after, version=result.version, fingerprint=fingerprint(after), manifest=tensors_manifest(after)
                )
            else:
                changes = {}
                for name, new in after.items():
                    index = torch.nonzero(new.view(-1).view(torch.int16) != before[name].view(-1).view(torch.int16)).reshape(-1)
                    if index.numel():
                        changes[name] = Change(index=index, new=new.view(-1)[index], old=before[name].view(-1)[index])
                expected = encode_delta(  # every delta names the chain's root, version 0
                    changes, version=result.version, anchor=0, codec="zstd",
                    total=result.total, fingerprint=fingerprint(after), base_fingerprint=fingerprint(before),
                    numels={n: t.numel() for n, t in after.items()}, manifest=tensors_manifest(after),
                )
            assert data == expected, f"DDP version {result.version} differs from a single process's bytes"
            assert receiver is not None
            if result.version:
                follow(receiver, result.version)
            else:
                receiver.sync()
            assert_exact(receiver, after, f"DDP version {result.version}")
        before = after
    assert scheduled == [4], scheduled
    files = open_store(root / "ddp").list("")
    assert not any(".part" in f for f in files), files
    pub.close()

    if world == 2:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        hnet = _fsdp(Net(), mesh)
        hopt = torch.optim.AdamW(hnet.parameters(), lr=3e-5)
        hpub = DeltaPublisher(root / "hsdp", hnet, hopt)
        layout = hpub.detector.layout
        assert layout is not None and layout.description == "HSDP, 2 replicas x 1 shards", layout.description
        assert layout.writer == (rank == 0)
        hreceiver = DeltaReceiver(root / "hsdp") if rank == 0 else None
        for i in range(4):
            if i:
                step(hnet, hopt, seed=50 + i)  # same data on both replicas would also do
            result = hpub.publish()
            want = gathered(hnet)
            if hreceiver is not None:
                assert hreceiver.sync() == result.version
                assert_exact(hreceiver, want, f"HSDP version {result.version}")
        hpub.close()


@contextlib.contextmanager
def process_group(rank: int, world: int, init_file: str, root: str | None = None) -> Iterator[None]:
    """Join the test's gloo group (one thread per rank); print a rank's failure, always leave the
    group, and on rank 0 remove ``root`` afterwards unless ``DELTASYNC_KEEP_BUCKETS`` is set."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=180),
    )
    try:
        yield
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()
        if root is not None and rank == 0 and os.environ.get("DELTASYNC_KEEP_BUCKETS") is None:
            shutil.rmtree(root, ignore_errors=True)


def run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    with process_group(rank, world, init_file, root):
        _refusals(rank, world)
        report = _fsdp_runs(rank, world, Path(root))
        report.update(_view_runs(rank, world, Path(root)))
        _ddp_and_hsdp(rank, world, Path(root))
        if rank == 0:
            import json

            Path(out).write_text(json.dumps(report))


def run_hsdp(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    """HSDP on 4 ranks, 2 replica groups x 2 shards: ranks 0 and 1 (replica 0) write 2 parts."""
    from torch.distributed.device_mesh import init_device_mesh

    with process_group(rank, world, init_file):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        net = _fsdp(Net(), mesh)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-5)
        pub = DeltaPublisher(Path(root) / "h", net, opt, anchor_every=4, anchor_bytes_ratio=0)
        layout = pub.detector.layout
        assert layout is not None and layout.description == "HSDP, 2 replicas x 2 shards", layout
        assert (layout.writer, layout.part, layout.parts) == (rank < 2, rank % 2 if rank < 2 else 0, 2)
        assert (pub.detector.snapshot_bytes > 0) == (rank < 2)
        receiver = DeltaReceiver(Path(root) / "h") if rank == 0 else None
        kinds, scheduled = [], []
        for i in range(7):
            if i:
                step(net, opt, seed=300 * i + rank)
            result = pub.publish()
            pub.flush()
            kinds.append(result.kind)
            if result.anchor_scheduled:
                scheduled.append(result.version)
            want = gathered(net)
            if receiver is not None:
                if result.version:
                    follow(receiver, result.version)
                else:
                    receiver.sync()
                assert_exact(receiver, want, f"HSDP 2x2 version {result.version}")
                pointer = Pointer.from_bytes(open_store(Path(root) / "h").read_bytes(POINTER_PATH))
                for entry in (pointer.entry(result.version), pointer.anchors[-1]):
                    assert [p.path.rsplit("/", 1)[1] for p in entry.parts] == [
                        f"{entry.version:08d}.part0.safetensors", f"{entry.version:08d}.part1.safetensors"
                    ]
        assert kinds == ["anchor"] + ["delta"] * 6 and scheduled == [4], (kinds, scheduled)
        if receiver is not None:
            late = DeltaReceiver(Path(root) / "h")  # from the split anchor beside version 4
            staged = late.stage()
            assert (staged.kind, staged.versions) == ("anchor", [4, 5, 6]), staged.versions
            late.apply(staged)
            assert_exact(late, want, "HSDP 2x2 late receiver")
        pub.close()
        _hsdp_views(rank, mesh, Path(root) / "hv")
        if rank == 0:
            Path(out).write_text("ok")


def _hsdp_views(rank: int, mesh: object, bucket: Path) -> None:
    """HSDP 2 x 2 with views: replica 0's two ranks write a part each (block abs-max all-reduced
    over all four ranks, replica 1 adding zeros), replica 1 writes nothing."""
    from torch.distributed.fsdp import fully_shard

    model = view_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = DeltaPublisher(bucket, model, opt, views=VIEWS, anchor_every=2, anchor_bytes_ratio=0)
    receivers = {v: DeltaReceiver(bucket, view=v) for v in VIEWS} if rank == 0 else {}
    for i in range(3):
        if i:
            view_step(model, opt, seed=500 * i + rank % 2)  # replicas see the same data
        result = pub.publish()
        pub.flush()
        assert not result.warnings, result.warnings
        full = gathered(model)
        for view, receiver in receivers.items():
            receiver.sync()
            assert_view_exact(receiver, expected_view(view, full), f"HSDP view {view} version {result.version}")
            assert receiver.fingerprint == pub.view_fingerprint(view)
            entry = receiver.pointer().entry(result.version)
            assert [p.path for p in entry.parts] == [part_path(entry.kind, result.version, r) for r in range(2)]
    pub.close()
