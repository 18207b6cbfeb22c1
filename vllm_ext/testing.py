"""Test-only worker extension: RPCs that damage or probe a server on purpose.

The servers the test suite starts load :class:`TestingWorkerExtension` in place of
:class:`~vllm_ext.DeltaWorkerExtension` (``tests/servers.py``: ``extension_args``); production
(``deltasync serve``, the demo, the Spaces) never does, so these RPCs do not exist there. They
run only with ``DELTASYNC_TEST_HOOKS=1`` in the server's environment too.

Every test hook lives here, none on a production class: :func:`poke` damages an
:class:`~deltasync.server.inplace.InPlaceState`'s live weights, :func:`fail_after_write` makes its next
write fail once it has written (the production classes are used as they are, through their own
methods and attributes).
"""

from __future__ import annotations

import contextlib
import gc
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from deltasync.errors import ConfigError, UpdateError
from deltasync.protocol import TEST_HOOKS_ENV
from deltasync.server.config import ServerConfig
from deltasync.server.inplace import InPlaceState, LiveStaged, wait_for_device
from deltasync.server.live_target import LiveTarget
from deltasync.server.updater import WorkerUpdater

from ._extension import DeltaWorkerExtension, updater_of
from ._lora_worker import find_lora, held_lora_tensor

__all__ = ["TEST_EXTENSION", "TestingWorkerExtension", "fail_after_write", "one_rank", "poke"]

#: The ``--worker-extension-cls`` value of a test server.
TEST_EXTENSION = "vllm_ext.testing.TestingWorkerExtension"


class TestingWorkerExtension(DeltaWorkerExtension):
    """:class:`~vllm_ext.DeltaWorkerExtension` plus ``deltasync_test_poke``,
    ``deltasync_test_fail_after_write``, ``deltasync_test_tensor_bytes``,
    ``deltasync_test_poke_lora``, ``deltasync_test_step_times`` and
    ``deltasync_test_step_delay``."""

    __test__ = False  # not a pytest test class

    def deltasync_test_poke(self, name: str, index: int, bits: int) -> bool:
        """Set one live element's bf16 bit pattern (in-place mode); False on a rank that does not hold it."""
        target = _live_target(updater_of(self))
        return poke(target.live, name, index, bits)

    def deltasync_test_fail_after_write(self, rank: int) -> None:
        """Make the next in-place write fail on ``rank`` after it has written."""
        updater = updater_of(self)
        target = _live_target(updater)
        if rank == updater.rank:
            fail_after_write(target.live, f"a failure injected after rank {updater.rank} wrote (test hook)")

    def deltasync_test_tensor_bytes(self) -> dict[str, int]:
        """Bytes of CPU tensors alive in this process, beyond the model's parameters, that are
        shaped like a checkpoint tensor: what an HF-named copy would be made of."""
        updater = updater_of(self)
        _check_hooks()
        return _checkpoint_shaped_bytes(updater)

    def deltasync_test_poke_lora(self, lora_id: int, name: str, index: int, factor: float) -> bool:
        """Multiply one element of the LoRA tensor vLLM holds for ``name`` in adapter ``lora_id``."""
        _check_hooks()
        from vllm.lora.utils import parse_fine_tuned_lora_name

        manager, lora = find_lora(self, lora_id)
        mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
        module, is_a = parse_fine_tuned_lora_name(name, None if mapper is None else mapper.get_rename_mapper())
        held = held_lora_tensor(manager, lora, module, is_a)
        if held is None:
            return False
        held.view(-1)[index] *= factor
        return True


    def deltasync_test_step_times(self, start: bool = False) -> list[list[float]]:
        """When this worker computed: ``[start, end]`` of every ``execute_model`` and
        ``sample_tokens`` call since the previous call of this one (``start``: begin recording).
        The times are ``time.perf_counter()``, Linux's system-wide monotonic clock, so a client
        on the same machine can set its own times against them (``benchmarks/inflight.py``:
        whether the engine stopped, or only the answers' way out of it)."""
        _check_hooks()
        worker: Any = self
        if start and "_deltasync_steps" not in vars(worker):
            worker._deltasync_steps = []
            for name in ("execute_model", "sample_tokens"):
                method = getattr(worker, name, None)
                if method is not None:
                    setattr(worker, name, _timed(method, worker._deltasync_steps))
        steps = vars(worker).get("_deltasync_steps")
        if steps is None:
            raise ConfigError("step times are not recorded: call deltasync_test_step_times with start=True first")
        taken = list(steps)
        del steps[: len(taken)]
        return taken

    def deltasync_test_step_delay(self, seconds: float) -> float:
        """Make each later ``execute_model`` call of this worker wait ``seconds`` first (0: not any
        more), so that a request takes a known least time to generate: a test can then act
        while it is in flight, however slowly the test process gets the CPU. Returns the delay
        before."""
        _check_hooks()
        if not 0 <= seconds <= 1:
            raise ConfigError(f"a step delay of {seconds} s: give 0 to 1 s")
        worker: Any = self
        before = vars(worker).get("_deltasync_delay", 0.0)
        if "_deltasync_delay" not in vars(worker):
            execute = worker.execute_model

            def delayed(*args: Any, **kwargs: Any) -> Any:
                if worker._deltasync_delay > 0:
                    time.sleep(worker._deltasync_delay)
                return execute(*args, **kwargs)

            worker.execute_model = delayed
        worker._deltasync_delay = float(seconds)
        return before


