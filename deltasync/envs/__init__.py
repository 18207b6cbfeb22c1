"""Deprecated alias: the Wordle environment moved to :mod:`deltasync.examples.wordle`.

``deltasync.envs.NAME`` loads ``deltasync.examples.wordle`` on first use, as before, so
``import deltasync.envs`` alone needs nothing more; ``deltasync.envs.wordle`` re-exports it.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

warnings.warn(
    "deltasync.envs moved to deltasync.examples (the Wordle environment: deltasync.examples.wordle); "
    "import it from there",
    DeprecationWarning,
    stacklevel=2,
)


def __getattr__(name: str) -> Any:
    # Public names (and __all__) come from the Wordle package, imported on first use; a
    # submodule's name falls through to the import system.
    if name == "__all__" or not (name.startswith("_") or name == "wordle"):
        wordle = importlib.import_module("deltasync.examples.wordle")
        if name == "__all__" or name in wordle.__all__:
            return getattr(wordle, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
