"""Background publishing: the caller waits only for the capture; anchors are written beside
deltas, never instead; a publish holds one copy of the model."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import FiveMethodStore, GatedStore, small_transformer, train_step

import deltasync.trainer.scan as scan_module
from deltasync import BF16ChangeDetector, DeltaPublisher, DeltaReceiver, StoreError, bf16_state_dict, fingerprint, open_store
from deltasync.format import POINTER_PATH, Pointer


def bits(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.view(torch.int16).clone() for name, t in state.items()}


def assert_state(receiver: DeltaReceiver, expected: dict[str, torch.Tensor]) -> None:
    got = receiver.state_dict()
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert torch.equal(got[name].view(torch.int16), want), name
    assert receiver.fingerprint == fingerprint({n: t.view(torch.bfloat16) for n, t in expected.items()})


def trainer(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = small_transformer(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=2e-4)


def test_submit_returns_before_the_write_and_the_next_submit_waits(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "bucket")
    model, opt = trainer()
    with DeltaPublisher(store, model, opt) as publisher:
        publisher.publish()
        train_step(model, opt, seed=1)
        store.gated, _ = "deltas/", store.gate.clear()
        first = publisher.submit()
        assert store.waiting.wait(10)
        assert not first.done()  # captured and returned while the delta is still being written
        train_step(model, opt, seed=2)  # the trainer steps on meanwhile
        second_returned = threading.Event()

        def submit_again() -> None:
            second.append(publisher.submit())
            second_returned.set()

        second: list = []
        thread = threading.Thread(target=submit_again)
        thread.start()
        assert not second_returned.wait(0.5)  # one version in flight: it waits for the first
        store.gate.set()
        thread.join(10)
        assert second_returned.is_set()
        assert [first.result().version, second[0].result().version] == [1, 2]
        assert first.result().blocked_s < first.result().seconds


def test_a_failed_write_raises_from_its_future_and_from_the_next_submit(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "bucket")
    model, opt = trainer()
    receiver = DeltaReceiver(tmp_path / "bucket")
    with DeltaPublisher(store, model, opt) as publisher:
        publisher.publish()
        receiver.sync()
        train_step(model, opt, seed=1)
        store.fail = "deltas/"  # once
        failed = publisher.submit()
        with pytest.raises(StoreError, match="injected failure writing 'deltas/00000001.safetensors'"):
            failed.result()
        train_step(model, opt, seed=2)
        store.fail = "latest.json"  # fails at the commit point: nothing committed either
        unseen = publisher.submit()
        while not unseen.done():
            time.sleep(0.01)
        with pytest.raises(StoreError, match="injected failure writing 'latest.json'"):
            publisher.submit()  # nobody looked at the failure: the next submit raises it
        assert Pointer.from_bytes(store.read_bytes(POINTER_PATH)).version == 0  # nothing committed
        expected = bits(bf16_state_dict(model))
        result = publisher.publish()  # version 1 again, carrying both steps
        assert (result.version, result.kind) == (1, "delta")
        receiver.sync()
        assert_state(receiver, expected)


def test_followers_read_deltas_only_and_late_joiners_read_the_newest_anchor(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "bucket")
    model, opt = trainer()
    follower = DeltaReceiver(store)
    behind = DeltaReceiver(tmp_path / "bucket")  # stops following at version 6
    states = {}
    with DeltaPublisher(store, model, opt, anchor_every=3, anchor_bytes_ratio=0) as publisher:
        for version in range(12):
            if version:
                train_step(model, opt, seed=version)
            states[version] = bits(bf16_state_dict(model))  # saved before the trainer steps on
            result = publisher.submit().result()
            assert result.kind == ("anchor" if version == 0 else "delta")
            assert result.anchor_scheduled == (version > 0 and version % 3 == 0)
            follower.sync(version)
            assert_state(follower, states[version])
            if version == 6:
                behind.sync(6)
            if version == 7:
                publisher.flush()
                late = DeltaReceiver(store)
                staged = late.stage(version)
                assert (staged.kind, staged.versions) == ("anchor", [6, 7])
                late.apply(staged)
                assert_state(late, states[version])
        publisher.flush()
        pointer = publisher.pointer
        assert pointer is not None and [a.version for a in pointer.anchors] == [9]
        assert pointer.base == 6  # deltas are kept one anchor further back than anchors
    anchors_read = [p for p in store.reads if p.startswith("anchors/")]
    assert anchors_read == ["anchors/00000000.safetensors", "anchors/00000006.safetensors"]  # only by late joiners
    assert sorted(os.listdir(tmp_path / "bucket" / "anchors")) == ["00000009.safetensors"]
    assert sorted(os.listdir(tmp_path / "bucket" / "deltas")) == [f"{v:08d}.safetensors" for v in range(7, 12)]
    late = DeltaReceiver(tmp_path / "bucket")
    staged = late.stage()
    assert (staged.kind, staged.versions) == ("anchor", [9, 10, 11])
    late.apply(staged)
    assert_state(late, states[11])
    staged = behind.stage()  # an anchor interval behind, it still catches up by deltas alone
    assert (staged.kind, staged.versions) == ("delta", [7, 8, 9, 10, 11])
    behind.apply(staged)
    assert_state(behind, states[11])


def test_an_anchor_upload_never_holds_back_the_deltas(tmp_path: Path) -> None:
    store = GatedStore(tmp_path / "bucket")
    model, opt = trainer()
    states = {}
    with DeltaPublisher(store, model, opt, anchor_every=100, anchor_bytes_ratio=0) as publisher:
        publisher.publish()
        train_step(model, opt, seed=1)
        states[1] = bits(bf16_state_dict(model))
        store.gated, _ = "anchors/", store.gate.clear()
        assert publisher.publish(anchor=True).anchor_scheduled
        assert store.waiting.wait(10)
        for version in (2, 3, 4):  # the anchor of version 1 is still being written
            train_step(model, opt, seed=version)
            states[version] = bits(bf16_state_dict(model))
            assert publisher.publish().version == version
            assert Pointer.from_bytes(store.read_bytes(POINTER_PATH)).anchor == 0
        store.gate.set()
        publisher.flush()
        pointer = Pointer.from_bytes(store.read_bytes(POINTER_PATH))
        assert (pointer.version, [a.version for a in pointer.anchors]) == (4, [1])
        # The anchor is the state of version 1, though the snapshot moved on while it streamed.
        late = DeltaReceiver(tmp_path / "bucket")
        late.sync(1)
        assert_state(late, states[1])
        late.sync(4)
        assert_state(late, states[4])


def test_a_five_method_store_still_works(tmp_path: Path) -> None:
    store = FiveMethodStore()
    model, opt = trainer()
    with DeltaPublisher(store, model, opt, anchor_every=2) as publisher:
        for version in range(5):
            if version:
                train_step(model, opt, seed=version)
            publisher.publish()
            publisher.flush()  # each background anchor done before the next is due (else skipped)
        expected = bits(bf16_state_dict(model))
    late = DeltaReceiver(store)
    assert late.stage().versions == [4]
    late.sync()
    assert_state(late, expected)


def test_the_detector_compares_in_bounded_chunks_and_resets_in_place(monkeypatch) -> None:
    monkeypatch.setattr(scan_module, "CHUNK", 1000)
    model, opt = trainer()
    detector = BF16ChangeDetector(model, opt)
    snapshot = {n: t.data_ptr() for n, t in detector._snapshot.items()}
    before = bf16_state_dict(model)
    train_step(model, opt, seed=1)
    after = bf16_state_dict(model)
    changes = detector.changes()
    for name in before:
        diff = torch.nonzero(before[name].view(-1).view(torch.int16) != after[name].view(-1).view(torch.int16)).reshape(-1)
        if diff.numel():
            assert torch.equal(changes[name].index, diff), name
            assert torch.equal(changes[name].new.view(torch.int16), after[name].view(-1)[diff].view(torch.int16))
        else:
            assert name not in changes
    assert max(b.numel() for bufs in detector._buffers.values() for b in bufs) == 1000  # no buffer grows with a tensor
    detector.reset()
    assert {n: t.data_ptr() for n, t in detector._snapshot.items()} == snapshot  # overwritten in place
    assert detector.changes() == {}


def test_a_pinned_snapshot_keeps_its_bytes_and_compares_with_the_commits_kept_aside() -> None:
    model, opt = trainer()
    detector = BF16ChangeDetector(model, opt)
    published = bits(dict(detector._snapshot))
    train_step(model, opt, seed=1)
    detector.pin()
    detector.commit(detector.changes())
    held = bits(dict(detector._snapshot))
    assert all(torch.equal(held[n], published[n]) for n in published)  # the anchor's bytes did not move
    assert detector.changes() == {}  # compared against the commits kept aside
    train_step(model, opt, seed=2)
    second = detector.changes()
    assert second
    detector.unpin()
    now = bits({n: p.detach().to(torch.bfloat16).reshape(-1) for n, p in model.named_parameters() if n in detector._snapshot})
    detector.commit(second)
    assert all(torch.equal(detector._snapshot[n].view(torch.int16), now[n]) for n in now)


def test_commits_kept_aside_while_pinned_merge_and_the_later_value_wins() -> None:
    model, opt = trainer()
    detector = BF16ChangeDetector(model, opt)
    published = bits(dict(detector._snapshot))
    detector.pin()
    for seed in (1, 2, 3):  # each commit overlaps the ones before it: the later values must win
        train_step(model, opt, seed=seed)
        detector.commit(detector.changes())
        assert detector.changes() == {}
    assert all(torch.equal(bits(dict(detector._snapshot))[n], published[n]) for n in published)
    detector.unpin()
    now = bits({n: p.detach().to(torch.bfloat16).reshape(-1) for n, p in model.named_parameters() if n in detector._snapshot})
    assert all(torch.equal(detector._snapshot[n].view(torch.int16), now[n]) for n in now)
    assert detector.changes() == {}


KILLED = textwrap.dedent(
    """
    import sys, time, torch
    sys.path[:0] = [{tests!r}]
    from helpers import small_transformer, train_step
    from deltasync import DeltaPublisher, bf16_state_dict
    from deltasync.stores import LocalStore

    def say(line):  # one write per line: print() writes its parts apart, and two threads print
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()

    class Slow(LocalStore):
        def write_stream(self, path, chunks):
            def slow():
                for chunk in chunks:
                    if path.startswith("anchors/") and "00000000" not in path:
                        say(f"WRITING {{path}}")
                        time.sleep(60)
                    yield chunk
            super().write_stream(path, slow())

    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4)
    publisher = DeltaPublisher(Slow({bucket!r}), model, opt, anchor_every=2, anchor_bytes_ratio=0)
    for version in range(5):
        if version:
            train_step(model, opt, seed=version)
        torch.save(bf16_state_dict(model), {states!r} + f"/state{{version}}.pt")
        publisher.publish()
        say(f"COMMITTED {{version}}")
    time.sleep(60)
    """
)


def test_killed_mid_anchor_the_chain_is_as_the_last_commit_left_it(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    script = KILLED.format(tests=str(Path(__file__).parents[2]), bucket=str(bucket), states=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)
    committed = -1
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("COMMITTED"):
                committed = int(line.split()[1])
            if committed == 4:
                break
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert committed == 4  # the anchor of version 2 was mid-write all along; deltas committed past it
    pointer = Pointer.from_bytes((bucket / "latest.json").read_bytes())
    assert (pointer.version, [a.version for a in pointer.anchors]) == (4, [0])
    for version in (2, 4):
        receiver = DeltaReceiver(bucket)
        receiver.sync(version)
        assert_state(receiver, bits(torch.load(tmp_path / f"state{version}.pt")))
    # A restarted trainer starts a new chain after the last commit; readers follow it exactly.
    model, opt = trainer(seed=3)
    with DeltaPublisher(bucket, model, opt) as publisher:
        assert publisher.publish().version == 5
        expected = bits(bf16_state_dict(model))
    receiver = DeltaReceiver(bucket)
    receiver.sync()
    assert_state(receiver, expected)
    assert not [p for p in open_store(bucket).list() if p.startswith("anchors/00000002")]


# --------------------------------------------------------------------------- capture="overlap"


def slow_detector(publisher: DeltaPublisher, monkeypatch, fail: bool = False) -> tuple[threading.Event, threading.Event]:
    """Make the publisher's next capture wait for ``go`` (and then fail, with ``fail``)."""
    entered, go = threading.Event(), threading.Event()
    real = publisher.detector.changes

    def changes():  # type: ignore[no-untyped-def]
        entered.set()
        assert go.wait(10)
        if fail:
            raise RuntimeError("the detector broke")
        return real()

    monkeypatch.setattr(publisher.detector, "changes", changes)
    return entered, go


