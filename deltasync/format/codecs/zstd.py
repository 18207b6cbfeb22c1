"""The zstd codec (the default): per version, the gaps between changed indices and the
differences of the new values from the old ones in bf16 bit order, split into byte streams
that each compress well, each a zstd frame (docs/protocol.md describes every stream)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch
import zstandard

from ...errors import FormatError
from ..dtypes import from_lanes, is_one_byte, lanes
from ..threads import SMALL, Spread, spread, thread_count
from .base import Blob, Change, Codec, DeltaContext, Table, as_tensor, known_numel

__all__ = [
    "ZstdCodec",
    "STREAMS",
    "ENCODE_CHUNK",
    "DECODE_CHUNK",
    "encode_threads",
    "decode_threads",
    "zstd_streams",
    "ordered",
    "from_ordered",
    "bounded_decompress",
]

PREFIX = "zstd:"
"""Every tensor of a zstd delta is named ``zstd:<stream>`` (or ``zstd:counts``)."""
STREAMS = ("gap_lo", "gap_hi_mask", "gap_hi", "gap_big", "sym", "esc_lo", "esc_hi")
"""The byte streams of a zstd delta, in the order docs/protocol.md describes them."""
_MIN_WINDOW = 1 << 20


class ZstdCodec(Codec):
    name = "zstd"
    lists_names = True
    levels = range(1, 23)
    default_level = 3

    def encode(
        self, items: Sequence[tuple[str, Change]], *, numels: Mapping[str, int] | None, level: int | None
    ) -> dict[str, torch.Tensor]:
        return {key: as_tensor(blob) for key, blob in self.encode_blobs(items, numels=numels, level=level).items()}

    def encode_blobs(
        self, items: Sequence[tuple[str, Change]], *, numels: Mapping[str, int] | None, level: int | None
    ) -> dict[str, Blob]:
        """:meth:`encode`, each stream's zstd frame left as the bytes zstandard returned (a file
        streams them from there: no copy of the compressed data is made)."""

        def compress(raw: np.ndarray | bytes) -> bytes:
            # One compressor per stream (they are not thread-safe); single-threaded frames, so
            # the bytes are those of any machine, whatever its cores.
            return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(raw) if len(raw) else b""

        frames, counts = _streams(items, workers=None, then=compress)
        blobs: dict[str, Blob] = {PREFIX + key: frame for key, frame in frames.items()}
        blobs[PREFIX + "counts"] = torch.tensor(counts, dtype=torch.int64)
        return blobs

    def decode(self, tensors: Mapping[str, torch.Tensor], delta: DeltaContext) -> dict[str, Change]:
        return _decode(tensors, delta)

    def describe(
        self, tensors: Mapping[str, torch.Tensor], *, names: tuple[str, ...] | None, changed: int
    ) -> list[Table]:
        counts = tensors[PREFIX + "counts"].tolist()
        rows = [[name, str(count)] for name, count in zip(names or (), counts)]
        streams = [
            [key.removeprefix(PREFIX), str(t.numel()), f"{t.numel() / max(changed, 1):.3f}"]
            for key, t in sorted(tensors.items())
            if key != PREFIX + "counts"
        ]
        return [(["parameter", "changed"], rows), (["stream", "compressed bytes", "bytes/change"], streams)]


ENCODE_CHUNK = 1 << 20
"""Changes one encode thread transforms at a time (a unit: a bounded span of one parameter's
changes, or the changes of several small parameters together): its temporaries (int64 indices
and gaps, int16 differences) stay about 25 MiB per thread however big the version is, and each
NumPy call runs long enough without the GIL for the threads to scale."""


_T = TypeVar("_T")
_R = TypeVar("_R")
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def encode_threads() -> int:
    """Threads a delta's encoding is spread over: the cores this process may run on
    (``DELTASYNC_ENCODE_THREADS`` overrides). NumPy, torch and zstandard release the GIL in the
    loops that matter, and the bytes do not depend on the count."""
    return thread_count("DELTASYNC_ENCODE_THREADS")


def _pool(workers: int | None) -> ThreadPoolExecutor | None:
    """The encode threads' pool, with at least ``workers`` threads (None: :func:`encode_threads`);
    None where one thread is asked for (the work runs in the calling thread)."""
    n = encode_threads() if workers is None else workers
    if n <= 1:
        return None
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < n:  # noqa: SLF001
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="deltasync-encode")
        return _POOL


def _map(fn: Callable[[_T], _R], items: Iterable[_T], *, workers: int | None) -> list[_R]:
    """``[fn(x) for x in items]``, in order, spread over the encode threads (``workers``: at most
    that many; 1 runs here)."""
    items = list(items)
    pool = _pool(workers) if len(items) > 1 else None
    if pool is None:
        return [fn(x) for x in items]
    return list(pool.map(fn, items))


def _lanes(values: torch.Tensor, start: int, stop: int) -> np.ndarray:
    """Elements ``start .. stop - 1`` of flat ``values`` on the host as int16 lanes: bf16
    patterns, or one-byte codes, their byte zero-extended (those codes move by small steps of
    their byte, so their differences take the same symbols; the flip to ordered patterns,
    :func:`_flip16`, leaves them as they are, since it changes only patterns with the sign bit
    set). A view of a flat bf16 CPU tensor in two torch calls (a MoE version holds tens of
    thousands of small spans); NumPy, so that the encode threads do not each start a team of
    torch's intra-op threads."""
    if values.device.type == "cpu" and values.dtype == torch.bfloat16 and values.dim() == 1 and not values.requires_grad:
        try:
            return values.view(torch.int16).numpy()[start:stop]
        except RuntimeError:  # strides a view cannot take: the general path
            pass
    values = values.detach().reshape(-1)[start:stop].cpu()
    if is_one_byte(values.dtype):
        return values.contiguous().view(torch.uint8).numpy().astype(np.int16)
    if values.dtype != torch.bfloat16:
        values = values.to(torch.bfloat16)
    return values.contiguous().view(torch.int16).numpy()


