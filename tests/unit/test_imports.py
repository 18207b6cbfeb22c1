"""How the package imports: the core with only its own dependencies, no cycle, no upward import.

The core is imported by a venv that holds exactly the dependencies ``pip install deltasync``
installs: those of pyproject.toml's ``dependencies``, and theirs, resolved from the installed
distributions' metadata. Installing them afresh (torch included) would take minutes per run,
so the venv links the very installed packages (its site-packages holds a path file to a folder
of symbolic links, one per top-level name of each distribution, plus ``deltasync`` itself).
TRL, transformers, openenv, vLLM and the rest are simply not there.
"""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import os
import re
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from servers import REPO_ROOT

#: What ``pip install deltasync`` does not install (extras: trl, wordle, vllm, plot, views).
OPTIONAL = ("trl", "transformers", "peft", "accelerate", "datasets", "openenv", "vllm", "vllm_ext", "matplotlib",
            "compressed_tensors")

#: Import layers, lowest first: a module may import its own layer and those below, never above.
LAYERS = (
    ("deltasync.errors", "deltasync.protocol.env", "deltasync.protocol.routes", "deltasync.collective",
     "deltasync.trainer.memory"),
    # How many threads the host-side loops use, and a map over threads the caller starts; the
    # names of a registry (the codecs', the view schemes').
    ("deltasync.format.threads", "deltasync.format.registry"),
    # The one table of element types, which the fingerprint hashes by.
    ("deltasync.format.dtypes", "deltasync.format.fingerprint"),
    # The format's foundations: the codecs know no file header, no pointer.
    ("deltasync.format.versions", "deltasync.format.limited_json", "deltasync.format.container",
     "deltasync.format.codecs"),
    ("deltasync.format", "deltasync.protocol.auth", "deltasync.protocol.messages", "deltasync.protocol.lora",
     "deltasync.protocol.token_versions", "deltasync.stores"),
    # The protocol as both sides import it; the foundations of the trainer and reader sides.
    ("deltasync.protocol", "deltasync.trainer.sharded", "deltasync.reader.parts", "deltasync.control.client",
     "deltasync.control.http", "deltasync.control.vllm_routes", "deltasync.control.lora_client",
     "deltasync.trainer.checkpoint_layout", "deltasync.trainer.sources", "deltasync.trainer.ownership",
     "deltasync.trainer.retention"),
    # The commit sequence every chain shares: the bf16 chain's and each view's.
    ("deltasync.trainer.committer",),
    # Quantized views: schemes (compressed-tensors, imported lazily), checkpoint writer, serving.
    ("deltasync.views",),
    ("deltasync.reader.chain", "deltasync.reader.poll"),
    ("deltasync.trainer.scan", "deltasync.trainer.detector", "deltasync.reader.receiver",
     "deltasync.trainer.view_chain", "deltasync.trainer.view_targets"),
    # The publisher's parts: capture, writer, anchor schedule, retention, views.
    ("deltasync.trainer.capture", "deltasync.trainer.writer", "deltasync.trainer.anchors",
     "deltasync.trainer.view_publishing"),
    ("deltasync.reader", "deltasync.trainer.publisher"),
    ("deltasync.trainer", "deltasync.control", "deltasync.export"),
    ("deltasync",),
    # The engine-neutral server core: it imports no engine (vLLM plugs in through its seams).
    ("deltasync.server",),
    # The integrations: each uses the core, neither the other.
    ("deltasync.trl", "vllm_ext"),
    # The commands and the examples.
    ("deltasync.cli", "deltasync.control.serve", "deltasync.examples"),
)  # fmt: skip
_CORE_CHECK = """
import importlib, pkgutil, sys
import deltasync, deltasync.stores, deltasync.cli
# The core and the CLI module load no example (the CLI imports them when it builds its parser).
loaded = sorted(m for m in sys.modules if m.startswith("deltasync.examples"))
assert not loaded, loaded
needs = {}
for info in pkgutil.walk_packages(deltasync.__path__, "deltasync."):
    try:
        importlib.import_module(info.name)
    except ImportError as exc:
        needs[info.name] = str(exc)
print(sorted(needs.items()))
print(sorted(name for name in sys.modules if name.split(".")[0] in OPTIONAL))
try:
    deltasync.cli.main(["--help"])
except SystemExit as exc:
    assert exc.code == 0, exc.code
"""


def _core_distributions() -> set[str]:
    """The distributions ``pip install deltasync`` installs: the closure of the core dependencies
    (markers evaluated here, extras of dependencies left out)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    found: set[str] = set()
    while todo:
        req = todo.pop()
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        found.add(name)
        todo += [Requirement(r) for r in metadata.requires(req.name) or []]
    return found


@pytest.fixture(scope="module")
def core_python(tmp_path_factory) -> str:
    """A venv's python that can import deltasync and its core dependencies, and nothing else."""
    root = tmp_path_factory.mktemp("core-venv")
    links = root / "site"
    links.mkdir()
    for name in _core_distributions():
        dist = metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            source = Path(dist.locate_file(top))
            if source.exists() and not (links / top).exists() and top != "__pycache__":
                (links / top).symlink_to(source)
    (links / "deltasync").symlink_to(REPO_ROOT / "deltasync")
    venv.create(root / "venv", with_pip=False)
    python = root / "venv" / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "deltasync-core.pth").write_text(f"{links}\n")
    return str(python)