def stepping(model, opt, seed: int) -> tuple[threading.Thread, threading.Event]:  # type: ignore[no-untyped-def]
    """The trainer's next step (gradients, then the optimizer) in a thread."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (train_step(model, opt, seed=seed), done.set()))
    thread.start()
    return thread, done


@contextlib.contextmanager
def overlapping(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A trainer one step past the root version of an overlapping publisher, and a reader."""
    model, opt = trainer()
    receiver = DeltaReceiver(tmp_path / "bucket")
    with DeltaPublisher(tmp_path / "bucket", model, opt, capture="overlap") as publisher:
        publisher.publish()
        train_step(model, opt, seed=1)
        yield model, opt, receiver, publisher


def test_an_overlapping_capture_holds_the_next_step_not_the_submit(tmp_path: Path, monkeypatch) -> None:
    with overlapping(tmp_path) as (model, opt, receiver, publisher):
        expected = bits(bf16_state_dict(model))
        entered, go = slow_detector(publisher, monkeypatch)
        future = publisher.submit()  # returns before the changes are found
        assert entered.wait(10) and not future.done()
        thread, stepped = stepping(model, opt, seed=2)  # the next gradients go on meanwhile
        assert not stepped.wait(1.0)  # its optimizer step waits for the capture
        assert all(torch.equal(v, expected[k]) for k, v in bits(bf16_state_dict(model)).items())  # untouched
        go.set()
        thread.join(10)
        assert stepped.is_set()
        result = future.result()
        assert (result.version, result.kind) == (1, "delta")
        assert 0.5 < result.blocked_s < result.seconds  # the step's wait counts as blocked
        receiver.sync(1)
        assert_state(receiver, expected)  # exactly the weights at submit(), not after the step
        expected = bits(bf16_state_dict(model))
        assert publisher.publish().version == 2  # the step after it is in the next version
        receiver.sync()
        assert_state(receiver, expected)


