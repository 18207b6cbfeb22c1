"""The manifest of a state: its parameters' names, shapes and element dtypes, bound by a digest.

A state's fingerprint hashes element bits only: ``(16,)`` and ``(1, 16)``, or ``(16, 32)`` and
``(32, 16)``, hash alike, and so does a state with an extra empty parameter. The manifest
digest closes that gap. A writer commits it in the pointer (format version 4) and in every
file's metadata; a reader checks that each file names the pointer's digest, computes it again
from every anchor it decodes, and keeps its state on one manifest (a chain that changes
shapes under a reader is refused).

The digest is the SHA-256 of the compact JSON list ``[[name, [dims...], dtype], ...]`` in name
order, with dtypes as safetensors codes (``BF16``, ``F8_E4M3``, ``I8``); see docs/protocol.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence

import torch

from .dtypes import dtype_code

__all__ = ["manifest_digest", "tensors_manifest"]


def manifest_digest(entries: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> str:
    """The digest of a state's ``(name, full shape, element dtype)`` entries (any order)."""
    listed = sorted((name, [int(d) for d in shape], dtype_code(dtype)) for name, shape, dtype in entries)
    names = [item[0] for item in listed]
    if len(set(names)) != len(names):
        raise ValueError("a manifest lists each parameter once")
    body = json.dumps([list(item) for item in listed], separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()


def tensors_manifest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The manifest digest of full tensors (an anchor's, a receiver's state)."""
    return manifest_digest((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