def test_the_core_imports_in_a_venv_of_only_its_dependencies(core_python) -> None:
    # The venv lacks every optional package, and its interpreter sees no other site-packages.
    probe = "import importlib.util as u; print([m for m in OPTIONAL if u.find_spec(m)])"
    check = subprocess.run([core_python, "-c", f"OPTIONAL = {OPTIONAL!r}\n{probe}"], capture_output=True, text=True,
                           cwd="/", timeout=600)  # fmt: skip
    assert check.returncode == 0 and check.stdout.strip() == "[]", (check.stdout, check.stderr[-2000:])
    proc = subprocess.run([core_python, "-c", f"OPTIONAL = {OPTIONAL!r}\n{_CORE_CHECK}"], capture_output=True,
                          text=True, cwd="/", timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    needs = dict(ast.literal_eval(proc.stdout.splitlines()[0]))
    assert ast.literal_eval(proc.stdout.splitlines()[1]) == []  # nothing optional was found anyway
    # Only the integrations that are their extras refuse (the Wordle example), and they say which extra.
    assert sorted(needs) == ["deltasync.examples.wordle", "deltasync.trl"], needs
    assert "pip install 'deltasync[wordle]'" in needs["deltasync.examples.wordle"]
    assert all(f"    {command} " in proc.stdout for command in ("inspect", "demo", "serve", "spaces"))  # the CLI's help


def _modules() -> dict[str, Path]:
    found = {}
    for package in ("deltasync", "vllm_ext"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Every module of ours that ``name`` imports anywhere (top level, TYPE_CHECKING, functions): line."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], *filter(None, [base])])
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                found.setdefault(target, node.lineno)
    return found


def _graph() -> dict[str, dict[str, int]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_import_cycle() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while component[-1:] != [v]:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert not cycles, cycles


def _layer(name: str) -> int:
    best = max((p for layer in LAYERS for p in layer if name == p or name.startswith(p + ".")), key=len)
    assert best != "deltasync" or name == "deltasync", f"{name} is in no layer: add it to LAYERS"
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def _integration(name: str) -> str | None:
    return next((p for p in ("vllm_ext", "deltasync.trl") if name == p or name.startswith(p + ".")), None)


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    graph = _graph()
    upward = [
        f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)}) on line {line}"
        for name, targets in graph.items()
        for target, line in targets.items()
        if _layer(target) > _layer(name) and not target.startswith(name + ".")  # a package's own modules
    ]
    crossed = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        for target in targets
        if {_integration(name), _integration(target)} == {"vllm_ext", "deltasync.trl"}
    ]
    assert not upward and not crossed, upward + crossed


# The trainer's packages of deltasync (its weights and its client): a vLLM worker loads none of them.
TRAINER_SIDE = ("deltasync.trainer", "deltasync.control", "deltasync.trl")


def test_import_vllm_ext_loads_no_trainer_side_module_and_patches_nothing() -> None:
    """``import vllm_ext`` (what a worker does through the worker extension) loads deltasync's
    reader, format and protocol, never its publisher, detector or LoRA sources; and it leaves
    vLLM's CPU GEMM dispatch alone even with the switch on (the plugin entry point installs it)."""
    pytest.importorskip("vllm")
    probe = (
        "import sys, vllm_ext\n"
        "from vllm.model_executor.layers import utils\n"
        f"print(sorted(m for m in sys.modules for t in {TRAINER_SIDE!r} if m == t or m.startswith(t + '.')))\n"
        "print(utils.dispatch_cpu_unquantized_gemm.__name__)\n"
        "from vllm_ext._plain_gemm import plain_gemm_enabled\n"
        "print(plain_gemm_enabled())\n"
        "vllm_ext.register()\n"
        "installed = utils.dispatch_cpu_unquantized_gemm\n"
        "vllm_ext.register()  # again: what is installed stays, not wrapped twice\n"
        "print(utils.dispatch_cpu_unquantized_gemm.__name__, utils.dispatch_cpu_unquantized_gemm is installed)\n"
        "print(plain_gemm_enabled())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "DELTASYNC_CPU_PLAIN_GEMM": "1"}
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded, before, enabled_before, after, enabled = proc.stdout.splitlines()[-5:]
    assert loaded == "[]", loaded
    assert (before, enabled_before) == ("dispatch_cpu_unquantized_gemm", "False")
    assert (after, enabled) == ("dispatch_plain_gemm True", "True")


def test_vllm_ext_uses_only_public_names_of_deltasync() -> None:
    """The server side imports deltasync's declared surface: no module or name of it that starts
    with an underscore (the protocol, the reader, the format and the errors are public)."""
    private = []
    for path in sorted((REPO_ROOT / "vllm_ext").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "deltasync":
                names = [node.module or "", *(a.name for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "deltasync"]
            else:
                continue
            if any(part.startswith("_") for name in names for part in name.split(".")):
                private.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not private, private
