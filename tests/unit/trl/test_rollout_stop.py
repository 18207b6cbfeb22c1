"""Stopping TRL's rollout worker: the child exits as soon as its loops end, not after TRL's 15 s join."""

from __future__ import annotations

import multiprocessing
import time

from _rollout_child import child

from deltasync.trl._rollout import drain_on_stop, stop_draining


class _Worker:
    """The attributes of TRL 1.16's AsyncRolloutWorker that stopping it touches."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.rollout_buffer = ctx.Queue()
        self.metrics_queue = ctx.Queue()
        self._stop_event_mp = ctx.Event()
        self.ready = ctx.Event()
        args = (self.rollout_buffer, self.metrics_queue, self.ready, self._stop_event_mp)
        self._process = ctx.Process(target=child, args=args)
        self._process.start()
        self.stopped_by_trl = None

    def stop(self) -> None:  # TRL's: set the event, join 15 s, terminate
        self._stop_event_mp.set()
        self._process.join(timeout=15)
        self.stopped_by_trl = not self._process.is_alive()
        self._process = None


def test_stop_drains_what_the_child_still_sends_so_it_exits_at_once() -> None:
    worker = _Worker()
    process = worker._process
    drain_on_stop(worker)
    drain_on_stop(worker)  # a second wrap is a no-op
    assert worker.ready.wait(timeout=120)  # the child has queued its samples
    start = time.perf_counter()
    worker.stop()
    assert time.perf_counter() - start < 10
    assert process.exitcode == 0  # it exited by itself: not terminated
    assert worker.stopped_by_trl and worker._process is None  # TRL's own stop still ran


def test_a_worker_without_a_child_process_is_left_to_its_own_stop() -> None:
    class Plain:
        stops = 0

        def stop(self) -> None:
            self.stops += 1

    plain = Plain()
    assert stop_draining(plain) == 0
    drain_on_stop(plain)
    plain.stop()
    assert plain.stops == 1
