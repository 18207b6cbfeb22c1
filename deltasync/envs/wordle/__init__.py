"""Deprecated alias of :mod:`deltasync.examples.wordle`, where the Wordle environment now lives."""

from __future__ import annotations

import warnings

from ...examples.wordle import *  # noqa: F403
from ...examples.wordle import __all__  # noqa: F401

warnings.warn(
    "deltasync.envs.wordle moved to deltasync.examples.wordle; import it (or run python -m "
    "deltasync.examples.wordle) from there",
    DeprecationWarning,
    stacklevel=2,
)