def _host_index(index: torch.Tensor) -> np.ndarray:
    """Flat indices on the host as NumPy (a view of a flat int64 CPU tensor, in one torch call)."""
    if index.device.type == "cpu" and index.dim() == 1 and not index.requires_grad:
        return index.numpy()
    return index.detach().reshape(-1).cpu().numpy()


_Span = tuple[str, Change, int, int]
"""Changes ``start .. stop - 1`` of one parameter: ``(name, change, start, stop)``."""


def _units(items: Sequence[tuple[str, Change]]) -> list[list[_Span]]:
    """The changes of ``items``, in order, cut into units of exactly :data:`ENCODE_CHUNK` (the
    last one shorter): a unit is a span of one parameter's changes, or spans of several. Every
    unit then starts on a byte of the packed streams (the gap mask and the symbols), and every
    NumPy call of a unit runs long enough without the GIL for the encode threads to scale."""
    assert ENCODE_CHUNK > 0 and ENCODE_CHUNK % 8 == 0
    units: list[list[_Span]] = []
    unit: list[_Span] = []
    size = 0
    for name, change in items:
        n, start = change.index.numel(), 0
        while start < n:
            stop = min(n, start + ENCODE_CHUNK - size)
            unit.append((name, change, start, stop))
            size += stop - start
            start = stop
            if size == ENCODE_CHUNK:
                units.append(unit)
                unit, size = [], 0
    if unit:
        units.append(unit)
    return units


_FIXED = ("gap_lo", "gap_hi_mask", "sym")
"""The streams whose size the change count alone sets (a byte, a bit and two bits a change):
the encode threads write their units' pieces straight into them."""
_GAP_STREAMS = ("gap_lo", "gap_hi_mask", "gap_hi", "gap_big")
_VALUE_STREAMS = ("sym", "esc_lo", "esc_hi")


def _offsets(spans: list[_Span]) -> np.ndarray:
    return np.cumsum([0] + [stop - start for _, _, start, stop in spans])


def _named(spans: list[_Span], offsets: np.ndarray, position: int) -> str:
    """The parameter of a unit's change ``position``."""
    return spans[int(np.searchsorted(offsets, position, side="right")) - 1][0]


