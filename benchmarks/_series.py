"""Results drawn side by side: a run's own and earlier ones given as ``label=path`` (a benchmark's
``--compare``), for the scripts that compare commits by running each on ``PYTHONPATH``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["series"]


def series(result: dict[str, Any], label: str | None, compare: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``result`` under ``label`` (default: the folder of the package it ran), then each
    ``label=path`` (or ``path``, labelled by its file name) of ``compare``."""
    out = [(label or Path(result["package"]).parent.name, result)]
    for item in compare:
        name, _, path = item.rpartition("=")
        out.append((name or Path(path).stem, json.loads(Path(path).read_text())))
    return out
