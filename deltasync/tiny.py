"""Deprecated alias of :mod:`deltasync.examples.tiny`, where the tiny-model builder now lives."""

from __future__ import annotations

import warnings

from .examples.tiny import *  # noqa: F403
from .examples.tiny import __all__  # noqa: F401

warnings.warn("deltasync.tiny moved to deltasync.examples.tiny; import it from there", DeprecationWarning, stacklevel=2)