def _gaps(spans: list[_Span], at: int, lo_out: np.ndarray, mask_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gap streams' pieces of the changes in ``spans``, the unit whose first change is change
    ``at`` of the version (a multiple of 8): its low bytes and its mask bits are written into
    ``lo_out`` and ``mask_out`` at the unit's bytes; its ``gap_hi`` and ``gap_big`` pieces are
    returned. NumPy only, in int64."""
    offsets = _offsets(spans)
    m = int(offsets[-1])
    g = np.empty(m, dtype=np.int64)
    for (_name, change, start, stop), k in zip(spans, offsets):
        # Straight from the parameter's indices (a view of them on the host): each gap plus one,
        # the span's first from the index before it, or for a parameter's first, the index itself.
        index = _host_index(change.index)[max(start - 1, 0) : stop]
        if start == 0:
            g[k] = int(index[0]) + 1
            np.subtract(index[1:], index[:-1], out=g[k + 1 : k + stop])
        else:
            np.subtract(index[1:], index[:-1], out=g[k : k + stop - start])
    g -= 1
    np.copyto(lo_out[at : at + m], g, casting="unsafe")  # the low byte (a cast to uint8 keeps it)
    g >>= 8  # arithmetic: a negative gap stays negative, and among the high parts
    hi_nz = g != 0
    hv = np.compress(hi_nz, g)  # (NumPy's boolean indexing is several times slower on a dense mask)
    if hv.size and int(hv.min()) < 0:
        raise FormatError(
            f"parameter {_named(spans, offsets, int(np.flatnonzero(g < 0)[0]))!r}: a delta's indices must be "
            "non-negative and strictly increasing"
        )
    mask_out[at // 8 : at // 8 + -(-m // 8)] = np.packbits(hi_nz, bitorder="little")
    return np.minimum(hv, 255).astype(np.uint8), hv[hv >= 255].astype("<u8")


def _values(spans: list[_Span], at: int, sym_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The value streams' pieces of the changes in ``spans`` (the unit of :func:`_gaps`): its
    packed symbols are written into ``sym_out`` at the unit's bytes, its ``esc_lo`` and
    ``esc_hi`` pieces returned. NumPy only: the difference of two ordered patterns modulo 2**16
    is int16's own wrap."""
    offsets = _offsets(spans)
    m = int(offsets[-1])
    d, old = np.empty(m, dtype=np.int16), np.empty(m, dtype=np.int16)
    for (_name, change, start, stop), k in zip(spans, offsets):
        assert change.old is not None
        d[k : k + stop - start] = _lanes(change.new, start, stop)
        old[k : k + stop - start] = _lanes(change.old, start, stop)
    # The whole unit's lanes flipped to ordered patterns at once (one-byte codes stay as they are)
    _flip16(d, out=d)
    _flip16(old, out=old)
    d -= old
    # New minus old ordered bit pattern modulo 2**16, as a signed 16-bit number,
    # zigzag-mapped: -1 -> 1, +1 -> 2, -2 -> 3, +2 -> 4, ... Symbols 0..2 stand for
    # zigzag 1..3; 3 escapes.
    zig = ((d << 1) ^ (d >> 15)).view(np.uint16)
    sym = np.minimum(zig, 4).astype(np.uint8)
    if not sym.all():
        raise FormatError(
            f"parameter {_named(spans, offsets, int(sym.argmin()))!r}: a delta lists changed elements only, but an "
            "element's new value equals its old one"
        )
    sym -= 1
    # Four 2-bit symbols a byte, the first in the low bits: each little-endian group of four
    # symbol bytes read as one uint32, its bytes' low bits shifted together.
    quads = np.zeros(-(-m // 4), dtype="<u4")
    quads.view(np.uint8)[:m] = sym
    quads |= quads >> 6
    quads |= quads >> 12
    np.copyto(sym_out[at // 4 : at // 4 + quads.size], quads, casting="unsafe")
    esc = np.compress(zig > 3, zig)  # as the gaps' high parts: faster than zig[zig > 3]
    return esc.astype(np.uint8), (esc >> 8).astype(np.uint8)


def _streams(
    items: Sequence[tuple[str, Change]], *, workers: int | None, then: Callable[[np.ndarray | bytes], _R]
) -> tuple[dict[str, _R], list[int]]:
    """``then`` of each raw stream of ``items`` (in :data:`STREAMS` order), and each parameter's
    count of changes; the work is spread over ``workers`` threads (None: :func:`encode_threads`),
    the bytes are the same.

    Each unit's gaps are transformed first, then its values: ``then`` of the gap streams (the
    compression of ``gap_lo``, the largest, one frame on one thread) runs while the other
    threads transform the values. Errors in the indices come first, then those in the values,
    each unit in order, whatever the thread count."""
    counts = [change.index.numel() for _, change in items]
    for name, change in items:
        if change.old is None:
            raise FormatError(f"parameter {name!r}: the zstd codec needs the previous values")
        if not change.index.numel() == change.new.numel() == change.old.numel():
            raise FormatError(
                f"parameter {name!r}: {change.index.numel()} indices, {change.new.numel()} new and "
                f"{change.old.numel()} old values (one each per changed element)"
            )
    n = sum(counts)
    lo, mask, sym = np.empty(n, dtype=np.uint8), np.empty(-(-n // 8), dtype=np.uint8), np.empty(-(-n // 4), dtype=np.uint8)
    # Every unit starts on a byte of the packed streams (ENCODE_CHUNK is a multiple of 8), so
    # each writes whole bytes of them; the other streams are the units' pieces joined.
    units = [(k * ENCODE_CHUNK, unit) for k, unit in enumerate(_units(items))]

    def gap_streams(pieces: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, _R]:
        raw = {"gap_lo": lo, "gap_hi_mask": mask, "gap_hi": b"".join(p[0] for p in pieces),
               "gap_big": b"".join(p[1] for p in pieces)}  # fmt: skip
        return {key: then(raw[key]) for key in _GAP_STREAMS}

    def value_streams(pieces: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, _R]:
        raw = {"sym": sym, "esc_lo": b"".join(p[0] for p in pieces), "esc_hi": b"".join(p[1] for p in pieces)}
        done = _map(then, [raw[key] for key in _VALUE_STREAMS], workers=workers)
        return dict(zip(_VALUE_STREAMS, done))

    pool = _pool(workers)
    if pool is None:
        gap = gap_streams([_gaps(unit, at, lo, mask) for at, unit in units])
        value = value_streams([_values(unit, at, sym) for at, unit in units])
    else:
        # In submission order: a task waits only for tasks submitted before it, which the pool
        # started first, so that tasks of concurrent encodes sharing the pool never deadlock.
        gaps = [pool.submit(_gaps, unit, at, lo, mask) for at, unit in units]
        gap_job = pool.submit(lambda: gap_streams([f.result() for f in gaps]))
        values = [pool.submit(_values, unit, at, sym) for at, unit in units]
        for f in gaps:  # the first error in the indices, in order
            f.result()
        value = value_streams([f.result() for f in values])
        gap = gap_job.result()
    out = {**gap, **value}
    return {key: out[key] for key in STREAMS}, counts


def zstd_streams(
    items: Sequence[tuple[str, Change]], *, workers: int | None = None
) -> tuple[dict[str, bytes], list[int]]:
    """The raw (uncompressed) streams of ``items`` and each parameter's count of changes; the work
    is spread over ``workers`` threads (None: :func:`encode_threads`), the bytes are the same."""
    return _streams(items, workers=workers, then=bytes)


def ordered(values: torch.Tensor) -> torch.Tensor:
    """bf16 -> int32 in [-32768, 32767], monotone in the value: the ordered bit pattern.

    Positive patterns map to themselves, negative ones (sign bit set) to ``0x7FFF - bits``,
    so -0.0 is -1 and +0.0 is 0. Neighbouring bf16 values, across zero too, differ by one.
    """
    bits = values.to(torch.bfloat16).cpu().contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(bits >= 0x8000, 0x7FFF - bits, bits)


def from_ordered(pattern: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`ordered`, taken modulo 2**16."""
    o = ((pattern + 0x8000) & 0xFFFF) - 0x8000
    bits = torch.where(o < 0, 0x7FFF - o, o)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


_SYMBOL_DIFF = np.array([-1, 1, -2, 0], dtype=np.int16)
"""The difference each symbol stands for (zigzag 1, 2, 3); 3 is the escape, filled in after.
No other symbol stands for 0, so the zeros of the differences looked up are the escapes."""
_PACKED_DIFF = _SYMBOL_DIFF[(np.arange(256)[:, None] >> (2 * np.arange(4))) & 3].reshape(-1).view(np.int64)
"""The four differences a byte of packed symbols stands for (lowest bits first), as the int64
that holds them: one lookup a byte instead of unpacking the symbols and looking each up."""
_FLIP_CHUNK = 1 << 16
"""Elements flipped at a time: the temporary (128 KiB) stays in cache, and no fresh pages are
taken for it."""


def _flip16(bits: np.ndarray, out: np.ndarray | None = None, add: np.ndarray | None = None) -> np.ndarray:
    """:func:`ordered` and :func:`from_ordered` on 1-D int16 bit patterns, modulo 2**16: both are
    this involution (negative patterns, sign bit set, have their other 15 bits flipped). Three
    int16 operations, where the int32 forms take several, into one new array (or ``out``,
    which may be ``bits``), a cache-sized chunk at a time. ``add``: the flip of (the flip of
    ``bits`` + ``add``), int16 arithmetic wrapping modulo 2**16 (the decode's move of ordered
    patterns), in the same pass."""
    out = np.empty_like(bits) if out is None else out
    tmp = np.empty(min(bits.size, _FLIP_CHUNK), dtype=np.int16)
    for at in range(0, bits.size, _FLIP_CHUNK):
        src, dst = bits[at : at + _FLIP_CHUNK], out[at : at + _FLIP_CHUNK]
        t = tmp[: src.size]
        np.right_shift(src, 15, out=t)
        t &= 0x7FFF
        np.bitwise_xor(src, t, out=dst)
        if add is not None:
            dst += add[at : at + _FLIP_CHUNK]
            np.right_shift(dst, 15, out=t)
            t &= 0x7FFF
            dst ^= t
    return out


def _decompress(blob: torch.Tensor, expected: int, key: str, where: str) -> memoryview:
    if blob.dtype != torch.uint8 or blob.dim() != 1:
        raise FormatError(f"{where}: stream {key!r} must be a 1-D uint8 tensor")
    if expected == 0:
        if blob.numel():
            raise FormatError(f"{where}: stream {key!r} should be empty")
        return memoryview(b"")
    data = np.ascontiguousarray(blob.numpy())  # read in place: zstandard takes any buffer
    try:
        declared = zstandard.frame_content_size(data)
        if declared not in (-1, expected):  # -1: the frame does not say
            raise FormatError(f"{where}: stream {key!r} decodes to {declared} bytes, expected {expected}")
        raw = bounded_decompress(data, expected)
    except zstandard.ZstdError as exc:
        raise FormatError(f"{where}: stream {key!r} is not valid zstd data ({exc})") from exc
    if len(raw) != expected:
        got = f"more than {expected}" if len(raw) > expected else str(len(raw))
        raise FormatError(
            f"{where}: stream {key!r} is not valid zstd data (it decodes to {got} bytes, expected {expected})"
        )
    return raw


def bounded_decompress(blob: Any, expected: int) -> memoryview:
    """Decompress at most ``expected + 1`` bytes of the frame in ``blob`` (any buffer),
    whatever the frame header claims.

    The one-shot API trusts a frame's declared content size (a 1 KB frame can ask for a
    terabyte). Streaming with a bounded window keeps memory at ``expected`` plus a constant.
    The bytes land in one NumPy buffer, with no copy after (a large one is given huge pages
    where the system allows: a large stream faults in few pages).
    """
    window = max(_MIN_WINDOW, 1 << max(expected - 1, 1).bit_length())
    dctx = zstandard.ZstdDecompressor(max_window_size=window)
    out = memoryview(np.empty(expected + 1, dtype=np.uint8))
    got = 0
    with dctx.stream_reader(blob, read_across_frames=False) as reader:
        while got <= expected:
            n = reader.readinto(out[got:])
            if not n:
                break
            got += n
    return out[:got]


DECODE_CHUNK = 1 << 18
"""Elements one decode thread unpacks at a time (a multiple of 8: a chunk starts on a byte of
the gap mask and of the packed symbols). A delta of at most this many changes decodes in the
calling thread alone."""


def decode_threads() -> int:
    """Threads a delta's decoding is spread over: the CPUs the calling thread may run on
    (``DELTASYNC_DECODE_THREADS`` overrides). The threads start in the calling thread, so a
    server's staging thread hands them its CPUs and its priority."""
    return thread_count("DELTASYNC_DECODE_THREADS")


def _attempt(job: tuple[torch.Tensor, int, str, str]) -> memoryview | FormatError:
    """:func:`_decompress`, its error returned rather than raised (raised later, in stream order)."""
    try:
        return _decompress(*job)
    except FormatError as exc:
        return exc


def _got(result: memoryview | FormatError) -> memoryview:
    if isinstance(result, FormatError):
        raise result
    return result


def _decode(
    tensors: Mapping[str, torch.Tensor], delta: DeltaContext, *, workers: int | None = None, chunk: int = DECODE_CHUNK
) -> dict[str, Change]:
    """The changes of a zstd delta. Elements are unpacked ``chunk`` at a time and parameters
    finished one at a time, spread over ``workers`` threads (None: :func:`decode_threads`); the
    result and the first error found are the same for any count."""
    assert chunk > 0 and chunk % 8 == 0
    where, numels = delta.where, delta.numels
    expected_keys = {PREFIX + key for key in (*STREAMS, "counts")}
    if set(tensors) != expected_keys:
        extra = sorted(set(tensors) - expected_keys)
        missing = sorted(expected_keys - set(tensors))
        raise FormatError(f"{where}: zstd delta has unexpected tensors {extra} / lacks {missing}")
    if delta.names is None:
        raise FormatError(f"{where}: a zstd delta needs the metadata key 'names'")
    names = list(delta.names)
    counts_t = tensors[PREFIX + "counts"]
    if counts_t.dtype != torch.int64 or counts_t.dim() != 1 or counts_t.numel() != len(names):
        raise FormatError(f"{where}: 'zstd:counts' must be int64 with one entry per name ({len(names)})")
    counts = counts_t.tolist()
    for name, count in zip(names, counts):
        numel = known_numel(name, numels, where)
        if count <= 0 or count > numel:
            raise FormatError(f"{where}: parameter {name!r} claims {count} changes (it has {numel} elements)")
    if len(set(names)) != len(names):
        raise FormatError(f"{where}: a parameter is listed twice in 'names'")
    n = sum(counts)
    if n != delta.changed:
        raise FormatError(f"{where}: counts add up to {n}, metadata says {delta.changed} changed")
    spans = [(a, min(a + chunk, n)) for a in range(0, n, chunk)]
    workers = (decode_threads() if workers is None else workers) if n > chunk else 1
    with spread(workers, "deltasync-decode") as threads:
        return _decode_spread(tensors, delta, names, counts, n, spans, threads, min(chunk, SMALL))


def _decode_spread(
    tensors: Mapping[str, torch.Tensor],
    delta: DeltaContext,
    names: list[str],
    counts: list[int],
    n: int,
    spans: list[tuple[int, int]],
    spread: Spread,
    small: int,
) -> dict[str, Change]:
    where, numels = delta.where, delta.numels
    # Streams are checked in the order docs/protocol.md lists them: their errors are raised so.
    first = spread(_attempt, [(tensors[PREFIX + key], size, key, where)
                              for key, size in (("gap_lo", n), ("gap_hi_mask", -(-n // 8)), ("sym", -(-n // 4)))])  # fmt: skip
    lo = np.frombuffer(_got(first[0]), dtype=np.uint8)
    mask = np.frombuffer(_got(first[1]), dtype=np.uint8)
    packed = None if isinstance(first[2], FormatError) else np.frombuffer(first[2], dtype=np.uint8)
    # The differences, four a byte of packed symbols (the padding past n is never read).
    diff_4 = np.empty(-(-n // 4), dtype=np.int64)
    diff = diff_4.view(np.int16)[:n]

    def unpack(span: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        a, b = span
        hi_at = np.flatnonzero(np.unpackbits(mask[a // 8 : -(-b // 8)], bitorder="little")[: b - a])
        if packed is None:  # its error is raised after those of the gap streams
            return hi_at, np.zeros(0, dtype=np.int64)
        # A byte is always in range: "clip" writes straight into out ("raise" takes the values
        # into a buffer first, then copies them).
        got = slice(a // 4, -(-b // 4))
        np.take(_PACKED_DIFF, packed[got], out=diff_4[got], mode="clip")
        return hi_at, np.flatnonzero(diff[a:b] == 0)  # the escapes

    unpacked = spread(unpack, spans)
    n_hi = sum(u[0].size for u in unpacked)
    hv = np.frombuffer(_decompress(tensors[PREFIX + "gap_hi"], n_hi, "gap_hi", where), dtype=np.uint8).astype(np.int64)
    n_big = int((hv == 255).sum())
    big = np.frombuffer(_decompress(tensors[PREFIX + "gap_big"], 8 * n_big, "gap_big", where), dtype="<u8")
    if n_big and (int(big.min()) < 255 or int(big.max()) >= 2**55):
        raise FormatError(f"{where}: stream 'gap_big' holds a value outside 255..2**55-1")
    hv[hv == 255] = big.astype(np.int64)
    _got(first[2])
    n_esc = sum(u[1].size for u in unpacked)
    esc_lo = np.frombuffer(_decompress(tensors[PREFIX + "esc_lo"], n_esc, "esc_lo", where), dtype=np.uint8)
    esc_hi = np.frombuffer(_decompress(tensors[PREFIX + "esc_hi"], n_esc, "esc_hi", where), dtype=np.uint8)
    esc = (esc_hi.astype(np.uint16) << np.uint16(8)) | esc_lo
    if n_esc and int(esc.min()) <= 3:
        raise FormatError(f"{where}: the escape streams hold a value that has its own symbol")
    # Zigzag back to the signed difference, as int16 modulo 2**16: symbols 0..2 are zigzag
    # 1..3 (-1, +1, -2), looked up; an escape holds its zigzag value.
    esc_diff = ((esc >> np.uint16(1)) ^ (np.uint16(0) - (esc & np.uint16(1)))).view(np.int16)
    # Every gap is in 0..2**63-1: the low byte, plus the high part (< 2**55) shifted by 8.
    gaps = np.empty(n, dtype=np.int64)
    hi_from = np.cumsum([0] + [u[0].size for u in unpacked]).tolist()
    esc_from = np.cumsum([0] + [u[1].size for u in unpacked]).tolist()

    def fill(k: int) -> None:
        (a, b), (hi_at, esc_at) = spans[k], unpacked[k]
        np.copyto(gaps[a:b], lo[a:b], casting="unsafe")
        gaps[a + hi_at] |= hv[hi_from[k] : hi_from[k + 1]] << np.int64(8)
        diff[a + esc_at] = esc_diff[esc_from[k] : esc_from[k + 1]]

    spread(fill, list(range(len(spans))))
    starts = np.cumsum([0, *counts]).tolist()

    def index_of(i: int) -> np.ndarray:
        name, start, count = names[i], starts[i], counts[i]
        gap = gaps[start : start + count]
        if int(gap.max()) >= numels[name]:
            raise FormatError(
                f"{where}: a gap of {int(gap.max())} in parameter {name!r} is out of range "
                f"(it has {numels[name]} elements)"
            )
        # Gaps are >= 0 and < numel, so the running sum of gap + 1 is strictly increasing and
        # stays far below 2**63 (count * numel): the last index alone says whether all are in
        # range. (NumPy's cumsum: several times faster here than torch's.)
        # In place: the gaps become the indices (fresh arrays would each fault in their pages).
        steps = gap
        steps += 1
        np.cumsum(steps, out=steps)
        steps -= 1
        if int(steps[-1]) >= numels[name]:
            raise FormatError(
                f"{where}: index {int(steps[-1])} of parameter {name!r} is out of range "
                f"(it has {numels[name]} elements)"
            )
        return steps

    # A parameter of fewer than ``small`` changes is finished in this thread (handing it over
    # costs more than it saves).
    indices = spread(index_of, list(range(len(names))), sizes=counts, small=small)
    def change(i: int) -> Change:
        name, start, count = names[i], starts[i], counts[i]
        index = torch.from_numpy(indices[i])
        # The receiver's values at those elements, looked up with the index the change returns
        # (a lookup may keep what it read for that very tensor). A lookup runs in a decode
        # thread: on an accelerator it is a gather and one copy; torch operations on host
        # tensors release the interpreter lock.
        old = delta.base_values(name, index)
        dtype = delta.dtype(name)
        if dtype == torch.bfloat16:
            # (No torch call where there is nothing to do: a model of many small tensors pays for each.)
            old = old if old.dtype == torch.bfloat16 else old.to(torch.bfloat16)
            old = old if old.device.type == "cpu" else old.cpu()
            base = (old if old.is_contiguous() else old.contiguous()).view(torch.int16).numpy()
            new = _flip16(base, add=diff[start : start + count])  # int16 arithmetic wraps modulo 2**16
            return Change(index=index, new=torch.from_numpy(new).view(torch.bfloat16))
        # One-byte codes: lanes, which must stay within their byte where the reader holds them.
        moved = lanes(old.cpu()).numpy() + diff[start : start + count]
        bad = np.flatnonzero(moved & ~np.int16(0xFF))
        invalid = torch.from_numpy(bad) if bad.size else None
        return Change(index=index, new=from_lanes(torch.from_numpy(moved & np.int16(0xFF)), dtype), invalid=invalid)

    return dict(zip(names, spread(change, list(range(len(names))), sizes=counts, small=small)))