def poke(live: InPlaceState, name: str, index: int, bits: int) -> bool:
    """Set element ``index`` of checkpoint tensor ``name`` to the bf16 bit pattern ``bits`` in
    ``live``'s weights, behind its back (wherever this rank holds it); False where it holds none."""
    idx = torch.tensor([index], dtype=torch.int64)
    done = False
    for piece in live.map.pieces.get(name, []):
        hit, dst = piece.locate(idx)
        if hit.numel():
            signed = bits - 0x10000 if bits >= 0x8000 else bits
            flat = live.flat[piece.param]
            flat.write(dst.to(flat.device), torch.tensor([signed], dtype=torch.int16, device=flat.device))
            wait_for_device([flat.tensor])
            done = True
    return done


def fail_after_write(live: InPlaceState, message: str) -> None:
    """Make ``live``'s next :meth:`~deltasync.server.inplace.InPlaceState.write` raise
    :class:`~deltasync.errors.UpdateError` (``message``) once it has written, carrying its undo
    log as a failed write does; the writes after it work again."""
    write: Callable[[LiveStaged], Any] = live.write

    def fail_once(staged: LiveStaged) -> Any:
        del live.write  # the class's method again
        undo = write(staged)
        exc = UpdateError(message)
        exc.undo = undo  # type: ignore[attr-defined]
        raise exc

    live.write = fail_once  # type: ignore[method-assign]


def _timed(method: Any, into: list[list[float]]) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append([start, time.perf_counter()])

    return timed


def _check_hooks() -> None:
    if not ServerConfig.from_env().test_hooks:
        raise ConfigError(f"test hooks are off; start the server with {TEST_HOOKS_ENV}=1")


def _live_target(updater: WorkerUpdater) -> LiveTarget:
    _check_hooks()
    updater.target.settle()
    if not isinstance(updater.target, LiveTarget):
        raise ConfigError("this test hook needs in-place mode")
    return updater.target


def _checkpoint_shaped_bytes(updater: WorkerUpdater) -> dict[str, int]:
    gc.collect()
    model = updater.model
    params = {p.untyped_storage().data_ptr() for p in model.parameters() if p.numel()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers() if b.numel()}
    shapes = {tuple(shape) for shape in (updater.checkpoint.shapes or {}).values()}
    seen: set[int] = set()
    total = largest = 0
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta and tuple(obj.shape) in shapes:
            try:
                ptr = obj.untyped_storage().data_ptr()
            except RuntimeError:
                continue
            if ptr in params or ptr in seen or ptr == 0:
                continue
            seen.add(ptr)
            n = obj.untyped_storage().nbytes()
            total += n
            largest = max(largest, n)
    return {"bytes": total, "largest": largest}


@contextlib.contextmanager
def one_rank() -> Iterator[None]:
    """vLLM's parallel groups of one rank over gloo in this process, under a default
    ``VllmConfig``, torn down after: what vLLM's parameter classes and layers ask for while a
    model (or a load-time stand-in) is built outside a server (tests, ``benchmarks/discover.py``)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")  # fmt: skip
        initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
