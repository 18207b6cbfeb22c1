"""An order-independent 64-bit fingerprint of a bf16 state that updates in O(changed).

The fingerprint of a state is the sum, modulo 2**64, of one 64-bit hash per element:

    h(name, index, bits) = mix64(((index << 16) | bits) XOR seed(name))

where ``bits`` is the element's bf16 bit pattern as an unsigned 16-bit integer, ``seed(name)``
is the first 8 bytes of BLAKE2b(name, digest_size=8) read little-endian, and ``mix64`` is the
xor-shift-multiply finaliser documented in docs/protocol.md. A sum does not depend on the
order of parameters or elements, and changing elements ``I`` of parameter ``n`` from ``old`` to
``new`` moves it by ``sum h(n, I, new) - sum h(n, I, old)``: both sides of a sync keep it
current at the cost of the changed elements only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch

__all__ = [
    "fingerprint",
    "fingerprint_add",
    "fingerprint_share",
    "fingerprint_slice_share",
    "fingerprint_update",
    "format_fingerprint",
    "parse_fingerprint",
]

_MASK = (1 << 64) - 1
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 18


def _seed(name: str) -> np.uint64:
    return np.uint64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def _bits_u16(values: torch.Tensor) -> np.ndarray:
    if values.dtype != torch.bfloat16:
        values = values.to(torch.bfloat16)
    return values.detach().reshape(-1).cpu().contiguous().view(torch.int16).numpy().view(np.uint16)


def _hash_sum(seed: np.uint64, index: np.ndarray, bits: np.ndarray) -> int:
    """Sum of element hashes (mod 2**64) for uint64 ``index`` and uint16 ``bits`` arrays."""
    x = (index.astype(np.uint64) << np.uint64(16)) | bits.astype(np.uint64)
    x ^= seed
    x ^= x >> np.uint64(30)
    x *= _C1
    x ^= x >> np.uint64(27)
    x *= _C2
    x ^= x >> np.uint64(31)
    return int(np.add.reduce(x, dtype=np.uint64))


def _tensor_sum(name: str, values: torch.Tensor, offset: int = 0) -> int:
    bits = _bits_u16(values)
    seed = _seed(name)
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, bits.size, _CHUNK):
            chunk = bits[start : start + _CHUNK]
            index = np.arange(offset + start, offset + start + chunk.size, dtype=np.uint64)
            total = (total + _hash_sum(seed, index, chunk)) & _MASK
    return total


def format_fingerprint(value: int) -> str:
    """The wire form: 16 lower-case hex digits."""
    return f"{value & _MASK:016x}"


def parse_fingerprint(text: str) -> int:
    if not isinstance(text, str) or len(text) != 16:
        raise ValueError(f"a fingerprint is 16 hex digits, got {text!r}")
    return int(text, 16)


def fingerprint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Fingerprint of a full state (name -> tensor), hashed as bf16.

    Tensors of another floating dtype are rounded to bf16 first, so a trainer can pass fp32
    master weights and get the fingerprint of the bf16 weights a server runs.
    """
    total = 0
    for name, tensor in state_dict.items():
        total = (total + _tensor_sum(name, tensor)) & _MASK
    return format_fingerprint(total)


def fingerprint_slice_share(name: str, values: torch.Tensor, offset: int) -> int:
    """The hashes of a contiguous flat slice of ``name`` starting at ``offset``, summed mod 2**64.

    A state split into slices has as its fingerprint the sum of its slices' shares: this is
    how sharded writers each hash only what they hold.
    """
    return _tensor_sum(name, values, offset)


def fingerprint_update(
    value: str,
    name: str,
    index: torch.Tensor,
    old: torch.Tensor,
    new: torch.Tensor,
) -> str:
    """The fingerprint after elements ``index`` of ``name`` change from ``old`` to ``new``."""
    if index.numel() == 0:
        return value
    idx = index.detach().reshape(-1).cpu().numpy().astype(np.uint64)
    seed = _seed(name)
    with np.errstate(over="ignore"):
        added = _hash_sum(seed, idx, _bits_u16(new))
        removed = _hash_sum(seed, idx, _bits_u16(old))
    return format_fingerprint(parse_fingerprint(value) + added - removed)


def fingerprint_share(name: str, index: torch.Tensor, values: torch.Tensor) -> int:
    """The part of the fingerprint sum that elements ``index`` of ``name`` contribute (mod 2**64).

    A state split across processes (tensor-parallel shards) hashes as the sum of its
    parts' shares, provided every element is counted in exactly one part.
    """
    if index.numel() == 0:
        return 0
    idx = index.detach().reshape(-1).cpu().numpy().astype(np.uint64)
    bits = _bits_u16(values)
    seed = _seed(name)
    total = 0
    with np.errstate(over="ignore"):
        for start in range(0, bits.size, _CHUNK):
            total = (total + _hash_sum(seed, idx[start : start + _CHUNK], bits[start : start + _CHUNK])) & _MASK
    return total


def fingerprint_add(value: str | int, *shares: int) -> str:
    """``value`` (a fingerprint, or 0) moved by ``shares`` (sums of element hashes, may be negative)."""
    total = parse_fingerprint(value) if isinstance(value, str) else int(value)
    for share in shares:
        total += share
    return format_fingerprint(total)
