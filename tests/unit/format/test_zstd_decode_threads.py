"""The zstd decoder spread over threads (deltasync/format/codecs/zstd.py, ``_decode``): any
thread count and any chunk give the same changes, and the same first error on a broken file."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load as st_load

from format_example import CASES, encode, header_json, lookup
from helpers import record_thread_starts

from deltasync import ConfigError, FormatError
from deltasync import format as F
from deltasync.format.codecs import zstd as Z
from deltasync.format.codecs.base import BaseLookup, DeltaContext

SPREADS = [(3, 8), (2, 16), (4, 64), (2, 128)]
"""(threads, chunk) to compare with one piece decoded in the calling thread. A parameter of fewer
changes than the chunk is finished in the calling thread: at 128, ``_case``'s ``b.bias`` (at most
97 changes) is, and its other two (about 190) are not."""
ONE = (1, 1 << 30)

State = dict[str, torch.Tensor]


def _bits(t: torch.Tensor) -> list[int]:
    return t.reshape(-1).view(torch.uint8 if t.element_size() == 1 else torch.int16).tolist()


def _case(seed: int, one_byte: bool = False) -> tuple[State, dict[str, F.Change]]:
    """Three parameters with gaps of every size class (low byte only, a high part, gap_big) and
    differences of every symbol and escapes; with ``one_byte``, one parameter of FP8 codes."""
    rng = np.random.default_rng(seed)
    numels = {"a.weight": 300_000, "b.bias": 97, "c.weight": 5_000}
    state = {n: torch.from_numpy(rng.integers(-0x8000, 0x8000, size=k, dtype=np.int16)).view(torch.bfloat16)
             for n, k in numels.items()}  # fmt: skip
    if one_byte:
        state["c.weight"] = torch.from_numpy(rng.integers(0, 256, size=5_000, dtype=np.uint8)).view(torch.float8_e4m3fn)
    changes = {}
    for name, numel in numels.items():
        near = rng.integers(0, min(numel, 2_000), size=150).tolist()
        far = rng.integers(0, numel, size=40).tolist()
        index = torch.tensor(sorted({*near, *far, numel - 1}), dtype=torch.int64)
        old = state[name][index]
        if old.element_size() == 2:
            step = rng.choice([-2, -1, 1, 2, 3, 7, -300, 0x7FFF], size=index.numel()).astype(np.int16)
            new = (old.view(torch.int16) + torch.from_numpy(step)).view(torch.bfloat16)
        else:
            step = rng.choice([1, 2, 5, 100], size=index.numel()).astype(np.int16)
            moved = (old.view(torch.uint8).to(torch.int16) + torch.from_numpy(step)) % 256
            new = moved.to(torch.uint8).view(old.dtype)
        changes[name] = F.Change(index=index, new=new, old=old)
    return state, changes


def _context(data: bytes, state: State, base: BaseLookup | None = None) -> DeltaContext:
    meta = header_json(data)["__metadata__"]
    return DeltaContext(
        where="f",
        names=tuple(json.loads(meta["names"])),
        changed=int(meta["changed"]),
        numels={n: t.numel() for n, t in state.items()},
        base_values=lookup(state) if base is None else base,
        dtypes={n: t.dtype for n, t in state.items()},
    )


def _decode(
    data: bytes, state: State, spread: tuple[int, int], tensors: dict[str, torch.Tensor] | None = None
) -> dict[str, F.Change]:
    """File ``data`` (its tensors, or ``tensors`` in their place) decoded over ``state``."""
    tensors = st_load(data) if tensors is None else tensors
    return Z._decode(tensors, _context(data, state), workers=spread[0], chunk=spread[1])


def _same(a: dict[str, F.Change], b: dict[str, F.Change]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert a[name].index.tolist() == b[name].index.tolist(), name
        assert a[name].new.dtype == b[name].new.dtype and _bits(a[name].new) == _bits(b[name].new), name
        got, want = a[name].invalid, b[name].invalid
        assert (got is None) == (want is None) and (got is None or got.tolist() == want.tolist()), name


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("case", list(CASES))
def test_the_worked_cases_decode_the_same_spread(case: str, spread: tuple[int, int]) -> None:
    state, changes = CASES[case]()
    data = encode(changes, state, "zstd")
    _same(_decode(data, state, spread), _decode(data, state, ONE))


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("seed", range(4))
def test_a_delta_decodes_the_same_over_threads(seed: int, spread: tuple[int, int]) -> None:
    state, changes = _case(seed, one_byte=seed % 2 == 1)
    data = encode(changes, state, "zstd")
    whole = _decode(data, state, ONE)
    for name, change in changes.items():  # and that is the delta encoded
        assert whole[name].index.tolist() == change.index.tolist() and _bits(whole[name].new) == _bits(change.new)
        assert whole[name].invalid is None
    _same(_decode(data, state, spread), whole)
    # Against other values (a rank that does not hold these elements): one-byte lanes leave
    # their byte (``invalid``), the same ones over any threads.
    other = {
        n: (t.view(torch.uint8) + 200).view(t.dtype) if t.element_size() == 1 else t.flip(0) for n, t in state.items()
    }
    _same(_decode(data, other, spread), _decode(data, other, ONE))


def _frame(raw: bytes) -> torch.Tensor:
    if not raw:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(
        bytearray(zstandard.ZstdCompressor(write_content_size=True).compress(raw)), dtype=torch.uint8
    )


def _broken(tensors: dict[str, torch.Tensor], key: str, how: str) -> dict[str, torch.Tensor]:
    """``tensors`` with stream ``key`` broken ``how``."""
    blob = tensors["zstd:" + key]
    raw = zstandard.ZstdDecompressor().decompress(blob.numpy().tobytes()) if blob.numel() else b""
    out = dict(tensors)
    if how == "truncated":
        out["zstd:" + key] = blob[:-3].clone()
    elif how == "short":
        out["zstd:" + key] = _frame(raw[:-1])
    elif how == "long":
        out["zstd:" + key] = _frame(raw + b"\x01")
    elif how == "high bytes":  # every byte 0xFF: escapes everywhere, gap_big, out-of-range gaps
        out["zstd:" + key] = _frame(b"\xff" * len(raw))
    else:
        raise AssertionError(how)
    return out


STREAM_BREAKS = [(key, how) for key in Z.STREAMS for how in ("truncated", "short", "long", "high bytes")]


@pytest.mark.parametrize("spread", SPREADS)
def test_a_broken_delta_fails_first_where_it_fails_in_one_thread(spread: tuple[int, int]) -> None:
    state, changes = _case(7)
    data = encode(changes, state, "zstd")
    tensors = st_load(data)
    cases: list[dict[str, torch.Tensor]] = []
    for key, how in STREAM_BREAKS:
        if tensors["zstd:" + key].numel() or how in ("long", "high bytes"):
            cases.append(_broken(tensors, key, how))
    # Two streams broken at once: the one docs/protocol.md lists first is named.
    for first, later in (("gap_hi", "sym"), ("gap_big", "esc_lo"), ("sym", "esc_hi"), ("gap_lo", "sym")):
        cases.append(_broken(_broken(tensors, first, "truncated"), later, "truncated"))
    refused = 0
    for broken in cases:
        try:
            want: object = _decode(data, state, ONE, broken)
        except FormatError as exc:
            want = str(exc)
        try:
            got: object = _decode(data, state, spread, broken)
        except FormatError as exc:
            got = str(exc)
        if isinstance(want, str):
            refused += 1
            assert got == want
        else:
            assert isinstance(got, dict) and isinstance(want, dict)
            _same(got, want)
    assert refused >= len(cases) - 4  # nearly every break is refused (a flipped byte may decode)


def test_the_decode_threads_start_in_the_calling_thread_and_end_with_the_call(monkeypatch) -> None:
    """Threads inherit the CPUs and priority of the thread that starts them (a server's staging
    thread); none outlives the decode; the receiver's values are looked up once per parameter."""
    state, changes = _case(3)
    data = encode(changes, state, "zstd")
    asked: list[torch.Tensor] = []
    base = lookup(state)

    def spy(name: str, index: torch.Tensor) -> torch.Tensor:
        asked.append(index)
        return base(name, index)

    started = record_thread_starts(monkeypatch)
    decoded = Z._decode(st_load(data), _context(data, state, spy), workers=3, chunk=8)
    assert started and all(s.startswith("deltasync-decode") and s.endswith("from MainThread") for s in started)
    assert not [t for t in threading.enumerate() if t.name.startswith("deltasync-decode")]
    # Once per parameter, with the very index tensor the change holds (a chain reader's overlay
    # keeps what it read for that tensor).
    assert len(asked) == len(decoded) and all(any(a is c.index for a in asked) for c in decoded.values())
    monkeypatch.setenv("DELTASYNC_DECODE_THREADS", "5")
    assert Z.decode_threads() == 5


