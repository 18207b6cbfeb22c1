"""scripts/vllm_api_diff.py on two made-up wheels (the README's vLLM 0.32/0.33 check runs it on the real ones)."""

from __future__ import annotations

import importlib.util
import zipfile

from servers import REPO_ROOT

spec = importlib.util.spec_from_file_location("vllm_api_diff", REPO_ROOT / "scripts" / "vllm_api_diff.py")
vllm_api_diff = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vllm_api_diff)  # type: ignore[union-attr]


def _wheel(path, sources: dict[str, str]):
    with zipfile.ZipFile(path, "w") as wheel:
        for name, text in sources.items():
            wheel.writestr(f"vllm/{name}", text)
    return path


def test_each_symbol_is_same_changed_or_missing(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(vllm_api_diff, "SYMBOLS", {"g": [("a.py", "A.f"), ("a.py", "g"), ("a.py", "h"), ("b.py", "k")]})
    old = _wheel(tmp_path / "old.whl", {"a.py": "class A:\n    def f(self):\n        return 1\ndef g():\n    pass\ndef h():\n    pass\n"})
    new = _wheel(tmp_path / "new.whl", {"a.py": "class A:\n    def f(self):\n        return 2\ndef g():\n    pass\n"})
    assert vllm_api_diff.main([str(old), str(new), "--diff"]) == 0
    out = capsys.readouterr().out
    assert "CHANGED      a.py::A.f\n" in out and "-        return 1\n+        return 2\n" in out
    assert "same         a.py::g\n" in out and "MISSING-new  a.py::h\n" in out and "MISSING-old  b.py::k\n" in out
    assert out.endswith("3 of 4 symbols differ\n")
