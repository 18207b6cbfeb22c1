"""The test RPCs live in a test-only worker extension that production never loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from servers import TEST_EXTENSION, extension_args

from deltasync import ConfigError
from deltasync.control.serve import extension_args as production_extension_args
from deltasync.control.serve import serve_command
from vllm_ext import DeltaWorkerExtension
from vllm_ext import testing
from vllm_ext.testing import TestingWorkerExtension

HOOKS = ("deltasync_test_poke", "deltasync_test_fail_after_write", "deltasync_test_tensor_bytes",
         "deltasync_test_poke_lora", "deltasync_test_step_times", "deltasync_test_step_delay")  # fmt: skip


def test_production_has_no_test_rpcs_and_test_servers_load_them() -> None:
    assert not [name for name in dir(DeltaWorkerExtension) if "test" in name]
    assert all(callable(getattr(TestingWorkerExtension, name)) for name in HOOKS)
    assert issubclass(TestingWorkerExtension, DeltaWorkerExtension) and testing.TEST_EXTENSION == TEST_EXTENSION
    production = production_extension_args()
    assert production[production.index("--worker-extension-cls") + 1] == "vllm_ext.DeltaWorkerExtension"
    command, _ = serve_command("model", "/bucket", environ={})
    assert "vllm_ext.testing" not in " ".join(command)
    ours = extension_args(middleware=True)
    assert ours[ours.index("--worker-extension-cls") + 1] == TEST_EXTENSION
    assert [a for a in ours if a != TEST_EXTENSION] == [a for a in production_extension_args(middleware=True)
                                                      if a != "vllm_ext.DeltaWorkerExtension"]  # fmt: skip


def test_the_test_rpcs_also_need_the_switch(monkeypatch) -> None:
    updater = SimpleNamespace(target=SimpleNamespace(settle=lambda: None), rank=0)
    monkeypatch.setattr(testing, "updater_of", lambda worker: updater)
    worker = TestingWorkerExtension()
    monkeypatch.delenv("DELTASYNC_TEST_HOOKS", raising=False)
    for call in (lambda: worker.deltasync_test_poke("w", 0, 1), lambda: worker.deltasync_test_fail_after_write(0),
                 worker.deltasync_test_tensor_bytes, lambda: worker.deltasync_test_poke_lora(1, "w", 0, 2.0),
                 lambda: worker.deltasync_test_step_delay(0.01)):  # fmt: skip
        with pytest.raises(ConfigError, match="test hooks are off; start the server with DELTASYNC_TEST_HOOKS=1"):
            call()
    monkeypatch.setenv("DELTASYNC_TEST_HOOKS", "1")
    with pytest.raises(ConfigError, match="this test hook needs in-place mode"):
        worker.deltasync_test_poke("w", 0, 1)  # the updater here reloads


def test_the_step_delay_makes_each_later_step_wait_and_can_be_lifted(monkeypatch) -> None:
    import time

    monkeypatch.setenv("DELTASYNC_TEST_HOOKS", "1")
    steps: list[float] = []
    worker = TestingWorkerExtension()
    worker.execute_model = lambda output: steps.append(time.perf_counter()) or output  # type: ignore[attr-defined]
    assert worker.deltasync_test_step_delay(0.05) == 0.0
    start = time.perf_counter()
    assert worker.execute_model("out") == "out" and steps[0] - start >= 0.05  # it waited, then ran the step
    assert worker.deltasync_test_step_delay(0) == 0.05  # lifted: the wrapper stays, and waits no more
    start = time.perf_counter()
    worker.execute_model("again")
    assert len(steps) == 2 and steps[1] - start < 0.05
    with pytest.raises(ConfigError, match="a step delay of 2 s: give 0 to 1 s"):
        worker.deltasync_test_step_delay(2)
