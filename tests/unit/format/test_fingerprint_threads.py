"""The fingerprint of host values spread over threads: the same sums for any thread count and
any piece size (against one thread and against the definition), threads started in the calling
thread and gone with the call, and a bad DELTASYNC_HASH_THREADS refused by name."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from format_example import bf16, random_bits, ref_fingerprint
from helpers import record_thread_starts

import deltasync.format.fingerprint as F
from deltasync import ConfigError
from deltasync.format.fingerprint import fingerprint, fingerprint_share, fingerprint_slice_share, fingerprint_update

# NaN payloads, -0.0, infinities, subnormals: bits a float path would not keep.
SPECIAL = [0x7FC1, 0xFFFF, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7F81]


def values(seed: int, n: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    bits = np.array(random_bits(rng, n))
    bits[rng.integers(0, n, size=min(n, 50))] = rng.choice(SPECIAL, size=min(n, 50))
    return bf16(bits.tolist())


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 1000 elements (not a multiple of the 65536-element chunk), so that a few
    thousand elements spread over many pieces and threads."""
    monkeypatch.setattr(F, "SPREAD", 1000)


@pytest.mark.parametrize("n", [1, 1999, 2000, 2001, 7777, 70_001])
def test_a_share_is_the_same_over_any_number_of_threads(small_pieces, n: int) -> None:
    x = values(n, n)
    one = F._tensor_sum("layer.weight", x, 123, workers=1)
    assert all(F._tensor_sum("layer.weight", x, 123, workers=w) == one for w in (2, 3, 8))
    # ... and it is the definition's: the state of one tensor at offset 0
    assert F.format_fingerprint(F._tensor_sum("layer.weight", x, 0, workers=3)) == ref_fingerprint({"layer.weight": x})
    # a device hasher (torch int64 arithmetic, another implementation) agrees
    hasher = F.DeviceHasher(torch.device("cpu"))
    hasher.add_slice("layer.weight", x, 123)
    assert hasher.value() == one


@pytest.mark.parametrize("n", [3, 2500, 40_000])
def test_moves_and_shares_at_indices_are_the_same_over_any_number_of_threads(small_pieces, n: int) -> None:
    rng = np.random.default_rng(n)
    index = torch.from_numpy(np.sort(rng.choice(10 * n, size=n, replace=False)).astype(np.int64))
    old, new = values(1, n), values(2, n)
    moves = {w: F._move("w", index, old, new, workers=w) for w in (1, 2, 5)}
    assert len(set(moves.values())) == 1
    sums = {w: F._hash_sum("w", F._index_u64(index), F._bits_u16(new), workers=w) for w in (1, 4)}
    assert len(set(sums.values())) == 1 and sums[1] == fingerprint_share("w", index, new)
    # a move is the new share minus the old, as a device hasher (another implementation) has it
    assert moves[1] == (fingerprint_share("w", index, new) - fingerprint_share("w", index, old)) & F._MASK
    hasher = F.DeviceHasher(torch.device("cpu"))
    hasher.add("w", index, new)
    hasher.add("w", index, old, sign=-1)
    assert hasher.value() == moves[1]


def test_a_large_state_hashes_to_its_definition_over_threads(small_pieces, monkeypatch) -> None:
    state = {"a.weight": values(3, 5_000).reshape(50, 100), "b.bias": values(4, 7), "c.weight": values(5, 12_345)}
    monkeypatch.setenv("DELTASYNC_HASH_THREADS", "3")
    fp = fingerprint(state)
    assert fp == ref_fingerprint(state)
    shares = sum(fingerprint_slice_share("c.weight", state["c.weight"][lo : lo + 4000], lo) for lo in range(0, 12_345, 4000))
    rest = F._tensor_sum("a.weight", state["a.weight"]) + F._tensor_sum("b.bias", state["b.bias"])
    assert F.format_fingerprint(shares + rest) == fp
    changed = state["c.weight"].clone()
    index = torch.arange(0, 12_345, 3)
    changed[index] = values(6, index.numel())
    after = fingerprint_update(fp, "c.weight", index, state["c.weight"][index], changed[index])
    assert after == ref_fingerprint({**state, "c.weight": changed})


def test_hash_threads_start_in_the_calling_thread_and_end_with_the_call(small_pieces, monkeypatch) -> None:
    started = record_thread_starts(monkeypatch)
    F._tensor_sum("w", values(7, 9000), workers=3)
    assert len(started) == 3 and all(s.startswith("deltasync-hash") and s.endswith("from MainThread") for s in started)
    assert not [t for t in threading.enumerate() if t.name.startswith("deltasync-hash")]
    started.clear()
    F._tensor_sum("w", values(7, 2000), workers=3)  # two pieces' worth or less: hashed here
    assert not started


def test_the_hash_thread_count_comes_from_the_environment_or_the_cpus(monkeypatch) -> None:
    monkeypatch.setenv("DELTASYNC_HASH_THREADS", "5")
    assert F.hash_threads() == 5
    for bad in ("0", "-1", "two", "1.5"):
        monkeypatch.setenv("DELTASYNC_HASH_THREADS", bad)
        with pytest.raises(ConfigError, match="DELTASYNC_HASH_THREADS must be a whole number of threads"):
            F.hash_threads()
    monkeypatch.delenv("DELTASYNC_HASH_THREADS")
    assert F.hash_threads() >= 1