def test_a_parameter_of_few_changes_is_finished_in_the_calling_thread() -> None:
    """Handing a parameter of fewer changes than a chunk to a decode thread costs more than it
    saves: it is looked up and finished in the calling thread, the others in decode threads."""
    state, changes = _case(5)
    assert changes["b.bias"].index.numel() < 128 <= min(changes[n].index.numel() for n in ("a.weight", "c.weight"))
    data = encode(changes, state, "zstd")
    where: dict[str, str] = {}
    base = lookup(state)

    def spy(name: str, index: torch.Tensor) -> torch.Tensor:
        where[name] = threading.current_thread().name
        return base(name, index)

    decoded = Z._decode(st_load(data), _context(data, state, spy), workers=2, chunk=128)
    assert where["b.bias"] == "MainThread"
    assert where["a.weight"].startswith("deltasync-decode") and where["c.weight"].startswith("deltasync-decode")
    _same(decoded, _decode(data, state, ONE))


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
@pytest.mark.parametrize("variable", ["DELTASYNC_DECODE_THREADS", "DELTASYNC_ENCODE_THREADS"])
def test_a_thread_count_that_is_not_one_or_more_is_refused_by_name(monkeypatch, variable: str, value: str) -> None:
    monkeypatch.setenv(variable, value)
    count = Z.decode_threads if "DECODE" in variable else Z.encode_threads
    with pytest.raises(ConfigError, match=f"{variable} must be a whole number of threads, 1 or more; it is '{value}'"):
        count()
