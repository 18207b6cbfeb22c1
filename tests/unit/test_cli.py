"""The deltasync command: inspect, verify, stats; errors become exit codes and one-line hints."""

from __future__ import annotations

import pytest
import torch
from helpers import small_transformer, train_step

from deltasync import DeltaPublisher
from deltasync.cli import _human, main


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "bucket"
    model = small_transformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    publisher = DeltaPublisher(path, model, opt, anchor_every=4, anchor_bytes_ratio=0)
    publisher.publish()
    for step in range(5):
        train_step(model, opt, seed=step)
        publisher.publish()
    publisher.close()
    return path


def test_inspect_zstd_delta(bucket, capsys) -> None:
    assert main(["inspect", str(bucket / "deltas/00000005.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "kind         delta" in out and "codec        zstd" in out and "base         4" in out
    assert "model.layers.0.self_attn.q_proj.weight" in out
    assert "gap_lo" in out and "bytes/change" in out


def test_inspect_anchor_in_a_bucket_url(bucket, capsys) -> None:
    assert main(["inspect", f"file://{bucket}/anchors/00000004.safetensors"]) == 0
    out = capsys.readouterr().out
    assert "kind         anchor" in out
    assert "model.embed_tokens.weight" in out and "256x64" in out and "bfloat16" in out


def test_verify_ok_then_names_the_first_bad_version(bucket, tmp_path, capsys) -> None:
    assert main(["verify", str(bucket)]) == 0
    out = capsys.readouterr().out
    # The anchor beside version 4 retired anchor 0: deltas 1..4 stay for followers behind it
    # (checked as files), and the replay starts from anchor 4.
    assert "versions 1..5 (anchors 4)" in out and "ok: 6 versions and anchors verified" in out
    assert "version 3: ok  delta" in out and "(before the oldest anchor: size, SHA-256 and header checked)" in out
    assert "version 4: ok  anchor" in out and "version 5: ok  delta" in out
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(bucket, broken)
    data = bytearray((broken / "deltas/00000005.safetensors").read_bytes())
    data[-1] ^= 1
    (broken / "deltas/00000005.safetensors").write_bytes(bytes(data))
    assert main(["verify", str(broken)]) == 1
    captured = capsys.readouterr()
    assert "version 4: ok" in captured.out
    assert "version 5: BAD:" in captured.out and "SHA-256" in captured.out
    assert "error: the first bad version is 5 (deltas/00000005.safetensors)" in captured.err


def test_stats_and_plot(bucket, tmp_path, capsys) -> None:
    plot = tmp_path / "stats.png"
    assert main(["stats", str(bucket), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()]
    assert lines[0] == ["version", "kind", "bytes", "anchor", "beside", "changed", "publish", "s"]
    rows = [line for line in lines if len(line) >= 5 and line[1] in ("anchor", "delta")]
    assert [r[0] for r in rows] == ["0", "1", "2", "3", "4", "5"]
    # Version 0 has an anchor and no delta; every later one a delta, 4 an anchor beside it.
    assert [r[1] for r in rows] == ["anchor", "delta", "delta", "delta", "delta", "delta"]
    anchor_size = (bucket / "anchors/00000004.safetensors").stat().st_size
    assert [r[4:6] if r[4] != "-" else "-" for r in rows] == ["-"] * 4 + [_human(anchor_size).split()] + ["-"]
    # Written: both anchors (0 is retired, the same size as 4) and the five deltas.
    written = 2 * anchor_size + sum(f.stat().st_size for f in (bucket / "deltas").iterdir())
    assert f"6 versions, {_human(written)} written" in out and "full copies would be" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_errors_are_one_line_hints(tmp_path, capsys) -> None:
    assert main(["verify", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert "no version is committed in this bucket yet" in err
    (tmp_path / "empty").mkdir()
    assert main(["stats", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err == f"error: file://{tmp_path / 'empty'}/latest.json: no version is committed in this bucket yet\n"
    assert main(["inspect", str(tmp_path / "nope.safetensors")]) == 1
    assert "no such file" in capsys.readouterr().err
    assert main(["demo", "--steps", "0", "--output", str(tmp_path / "demo")]) == 1
    assert "--steps must be >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()  # refused before anything was written
    assert main(["stats", "hf://datasets/me/data"]) == 1
    assert "names a dataset repo, not a Hugging Face bucket" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2


def test_verify_checks_every_kept_anchor(tmp_path, capsys) -> None:
    model = torch.nn.Linear(16, 8).to(torch.bfloat16)
    publisher = DeltaPublisher(tmp_path / "b", model, None, anchor_every=2, anchor_bytes_ratio=0, keep_anchors=2)
    publisher.publish()
    for step in range(6):
        with torch.no_grad():
            model.weight.view(-1)[step] += 1
        publisher.publish()
        publisher.flush()
    publisher.close()
    assert [a.version for a in publisher.pointer.anchors] == [4, 6] and publisher.pointer.base == 2
    assert main(["verify", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "versions 3..6 (anchors 4, 6)" in out
    assert "version 4: ok  anchor" in out and "version 6: ok  delta" in out
    assert "anchor 6: ok" in out and f"fingerprint {publisher.fingerprint}" in out
    assert "ok: 6 versions and anchors verified" in out  # deltas 3 and 4, anchor 4, deltas 5 and 6, anchor 6
    data = bytearray((tmp_path / "b/anchors/00000006.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "b/anchors/00000006.safetensors").write_bytes(bytes(data))
    assert main(["verify", str(tmp_path / "b")]) == 1
    captured = capsys.readouterr()
    assert "version 6: ok  delta" in captured.out  # the deltas are fine ...
    assert "anchor 6: BAD:" in captured.out and "SHA-256" in captured.out  # ... the anchor beside is not
    assert "error: the anchor of version 6 is bad (anchors/00000006.safetensors)" in captured.err
    # A delta that only followers replay (before the oldest anchor) is checked too.
    (tmp_path / "b/anchors/00000006.safetensors").write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))
    early = bytearray((tmp_path / "b/deltas/00000003.safetensors").read_bytes())
    early[-1] ^= 1
    (tmp_path / "b/deltas/00000003.safetensors").write_bytes(bytes(early))
    assert main(["verify", str(tmp_path / "b")]) == 1
    captured = capsys.readouterr()
    assert "version 3: BAD:" in captured.out and "SHA-256" in captured.out
    assert "error: the first bad version is 3 (deltas/00000003.safetensors)" in captured.err
