"""Deprecated alias of :mod:`deltasync.examples.launcher`, where the process launcher now lives."""

from __future__ import annotations

import warnings

from .examples.launcher import *  # noqa: F403
from .examples.launcher import __all__  # noqa: F401

warnings.warn(
    "deltasync._server moved to deltasync.examples.launcher; import it from there", DeprecationWarning, stacklevel=2
)
