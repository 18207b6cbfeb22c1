"""The demo's summary and plot line, on a made-up run (the real run is tests/integration/trl/test_trainer.py)."""

from __future__ import annotations

import sys

from deltasync.examples.demo import ANCHOR_EVERY, _plot_line, _summary, reward_target_letter


def _run(n: int = 2 * ANCHOR_EVERY + 1):
    """A run whose first version has an anchor only and whose every ANCHOR_EVERY-th version an
    anchor beside its delta (the sizes the bucket's history gives)."""
    history = [
        {"version": v, "kind": "anchor" if v == 0 else "delta", "paused_s": 0.1,
         "nbytes": 1000 if v == 0 else 10, "changed_fraction": 1.0 if v == 0 else 0.03}
        for v in range(n)
    ]  # fmt: skip
    rows = [{"step": v, "reward": 0.1 + 0.01 * v} for v in range(1, n)]
    anchors = {v: 1000 for v in range(0, n, ANCHOR_EVERY)}
    return rows, history, anchors


def test_summary_reports_sparsity_anchors_bytes_and_reward() -> None:
    rows, history, anchors = _run()
    n = len(history)
    text = _summary(rows, history, anchors)
    assert f"versions published: {n}: 1 with an anchor only (the first), {n - 1} deltas; 2 anchors written " in text
    assert f"beside deltas (versions {ANCHOR_EVERY}, {2 * ANCHOR_EVERY}; 2 on the every-{ANCHOR_EVERY} schedule)" in text
    assert "median 3.00% of the bf16 elements" in text
    assert f"({n * 1000 / (3 * 1000 + (n - 1) * 10):.1f}x more)" in text
    first = sum(0.1 + 0.01 * v for v in range(1, 11)) / 10
    last = sum(0.1 + 0.01 * v for v in range(n - 10, n)) / 10
    assert f"reward: {first:.3f} (mean of the first 10 steps) -> {last:.3f} (last 10), +{last - first:.3f}" in text


def test_plot_line_says_when_and_how_the_plot_is_skipped(tmp_path, monkeypatch) -> None:
    rows, history, _ = _run()
    assert _plot_line(rows, history, tmp_path / "a.png") == f"  plot: {tmp_path / 'a.png'}"
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    line = _plot_line(rows, history, tmp_path / "b.png")
    assert "plot skipped: matplotlib is not installed" in line and "pip install" in line
    assert not (tmp_path / "b.png").exists()


def test_reward_is_the_share_of_the_target_letter() -> None:
    assert reward_target_letter(["we", "sun", "", [{"role": "assistant", "content": "Tree!"}]]) == [0.5, 0.0, 0.0, 0.5]


def test_silence_noise_drops_the_known_noise_only(monkeypatch) -> None:
    import logging
    import subprocess
    import warnings

    from deltasync.examples.demo import NOISE, NOISE_LOGS, silence_noise

    environ = {"PYTHONWARNINGS": "default::DeprecationWarning"}
    loggers = [logging.getLogger(name) for name, _ in NOISE_LOGS]
    before = [list(lg.filters) for lg in loggers]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            silence_noise(environ)
            silence_noise(environ)  # twice: the environment lists each option once
            warnings.warn("TRL currently supports vLLM versions from 0.22.0 to 0.31.0. You have 0.32.0", UserWarning, stacklevel=1)
            warnings.warn("another warning", UserWarning, stacklevel=1)
        assert [str(w.message) for w in caught] == ["another warning"]
        records = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        loggers[0].addHandler(handler)
        loggers[0].warning("You are adding a <class 'trl.experimental.async_grpo.X'> to the callbacks")
        loggers[0].warning("something else")
        loggers[0].removeHandler(handler)
        assert [r.getMessage() for r in records] == ["something else"]
    finally:
        for lg, filters in zip(loggers, before):
            lg.filters[:] = filters
    assert environ["PYTHONWARNINGS"] == "default::DeprecationWarning," + ",".join(
        f"ignore:{message}:{category.__name__}" for message, category in NOISE
    )
    # A process started with that environment (TRL's rollout worker) is silent too.
    code = (
        "import warnings; warnings.warn('TRL currently supports vLLM versions from 0.22.0 to 0.31.0', UserWarning); "
        "warnings.warn('kept', UserWarning)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env={**environ, "PATH": ""}, capture_output=True, text=True)
    assert "TRL currently supports" not in proc.stderr and "kept" in proc.stderr
