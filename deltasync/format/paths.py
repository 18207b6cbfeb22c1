"""The paths of a bucket's files: the pointer, the history, the data files and the views' folders.

docs/protocol.md lays the bucket out; nothing else in deltasync spells these paths.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import FormatError

__all__ = [
    "POINTER_PATH",
    "HISTORY_PATH",
    "CLAIM_PATH",
    "DATA_PATH_RE",
    "VERSIONED_PATH_RE",
    "anchor_path",
    "delta_path",
    "part_path",
    "data_path_version",
    "VIEWS_PREFIX",
    "VIEW_NAME_RE",
    "view_prefix",
    "view_names",
]

POINTER_PATH = "latest.json"
HISTORY_PATH = "history.jsonl"
CLAIM_PATH = "writer.json"
"""A new chain's claim: the writer that is about to commit the first version into a bucket
that has no pointer yet (created only if absent; deleted once the pointer names that writer)."""

_VERSIONED = r"(?:anchors|deltas)/([0-9]{8,16})"
DATA_PATH_RE = re.compile(_VERSIONED + r"(?:\.part[0-9]+)?\.safetensors\Z", re.ASCII)
"""The path of a data file (an anchor or a delta, whole or a part; see :func:`anchor_path`,
:func:`delta_path`, :func:`part_path`): group 1 is its version. Nothing else in a bucket is
an anchor or a delta, and nothing else is ever deleted by retention."""
VERSIONED_PATH_RE = re.compile(_VERSIONED + r"[.]", re.ASCII)
"""The start of a data file's path, up to its version (checked before the whole path)."""


def anchor_path(version: int) -> str:
    return f"anchors/{version:08d}.safetensors"


def delta_path(version: int) -> str:
    return f"deltas/{version:08d}.safetensors"


def part_path(kind: str, version: int, part: int) -> str:
    """Part ``part`` of a version written by several writers (format version 2)."""
    return f"{kind}s/{version:08d}.part{part}.safetensors"


def data_path_version(path: str) -> int | None:
    """The version of a data file (:data:`DATA_PATH_RE`); None for any other path."""
    match = DATA_PATH_RE.match(path)
    return None if match is None else int(match.group(1))


VIEWS_PREFIX = "views/"
"""The folder of the bucket that holds one folder per view (``views/FP8_DYNAMIC/``)."""
VIEW_NAME_RE = re.compile(r"[A-Z0-9_]{1,64}\Z", re.ASCII)
"""A view's name: a compressed-tensors preset scheme name."""


def view_prefix(name: str) -> str:
    """The folder of view ``name`` in a bucket."""
    if not isinstance(name, str) or not VIEW_NAME_RE.match(name):
        raise FormatError(f"view name {name!r} is not a scheme name (upper-case letters, digits and '_')")
    return f"{VIEWS_PREFIX}{name}/"


def view_names(store: Any) -> list[str]:
    """The views a bucket holds (those with a committed pointer), sorted."""
    found = set()
    for path in store.list(VIEWS_PREFIX):
        parts = path[len(VIEWS_PREFIX) :].split("/")
        if len(parts) == 2 and parts[1] == POINTER_PATH and VIEW_NAME_RE.match(parts[0]):
            found.add(parts[0])
    return sorted(found)
