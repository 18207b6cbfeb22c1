"""The server core without vLLM: with an import hook that makes ``vllm`` unimportable, every
module of ``deltasync`` imports (``deltasync.server`` included), and none of them loads vLLM or
its adapter. Each check runs in a fresh interpreter, so that no module loaded by another test
hides a missing import."""

from __future__ import annotations

import ast
import subprocess
import sys

from servers import REPO_ROOT

#: Installed first in every child: ``vllm`` and ``vllm.*`` raise ImportError, as where vLLM is absent.
NO_VLLM = """
import importlib.abc, sys

class NoVllm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"No module named {name!r} (vLLM is absent in this test)")
        return None

sys.meta_path.insert(0, NoVllm())
for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
    del sys.modules[name]
sys.modules["vllm"] = None  # importlib.util.find_spec("vllm") is None, as where it is not installed
"""

_WALK = NO_VLLM + """
import importlib, pkgutil
import deltasync
failed = {}
for info in pkgutil.walk_packages(deltasync.__path__, "deltasync."):
    if info.name.endswith(".__main__"):  # a program, not a module: importing it runs it
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as exc:
        failed[info.name] = str(exc)
print(sorted(failed.items()))
print(sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in ("vllm", "vllm_ext")))
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)


def test_the_hook_makes_vllm_unimportable():
    proc = _run(NO_VLLM + "\ntry:\n    import vllm\nexcept ImportError as exc:\n    print('refused', exc)\n")
    assert proc.returncode == 0 and proc.stdout.startswith("refused"), proc.stderr[-2000:]


def test_every_module_of_deltasync_imports_without_vllm():
    proc = _run(_WALK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failed, loaded = proc.stdout.splitlines()[-2:]
    # Only the integrations whose extras are not installed here may refuse (none of them is the server core).
    refused = dict(ast.literal_eval(failed))
    assert not [name for name in refused if name.startswith("deltasync.server")], refused
    assert all(name.startswith(("deltasync.trl", "deltasync.examples.wordle")) for name in refused), refused
    assert loaded == "[]", loaded


def test_the_server_core_loads_without_vllm():
    proc = _run(NO_VLLM + "\nimport deltasync.server.updater, deltasync.server.update_route, deltasync.server.seam\n"
                "print('ok')\n")  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_server_cores_unit_tests_pass_without_vllm():
    """tests/unit/server run in a child where vLLM is absent (this module and the fake engine's,
    which make their own such children, left out)."""
    here = "tests/unit/server"
    code = NO_VLLM + (
        "\nimport pytest\nsys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-o', 'addopts=', "
        f"'{here}', '--ignore={here}/test_without_vllm.py', '--ignore={here}/test_fake_engine.py']))\n"
    )
    proc = _run(code)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-2000:]
