"""The quantized-views benchmark runs end to end (``--quick``), so it cannot rot.

It drives the real publisher with views into a temporary bucket and aborts on any difference
between a view's receiver and compressed-tensors' quantization of the trainer's bf16 state; here
it runs on a tiny model for two versions per trace, and the results must be complete and
consistent with what the run measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("compressed_tensors")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import views


def test_quick_run_measures_every_view_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "views.json", tmp_path / "views.png"
    assert views.main(["--quick", "--out", str(out), "--plot", str(png)]) == 0
    result = json.loads(out.read_text())
    assert png.stat().st_size > 0
    assert result["config"]["views"] == ["FP8_DYNAMIC", "W8A8"]
    assert [t["trace"] for t in result["traces"]] == ["adamw", "sign-momentum"]
    assert result["machine"]["cpus"] >= 1
    for trace in result["traces"]:
        assert len(trace["steps"]) == 2
        assert 0 < trace["quantized_parameters"] < trace["parameters"]
        for rec in trace["steps"]:
            assert rec["changed"] > 0 and rec["bf16_bytes"] > 0
            for v in ("FP8_DYNAMIC", "W8A8"):
                # what shipped splits into the codes-and-scales part and the view's bf16 parameters
                assert 0 < rec[f"{v}.quantized_bytes"] < rec[f"{v}.bytes"]
                assert rec[f"{v}.ratio"] == pytest.approx(rec[f"{v}.bytes"] / rec["bf16_bytes"])
                # a code cannot change where no bf16 element did; some do at these densities
                assert 0 < rec[f"{v}.codes_changed_pct"] < rec["bf16_targets_changed_pct"]
                assert rec[f"{v}.publish_s"] >= rec[f"{v}.quantize_s"] > 0
                assert rec[f"{v}.full_bytes"] > rec[f"{v}.bytes"]
    table = capsys.readouterr().out
    assert "view delta / bf16 delta" in table and "sign-momentum" in table


def test_views_ignore_norms_and_embedding_but_quantize_every_projection() -> None:
    import torch
    from codec import ModelShape, build_model

    from deltasync.trainer.view_targets import quantized_names

    model = views.linearize(build_model(ModelShape().scaled(0.01), torch.Generator().manual_seed(0)))
    names = [n for n, _ in model.named_parameters()]
    got = quantized_names(model, names)
    assert got == {n for n in names if n.endswith("_proj.weight")}
    assert len(got) == 7 * ModelShape().scaled(0.01).layers
