"""What each rank runs in the background-publishing gloo test (imported by spawned processes)."""

from __future__ import annotations

from pathlib import Path

import torch
from _sharded_workers import (
    VIEWS,
    Net,
    _fsdp,
    assert_exact,
    assert_view_exact,
    expected_view,
    gathered,
    process_group,
    step,
    view_model,
    view_step,
)
from helpers import GatedStore

from deltasync import DeltaPublisher, DeltaReceiver, PublishError, StoreError
from deltasync.format import POINTER_PATH, Pointer


def run(rank: int, world: int, init_file: str, root: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with process_group(rank, world, init_file, root):
        mesh = init_device_mesh("cpu", (world,))
        net = _fsdp(Net(), mesh)
        opt = torch.optim.AdamW(net.parameters(), lr=3e-5)
        bucket = Path(root) / "bg"
        store = GatedStore(bucket)
        pub = DeltaPublisher(store, net, opt, anchor_every=3, anchor_bytes_ratio=0)
        follower = GatedStore(bucket) if rank == 0 else None
        receiver = DeltaReceiver(follower) if follower is not None else None
        states = {}

        def publish_and_check(result_version: int, future) -> None:  # type: ignore[no-untyped-def]
            result = future.result()
            assert result.version == result_version, (result, result_version)
            if receiver is not None:
                receiver.sync(result.version)
                assert_exact(receiver, states[result.version], f"version {result.version}")

        states[0] = gathered(net)
        publish_and_check(0, pub.submit())
        # submit() returns once captured: every rank's delta part is still waiting to be written.
        step(net, opt, seed=100 + rank)
        states[1] = gathered(net)
        store.gated, _ = "deltas/", store.gate.clear()
        future = pub.submit()
        assert store.waiting.wait(30) and not future.done()
        step(net, opt, seed=200 + rank)  # the trainer steps on while its part is written
        store.gate.set()
        publish_and_check(1, future)
        store.gated = ""
        states[2] = gathered(net)
        publish_and_check(2, pub.submit())
        # A failed part on the last rank: every rank's future raises; nothing is committed.
        step(net, opt, seed=300 + rank)
        if rank == world - 1:
            store.fail = "deltas/"
        failed = pub.submit()
        try:
            failed.result()
        except (PublishError, StoreError) as exc:
            # A world of one raises the store's own error; several ranks, one naming the rank.
            wanted = f"rank {world - 1}: StoreError: " if world > 1 else ""
            assert f"{wanted}injected failure writing 'deltas/" in str(exc), exc
        else:
            raise AssertionError("the injected failure was not raised")
        # Unobserved, a failure is raised by the next submit, on every rank.
        if rank == world - 1:
            store.fail = "deltas/"
        pub.submit()
        try:
            pub.submit()
        except (PublishError, StoreError):
            pass
        else:
            raise AssertionError("an unobserved failure was not raised by the next submit")
        if receiver is not None:
            assert receiver.latest() == 2
        # The next version carries every step since version 2; anchors are written beside deltas.
        for version in range(3, 10):
            if version > 3:
                step(net, opt, seed=400 * version + rank)
            states[version] = gathered(net)
            future = pub.submit()
            publish_and_check(version, future)
            assert future.result().anchor_scheduled == (version % 3 == 0), version
        pub.close()
        if rank == 0:
            assert follower is not None
            assert not [p for p in follower.reads if p.startswith("anchors/") and "00000000" not in p], follower.reads
            pointer = Pointer.from_bytes(store.read_bytes(POINTER_PATH))
            assert [a.version for a in pointer.anchors] == [9], pointer.anchors
            assert len(pointer.anchors[0].files) == world if world > 1 else True
            late = DeltaReceiver(bucket)
            staged = late.stage()
            assert (staged.kind, staged.versions) == ("anchor", [9]), staged.versions
            late.apply(staged)
            assert_exact(late, states[9], "late joiner")
        overlap(net, opt, rank, Path(root) / "overlap")
        overlap_views(mesh, rank, Path(root) / "overlap-views")
        if rank == 0:
            Path(out).write_text("ok")


def overlap(net, opt, rank: int, bucket: Path) -> None:  # type: ignore[no-untyped-def]
    """capture="overlap": each rank's capture agrees over the publisher's own group in its
    thread while the next forward and backward run FSDP2's collectives on the training group;
    the optimizer step waits for the capture. Every version is the weights at its submit()."""
    pub = DeltaPublisher(bucket, net, opt, capture="overlap", anchor_every=10, anchor_bytes_ratio=0)
    states, futures = {}, {}
    for version in range(5):
        states[version] = gathered(net)
        futures[version] = pub.submit()
        step(net, opt, seed=700 + 10 * version + rank)  # beside the capture; its step waits for it
    results = {version: future.result() for version, future in futures.items()}
    pub.close()
    assert [r.version for r in results.values()] == list(range(5)), results
    if rank == 0:
        receiver = DeltaReceiver(bucket)
        for version in range(5):
            receiver.sync(version)
            assert_exact(receiver, states[version], f"overlap version {version}")


def overlap_views(mesh, rank: int, bucket: Path) -> None:  # type: ignore[no-untyped-def]
    """capture="overlap" with views: each version's view parts are quantized and written in the
    publisher's thread (block abs-max all-reduced over its own group) while the trainer runs the
    next forward and backward; every view version is the quantization of the weights at its submit()."""
    from torch.distributed.fsdp import fully_shard

    model = view_model()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pub = DeltaPublisher(bucket, model, opt, capture="overlap", views=VIEWS, anchor_every=10, anchor_bytes_ratio=0)
    states, futures = {}, {}
    for version in range(4):
        states[version] = gathered(model)
        futures[version] = pub.submit()
        view_step(model, opt, seed=900 + 10 * version + rank)
    results = {version: future.result() for version, future in futures.items()}
    pub.close()
    assert all(not r.warnings and set(r.view_nbytes) == set(VIEWS) for r in results.values()), results
    if rank == 0:
        for view in VIEWS:
            receiver = DeltaReceiver(bucket, view=view)
            for version in range(4):
                receiver.sync(version)
                assert_view_exact(receiver, expected_view(view, states[version]), f"overlap view {view} version {version}")
