"""The examples moved under ``deltasync.examples``; their old paths still work and warn."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import warnings
from types import ModuleType

import pytest
from servers import REPO_ROOT

import deltasync
import deltasync._errors
import deltasync.examples


def _import_fresh(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import ``name`` as if for the first time (its warning is issued once per process otherwise);
    the modules and attributes it replaces come back after the test."""
    for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, loaded)
    parent, _, child = name.rpartition(".")
    with warnings.catch_warnings(action="ignore", category=DeprecationWarning):  # deltasync.envs's own
        monkeypatch.delattr(importlib.import_module(parent), child, raising=False)
    return importlib.import_module(name)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("deltasync.tiny", "deltasync.examples.tiny"),
        ("deltasync._server", "deltasync.examples.launcher"),
        ("deltasync.envs.wordle", "deltasync.examples.wordle"),
    ],
)
def test_an_old_module_warns_and_re_exports_the_new_one(old: str, new: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.warns(DeprecationWarning, match=f"^{re.escape(old)} moved to {re.escape(new)}; import it"):
        module = _import_fresh(old, monkeypatch)
    target = importlib.import_module(new)
    assert module.__all__ == target.__all__
    for name in target.__all__:
        assert getattr(module, name) is getattr(target, name), name


def test_deltasync_envs_warns_and_loads_the_wordle_names_on_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "deltasync.envs.wordle", raising=False)
    with pytest.warns(DeprecationWarning, match=r"^deltasync\.envs moved to deltasync\.examples \(the Wordle"):
        envs = _import_fresh("deltasync.envs", monkeypatch)
    assert "deltasync.envs.wordle" not in sys.modules  # nothing loaded yet
    wordle = importlib.import_module("deltasync.examples.wordle")
    assert envs.__all__ == wordle.__all__
    for name in wordle.__all__:
        assert getattr(envs, name) is getattr(wordle, name), name
    namespace: dict[str, object] = {}
    exec("from deltasync.envs import *", namespace)
    assert namespace["WordleClient"] is wordle.WordleClient
    for missing in ("nope", "_rules", "wordle"):  # "wordle" is the alias subpackage, imported on its own
        with pytest.raises(AttributeError, match=f"no attribute '{missing}'"):
            getattr(envs, missing)


def test_python_m_deltasync_envs_wordle_still_runs_the_server_and_says_where_it_went() -> None:
    proc = subprocess.run([sys.executable, "-m", "deltasync.envs.wordle", "--help"], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m deltasync.examples.wordle ")
    assert ("DeprecationWarning: python -m deltasync.envs.wordle is deprecated: run python -m "
            "deltasync.examples.wordle") in proc.stderr  # fmt: skip


def test_the_examples_errors_are_deltasync_errors_and_not_the_cores() -> None:
    for name in deltasync.examples.__all__:
        error = getattr(deltasync.examples, name)
        assert issubclass(error, deltasync.DeltaSyncError), name
        assert not hasattr(deltasync._errors, name), name
    from deltasync.examples.launcher import ServerError, VLLMServerError
    from deltasync.examples.wordle import WordleRequestError, WordleServerError

    assert (ServerError, VLLMServerError, WordleRequestError, WordleServerError) == tuple(
        getattr(deltasync.examples, name) for name in deltasync.examples.__all__
    )
