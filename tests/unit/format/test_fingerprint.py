"""The fingerprint (deltasync/format/fingerprint.py): golden values, its documented definition, and its
properties."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from format_example import (
    bf16,
    apply,
    example_state,
    example_changes,
    ref_seed,
    ref_mix64,
    ref_fingerprint,
    random_bits,
)
from format_golden import FP0, FP1

from deltasync.format.fingerprint import fingerprint, fingerprint_update


def test_fingerprint_golden() -> None:
    state = example_state()
    assert fingerprint(state) == FP0
    assert fingerprint(apply(state, example_changes())) == FP1
    assert ref_seed("model.norm.weight") == 0x3BBD05D3E6D4D252
    assert ref_seed("model.proj.weight") == 0x45D35D8BF4389C77
    # mix64 is SplitMix64's output function: its first output from seed 0 is a known value.
    assert ref_mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def random_state(seed: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    return {name: bf16(random_bits(rng, int(np.prod(shape)))).reshape(shape) for name, shape in shapes.items()}


SHAPES = {"embed.weight": (64, 8), "layers.0.mlp.weight": (16, 16), "norm.weight": (8,), "tiny": (1,)}


def test_fingerprint_matches_its_definition() -> None:
    for state in (example_state(), random_state(0, SHAPES)):
        assert fingerprint(state) == ref_fingerprint(state)


def test_fingerprint_does_not_depend_on_order() -> None:
    state = random_state(1, SHAPES)
    forward = fingerprint(state)
    assert fingerprint(dict(reversed(list(state.items())))) == forward
    halves = [dict(list(state.items())[:2]), dict(list(state.items())[2:])]
    total = (int(fingerprint(halves[0]), 16) + int(fingerprint(halves[1]), 16)) % 2**64
    assert f"{total:016x}" == forward


def test_fingerprint_incremental_update_equals_full_recompute() -> None:
    state = random_state(2, SHAPES)
    value = fingerprint(state)
    rng = np.random.default_rng(2)
    for _ in range(5):
        for name in reversed(list(state)):
            flat = state[name].view(-1)
            index = torch.from_numpy(np.flatnonzero(rng.random(flat.numel()) < 0.3))
            new = bf16(random_bits(rng, index.numel()))
            value = fingerprint_update(value, name, index, flat[index].clone(), new)
            flat[index] = new
            assert value == fingerprint(state)
    assert fingerprint_update(value, "norm.weight", torch.tensor([], dtype=torch.int64), bf16([]), bf16([])) == value


def test_fingerprint_is_bit_exact() -> None:
    plus = {"w": bf16([0x0000, 0x3F80])}
    minus = {"w": bf16([0x8000, 0x3F80])}
    assert fingerprint(plus) != fingerprint(minus)  # +0.0 == -0.0 as numbers, not as bits
    assert fingerprint({"w": bf16([0x7FC0])}) != fingerprint({"w": bf16([0x7FC1])})  # NaN payloads
    assert fingerprint({"w": bf16([1, 2])}) != fingerprint({"w": bf16([2, 1])})  # positions
    assert fingerprint({"w": bf16([1])}) != fingerprint({"v": bf16([1])})  # names
    assert fingerprint({"w": bf16([0])}) != fingerprint({})  # a zero element still counts
    assert fingerprint({}) == "0000000000000000"


def test_fingerprint_hashes_other_dtypes_as_their_bf16_rounding() -> None:
    fp32 = torch.tensor([1.0 + 2**-9, -3.14159, 1e-40])
    assert fingerprint({"w": fp32}) == fingerprint({"w": fp32.to(torch.bfloat16)})
    assert fingerprint({"w": fp32.reshape(3, 1)}) == fingerprint({"w": fp32})  # shapes are not hashed


def test_moves_hashed_together_sum_to_each_tensors_move_and_to_the_definition() -> None:
    """``fingerprint_moves`` hashes small host changes of many tensors together: batches cut
    inside and between tensors, a large tensor hashed alone, an empty one, -0.0 and NaN
    payloads, one-byte codes, indices far past 2**32."""
    from format_example import MASK64

    from deltasync.format.fingerprint import _CHUNK, fingerprint_move, fingerprint_moves

    rng = np.random.default_rng(7)
    moves = []
    for k, n in enumerate([1, 3, 0, 700, _CHUNK - 1, 2, _CHUNK, 5, 40000, 30000, 1]):
        index = torch.from_numpy(rng.integers(0, 1 << 40, size=n))
        moves.append((f"layers.{k}.w", index, bf16(random_bits(rng, n)), bf16(random_bits(rng, n))))
    special = ("nan.w", torch.tensor([0, 5, 1 << 33]), bf16([0x0000, 0x7FC1, 0x3F80]), bf16([0x8000, 0x7FC2, 0x3F81]))
    codes = ("view.codes", torch.tensor([1, 2, 3]), torch.tensor([1, -2, 127], dtype=torch.int8),
             torch.tensor([0, -128, 5], dtype=torch.int8))  # fmt: skip
    moves += [special, codes]
    want = sum(fingerprint_move(name, index, old, new) for name, index, old, new in moves) & MASK64
    assert fingerprint_moves(moves) == want
    assert fingerprint_moves(reversed(moves)) == want
    assert fingerprint_moves([]) == 0

    name, index, old, new = special
    seed = ref_seed(name)
    by_definition = sum(
        ref_mix64(((i << 16) | n) ^ seed) - ref_mix64(((i << 16) | o) ^ seed)
        for i, o, n in zip(index.tolist(), [0x0000, 0x7FC1, 0x3F80], [0x8000, 0x7FC2, 0x3F81])
    )
    assert fingerprint_moves([special]) == by_definition & MASK64

    with pytest.raises(ValueError, match="nan.w: 3 indices, 2 new and 3 old values"):
        fingerprint_moves([moves[0], (name, index, old, new[:2])])


def test_slices_hashed_together_sum_to_each_slices_share_and_to_the_definition() -> None:
    """``fingerprint_slices`` hashes small host slices of many tensors together (each element
    keyed with its own name's seed, batches cut between slices): a large slice alone, an empty
    one, -0.0 and NaN payloads, one-byte codes, float32 values (their bf16 rounding), offsets
    far past 2**32, and the same name twice (two slices of one tensor)."""
    from format_example import MASK64

    from deltasync.format.fingerprint import _CHUNK, fingerprint_slice_share, fingerprint_slices

    rng = np.random.default_rng(11)
    slices = []
    for k, n in enumerate([1, 3, 0, 700, _CHUNK - 1, 2, _CHUNK, 5, 40000, 30000, 1, 3 * _CHUNK + 7]):
        slices.append((f"layers.{k}.w", bf16(random_bits(rng, n)), int(rng.integers(0, 1 << 40))))
    slices += [
        ("layers.0.w", bf16(random_bits(rng, 9)), 1),  # the first slice's name again, next to it
        ("view.codes", torch.tensor([1, 255, 0, 7], dtype=torch.uint8).view(torch.float8_e4m3fn), 3),
        ("wide", torch.tensor([1.0 + 2**-9, -3.14159, 1e-40]), 0),
    ]
    special = ("nan.w", bf16([0x0000, 0x8000, 0x7FC1, 0xFFC1]), (1 << 33) - 2)
    slices.append(special)
    want = sum(fingerprint_slice_share(name, values, offset) for name, values, offset in slices) & MASK64
    assert fingerprint_slices(slices) == want
    assert fingerprint_slices(reversed(slices)) == want
    assert fingerprint_slices([]) == 0

    name, _, offset = special
    seed = ref_seed(name)
    by_definition = sum(ref_mix64((((offset + j) << 16) | b) ^ seed) for j, b in enumerate([0x0000, 0x8000, 0x7FC1, 0xFFC1]))
    assert fingerprint_slices([special]) == by_definition & MASK64
    assert fingerprint_slices([("wide", slices[-2][1], 0)]) == fingerprint_slice_share("wide", slices[-2][1].to(torch.bfloat16), 0)


def test_a_move_in_runs_is_the_move_of_each_run() -> None:
    """``fingerprint_runs_move``: consecutive runs of one set of changes, each its own name's
    (empty runs among them), hashed in one round, sum to each run's move; counts that do not
    cover the changes are refused."""
    from deltasync.format.fingerprint import fingerprint_move, fingerprint_runs_move

    rng = np.random.default_rng(3)
    counts = [5, 0, 1, 70000, 3, 0]
    names = [f"experts.{k}.w" for k in range(len(counts))]
    n = sum(counts)
    index = torch.from_numpy(rng.integers(0, 1 << 35, size=n))
    old, new = bf16(random_bits(rng, n)), bf16(random_bits(rng, n))
    ends = np.cumsum(counts).tolist()
    want = sum(fingerprint_move(name, index[e - c : e], old[e - c : e], new[e - c : e])
               for name, c, e in zip(names, counts, ends)) % 2**64  # fmt: skip
    assert fingerprint_runs_move(names, counts, index, old, new) == want
    with pytest.raises(ValueError, match="6 names and 6 runs of 70009 elements for 70008 changes"):
        fingerprint_runs_move(names, counts, index[1:], old[1:], new[1:])