def test_an_overlapping_capture_that_fails_lets_the_step_go(tmp_path: Path, monkeypatch) -> None:
    with overlapping(tmp_path) as (model, opt, receiver, publisher):
        _, go = slow_detector(publisher, monkeypatch, fail=True)
        future = publisher.submit()
        thread, stepped = stepping(model, opt, seed=2)
        go.set()
        thread.join(10)
        assert stepped.is_set()  # never left waiting on a capture that failed
        with pytest.raises(RuntimeError, match="the detector broke"):
            future.result()
        monkeypatch.undo()
        expected = bits(bf16_state_dict(model))
        assert publisher.publish().version == 1  # both steps, exactly
        receiver.sync()
        assert_state(receiver, expected)


def test_an_overlapping_capture_needs_the_optimizer(tmp_path: Path) -> None:
    from deltasync import ConfigError, PublishOptions

    model, _ = trainer()
    with pytest.raises(ConfigError, match="capture='overlap' is not possible here: the detector was built without the optimizer"):
        DeltaPublisher(tmp_path / "bucket", model, None, capture="overlap")
    with pytest.raises(ConfigError, match="capture must be one of 'submit', 'overlap', got 'later'"):
        PublishOptions(capture="later")
    assert not open_store(tmp_path / "bucket").list()  # refused before anything was written
