"""The format's name and version numbers, shared by the pointer and the file headers."""

from __future__ import annotations

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "PARTS_FORMAT_VERSION",
    "CHAIN_FORMAT_VERSION",
    "MANIFEST_FORMAT_VERSION",
    "READABLE_FORMAT_VERSIONS",
    "READABLE_FILE_FORMAT_VERSIONS",
]

FORMAT_NAME = "deltasync"
FORMAT_VERSION = 1
PARTS_FORMAT_VERSION = 2
"""The format version of a version split into several part files (one per sharded writer)."""
CHAIN_FORMAT_VERSION = 3
"""The pointer's format version since anchors are written beside deltas (files keep 1 and 2)."""
MANIFEST_FORMAT_VERSION = 4
"""The pointer's format version since it commits the state's manifest digest (names, shapes
and dtypes; the files carry it too, and keep their format versions 1 and 2)."""
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, PARTS_FORMAT_VERSION, CHAIN_FORMAT_VERSION, MANIFEST_FORMAT_VERSION)
"""Pointer format versions a reader implements."""
READABLE_FILE_FORMAT_VERSIONS = (FORMAT_VERSION, PARTS_FORMAT_VERSION)
"""File format versions a reader implements (the files of format 3 and 4 buckets are 1 and 2)."""
