"""An order-independent 64-bit fingerprint of a bf16 state that updates in O(changed).

The fingerprint of a state is the sum, modulo 2**64, of one 64-bit hash per element:

    h(name, index, bits) = mix64(((index << 16) | bits) XOR seed(name))

where ``bits`` is the element's bf16 bit pattern as an unsigned 16-bit integer (for the
one-byte codes of a quantized view, its byte zero-extended: its lane; which dtypes those are is
:mod:`deltasync.format.dtypes`' table), ``seed(name)``
is the first 8 bytes of BLAKE2b(name, digest_size=8) read little-endian, and ``mix64`` is the
xor-shift-multiply finaliser documented in docs/protocol.md. A sum does not depend on the
order of parameters or elements, and changing elements ``I`` of parameter ``n`` from ``old`` to
``new`` moves it by ``sum h(n, I, new) - sum h(n, I, old)``: both sides of a sync keep it
current at the cost of the changed elements only.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from .dtypes import holds_byte_lanes
from .threads import spread, thread_count

__all__ = [
    "DeviceHasher",
    "SPREAD",
    "hash_threads",
    "fingerprint",
    "fingerprint_add",
    "fingerprint_move",
    "fingerprint_moves",
    "fingerprint_runs_move",
    "fingerprint_share",
    "fingerprint_slice_share",
    "fingerprint_slices",
    "fingerprint_update",
    "format_fingerprint",
    "parse_fingerprint",
]

_MASK = (1 << 64) - 1
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 16
"""Elements hashed at a time: each of the three uint64 work buffers (512 KiB) stays in cache,
and every step of the hash runs in place in them."""


@functools.lru_cache(maxsize=1 << 17)
def _seed(name: str) -> np.uint64:
    """A name's 64-bit seed (kept: a version of a model of many small tensors asks for each)."""
    return np.uint64(int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"))


def _on_device(*tensors: torch.Tensor) -> torch.device | None:
    """The accelerator any of ``tensors`` lives on (they are hashed there), or None: all on the CPU."""
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return None


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 that holds it (two's complement)."""
    value &= _MASK
    return value - (1 << 64) if value >> 63 else value


_C1_I64 = _signed(int(_C1))
_C2_I64 = _signed(int(_C2))
DEVICE_CHUNK = 1 << 23
"""Elements hashed at a time on an accelerator: two int64 work buffers of 64 MiB each."""


def _device_bits(values: torch.Tensor) -> torch.Tensor:
    """The 16-bit lanes of ``values`` (bf16 patterns, or one-byte codes zero-extended) as int64
    on the tensor's own device."""
    flat = values.detach().reshape(-1)
    if holds_byte_lanes(flat.dtype):  # a one-byte element (a view's code): its byte, never rounded
        return flat.view(torch.uint8).to(torch.int64)
    return _lanes16(flat).to(torch.int64) & 0xFFFF


def _lanes16(values: torch.Tensor) -> torch.Tensor:
    """The 16-bit lanes of ``values`` as int16, flat, on the tensor's own device: bf16 patterns
    (a view where they are bf16 already), one-byte codes zero-extended."""
    flat = values.detach().reshape(-1)
    if holds_byte_lanes(flat.dtype):
        return flat.view(torch.uint8).to(torch.int16)
    if flat.dtype != torch.bfloat16:
        flat = flat.to(torch.bfloat16)
    return flat.view(torch.int16)


class DeviceHasher:
    """The same sums of element hashes, computed with torch on the tensors' own device (an
    accelerator: CUDA, or any device torch runs int64 arithmetic on; the CPU too, for tests).

    int64 arithmetic wraps modulo 2**64 like the uint64 one, a logical shift is an arithmetic
    one masked to the bits it keeps, and ``sum`` adds modulo 2**64: every value equals the
    host's bit for bit. Sums stay on the device (0-d int64 tensors) until :meth:`value` reads
    them, so that a caller can hash many tensors with one synchronization at the end.
    """

    def __init__(self, device: torch.device, chunk: int = DEVICE_CHUNK) -> None:
        self.device = device
        self.chunk = chunk
        self.total = torch.zeros((), dtype=torch.int64, device=device)
        self._x: torch.Tensor | None = None
        self._tmp: torch.Tensor | None = None

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._x is None or self._x.numel() < n:
            size = max(n, 1)
            self._x = torch.empty(size, dtype=torch.int64, device=self.device)
            self._tmp = torch.empty(size, dtype=torch.int64, device=self.device)
        assert self._tmp is not None
        return self._x[:n], self._tmp[:n]

    def _mix_sum(self, x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
        for shift, const in ((30, _C1_I64), (27, _C2_I64)):
            torch.bitwise_right_shift(x, shift, out=tmp)
            tmp &= (1 << (64 - shift)) - 1
            x ^= tmp
            x.mul_(const)
        torch.bitwise_right_shift(x, 31, out=tmp)
        tmp &= (1 << 33) - 1
        x ^= tmp
        return x.sum(dtype=torch.int64)

    def add(self, name: str, index: torch.Tensor, values: torch.Tensor, *, sign: int = 1) -> None:
        """Add (or with ``sign=-1`` subtract) the hashes of ``values`` at int64 flat ``index``."""
        seed = _signed(int(_seed(name)))
        index = index.detach().reshape(-1).to(device=self.device, dtype=torch.int64)
        values = values.detach().reshape(-1).to(self.device)
        for lo in range(0, index.numel(), self.chunk):
            hi = min(lo + self.chunk, index.numel())
            x, tmp = self._buffers(hi - lo)
            torch.bitwise_left_shift(index[lo:hi], 16, out=x)
            x |= _device_bits(values[lo:hi])
            x ^= seed
            part = self._mix_sum(x, tmp)
            self.total = self.total - part if sign < 0 else self.total + part

    def add_slice(self, name: str, values: torch.Tensor, offset: int = 0) -> None:
        """Add the hashes of a contiguous flat slice of ``name`` starting at flat index ``offset``."""
        seed = _signed(int(_seed(name)))
        flat = values.detach().reshape(-1)
        for lo in range(0, flat.numel(), self.chunk):
            hi = min(lo + self.chunk, flat.numel())
            x, tmp = self._buffers(hi - lo)
            torch.arange(offset + lo, offset + hi, dtype=torch.int64, device=self.device, out=x)
            x <<= 16
            x |= _device_bits(flat[lo:hi].to(self.device))
            x ^= seed
            self.total = self.total + self._mix_sum(x, tmp)

    def add_moves(
        self, index: torch.Tensor, new: torch.Tensor, old: torch.Tensor, runs: Sequence[tuple[str, int, int]]
    ) -> None:
        """Add the hashes of ``new`` and subtract those of ``old`` (bf16) at int64 flat ``index``,
        where elements ``begin .. end - 1`` of each run ``(name, begin, end)`` are ``name``'s: the
        fingerprint move of the changes of many weights at once, in a few kernels per :attr:`chunk`
        and one per run, however many weights the runs name."""
        if new.dtype != torch.bfloat16 or old.dtype != torch.bfloat16:
            raise TypeError(f"add_moves hashes bf16 values, got {new.dtype} and {old.dtype}")
        for lo in range(0, index.numel(), self.chunk):
            hi = min(lo + self.chunk, index.numel())
            keyed = torch.empty(hi - lo, dtype=torch.int64, device=self.device)
            torch.bitwise_left_shift(index[lo:hi], 16, out=keyed)
            for name, begin, end in runs:
                if max(begin, lo) < min(end, hi):
                    keyed[max(begin, lo) - lo : min(end, hi) - lo] ^= _signed(int(_seed(name)))
            x, tmp = self._buffers(hi - lo)
            sums = []
            for values in (new[lo:hi], old[lo:hi]):
                tmp.copy_(values.view(torch.int16))  # sign-extended: masked to its 16 bits
                tmp &= 0xFFFF
                # (index << 16 | bits) ^ seed, as add's: the bits lie where the shifted index has 0s
                torch.bitwise_xor(keyed, tmp, out=x)
                sums.append(self._mix_sum(x, tmp))
            self.total = self.total + (sums[0] - sums[1])

    def add_slices(self, items: Iterable[tuple[str, torch.Tensor, int]]) -> None:
        """Add the hashes of many contiguous flat slices ``(name, values, offset)``, as
        :meth:`add_slice` adds each: slices of fewer than :attr:`chunk` elements are hashed
        together, :attr:`chunk` elements at most at a time, each element keyed with its own
        name's seed (a few kernels per batch however many names it holds: a MoE model's
        experts, norms and biases); larger ones alone."""
        batch: list[tuple[str, torch.Tensor, int]] = []
        size = 0
        for name, values, offset in items:
            n = values.numel()
            if n == 0:
                continue
            if n >= self.chunk:
                self.add_slice(name, values, offset)
                continue
            if size + n > self.chunk:
                self._add_batch(batch, size)
                batch, size = [], 0
            batch.append((name, values, offset))
            size += n
        if batch:
            self._add_batch(batch, size)

    def _add_batch(self, batch: list[tuple[str, torch.Tensor, int]], size: int) -> None:
        """One batch of :meth:`add_slices`: ``size`` elements in all."""
        lanes = torch.cat([_lanes16(values.to(self.device)) for _, values, _ in batch])
        table, start = [], 0  # per slice: its length, its index's shift from the batch's, its seed
        for name, values, offset in batch:
            table.append((values.numel(), offset - start, _signed(int(_seed(name)))))
            start += values.numel()
        lengths, shifts, seeds = torch.tensor(table, dtype=torch.int64).t().contiguous().to(self.device)
        x, tmp = self._buffers(size)
        torch.arange(size, dtype=torch.int64, device=self.device, out=x)
        x += torch.repeat_interleave(shifts, lengths, output_size=size)  # output_size: no wait
        x <<= 16
        tmp.copy_(lanes)  # sign-extended: masked to its 16 bits
        tmp &= 0xFFFF
        x |= tmp
        x ^= torch.repeat_interleave(seeds, lengths, output_size=size)
        self.total = self.total + self._mix_sum(x, tmp)

    def value(self) -> int:
        """The sum so far, modulo 2**64 (reads the device: one synchronization)."""
        return int(self.total.item()) & _MASK


def _host_flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, contiguous, on the CPU and detached, with no torch call where it is already
    (each call releases the GIL, and a hash of many small tensors makes many)."""
    if t.requires_grad:
        t = t.detach()
    if t.dim() != 1:
        t = t.reshape(-1)
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _bits_u16(values: torch.Tensor) -> np.ndarray:
    if values.dtype == torch.bfloat16 and values.dim() == 1 and values.device.type == "cpu" and not values.requires_grad:
        try:  # flat bf16 on the host (a version's changes): a view, in two torch calls
            return values.view(torch.int16).numpy().view(np.uint16)
        except RuntimeError:  # strides a view cannot take
            pass
    if holds_byte_lanes(values.dtype):  # a one-byte element: its bits, zero-extended (its lane)
        return _host_flat(values).view(torch.uint8).numpy().astype(np.uint16)
    if values.dtype != torch.bfloat16:
        values = values.to(torch.bfloat16)
    return _host_flat(values).view(torch.int16).numpy().view(np.uint16)


def _index_u64(index: torch.Tensor) -> np.ndarray:
    """Flat indices (>= 0) as uint64, without a copy where they are int64 already."""
    if index.dim() == 1 and index.device.type == "cpu" and not index.requires_grad:
        idx = index.numpy()  # (a view, in one torch call)
    else:
        idx = _host_flat(index).numpy()
    return idx.view(np.uint64) if idx.dtype == np.int64 else idx.astype(np.uint64)


class _Hasher:
    """Sums of element hashes over chunks of at most :data:`_CHUNK` elements, in three reused
    buffers: the keys' index part, the element keys, and the shifts' scratch."""

    def __init__(self, name: str, size: int) -> None:
        self.seed = _seed(name)
        m = max(1, min(size, _CHUNK))
        self.base = np.empty(m, dtype=np.uint64)
        self.x = np.empty(m, dtype=np.uint64)
        self.tmp = np.empty(m, dtype=np.uint64)

    def keys(self, index: np.ndarray, seed: np.uint64 | np.ndarray | None = None) -> np.ndarray:
        """``(index << 16) XOR seed`` for a chunk of uint64 indices: an element's key is this
        XOR its 16 bits (they fill the low bits the shift left empty). ``seed``: the hasher's
        name's (None), another, or one per index."""
        base = self.base[: index.size]
        np.left_shift(index, np.uint64(16), out=base)
        base ^= self.seed if seed is None else seed
        return base

    def sum(self, base: np.ndarray, bits: np.ndarray) -> int:
        """Sum (mod 2**64) of ``mix64(base XOR bits)``."""
        x, tmp = self.x[: base.size], self.tmp[: base.size]
        np.bitwise_xor(base, bits, out=x, casting="unsafe")
        with np.errstate(over="ignore"):
            np.right_shift(x, np.uint64(30), out=tmp)
            x ^= tmp
            x *= _C1
            np.right_shift(x, np.uint64(27), out=tmp)
            x ^= tmp
            x *= _C2
            np.right_shift(x, np.uint64(31), out=tmp)
            x ^= tmp
            return int(np.add.reduce(x, dtype=np.uint64))


def _hash_sum(seed_name: str, index: np.ndarray, bits: np.ndarray, *, workers: int | None = None) -> int:
    """Sum of element hashes (mod 2**64) of ``seed_name``'s uint64 ``index`` and uint16 ``bits``."""
    return _keyed_sum(_seed(seed_name), index, bits, workers=workers)


def _keyed_sum(seed: np.uint64 | np.ndarray, index: np.ndarray, bits: np.ndarray, minus: np.ndarray | None = None, *,
               workers: int | None = None) -> int:  # fmt: skip
    """Sum of element hashes (mod 2**64) of uint16 ``bits`` over keys ``(index << 16) XOR seed``,
    ``seed`` one name's or one per element; with ``minus``, less those of ``minus`` (a move:
    ``sum h(new) - sum h(old)``, each chunk's keys built once for both)."""
    per_element = isinstance(seed, np.ndarray)

    def part(lo: int, hi: int) -> int:
        hasher = _Hasher("", hi - lo)
        total = 0
        for start in range(lo, hi, _CHUNK):
            stop = min(start + _CHUNK, hi)
            base = hasher.keys(index[start:stop], seed[start:stop] if per_element else seed)
            total += hasher.sum(base, bits[start:stop])
            if minus is not None:
                total -= hasher.sum(base, minus[start:stop])
        return total & _MASK

    return _spread_sum(bits.size, part, workers)


def hash_threads() -> int:
    """Threads a large fingerprint of host values is spread over: the CPUs the calling thread
    may run on (``DELTASYNC_HASH_THREADS`` overrides). The sum does not depend on the count."""
    return thread_count("DELTASYNC_HASH_THREADS")


SPREAD = 1 << 20
"""Elements one hashing thread takes at a time: host values of more than twice this many are
hashed over threads the calling thread starts (:func:`~deltasync.format.threads.spread`)."""


def _spread_sum(n: int, part: Callable[[int, int], int], workers: int | None) -> int:
    """``part(0, n)``, computed as the sum (mod 2**64) of ``part(lo, hi)`` over pieces of
    :data:`SPREAD` elements spread over ``workers`` threads (None: :func:`hash_threads`)."""
    if n <= 2 * SPREAD:
        return part(0, n)
    pieces = [(lo, min(lo + SPREAD, n)) for lo in range(0, n, SPREAD)]
    count = min(hash_threads() if workers is None else workers, len(pieces))
    with spread(count, "deltasync-hash") as threads:
        return sum(threads(lambda piece: part(*piece), pieces)) & _MASK


def _tensor_sum(name: str, values: torch.Tensor, offset: int = 0, *, workers: int | None = None) -> int:
    device = _on_device(values)
    if device is not None:  # hashed where the values are: nothing crosses to the host
        on_device = DeviceHasher(device)
        on_device.add_slice(name, values, offset)
        return on_device.value()
    bits = _bits_u16(values)

    def part(lo: int, hi: int) -> int:
        hasher = _Hasher(name, hi - lo)
        total = 0
        for start in range(lo, hi, _CHUNK):
            chunk = bits[start : min(start + _CHUNK, hi)]
            at = np.arange(offset + start, offset + start + chunk.size, dtype=np.uint64)
            total += hasher.sum(hasher.keys(at), chunk)
        return total & _MASK

    return _spread_sum(bits.size, part, workers)


def _move(name: str, index: torch.Tensor, old: torch.Tensor, new: torch.Tensor, *, workers: int | None = None) -> int:
    """``sum h(name, index, new) - sum h(name, index, old)`` (mod 2**64): each chunk's keys are
    built once for both."""
    device = _on_device(index, old, new)
    if device is not None:
        if not (index.numel() == new.numel() == old.numel()):
            raise ValueError(f"{name}: {index.numel()} indices, {new.numel()} new and {old.numel()} old values")
        on_device = DeviceHasher(device)
        on_device.add(name, index, new)
        on_device.add(name, index, old, sign=-1)
        return on_device.value()
    idx, new_bits, old_bits = _host_move_bits(name, index, old, new)
    return _keyed_sum(_seed(name), idx, new_bits, old_bits, workers=workers)


def _host_move_bits(name: str, index: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> tuple[np.ndarray, ...]:
    """A move's indices, new and old bits on the host, of one length (else a ValueError naming ``name``)."""
    idx, new_bits, old_bits = _index_u64(index), _bits_u16(new), _bits_u16(old)
    if not (idx.size == new_bits.size == old_bits.size):
        raise ValueError(f"{name}: {idx.size} indices, {new_bits.size} new and {old_bits.size} old values")
    return idx, new_bits, old_bits


def format_fingerprint(value: int) -> str:
    """The wire form: 16 lower-case hex digits."""
    return f"{value & _MASK:016x}"


def parse_fingerprint(text: str) -> int:
    if not isinstance(text, str) or len(text) != 16:
        raise ValueError(f"a fingerprint is 16 hex digits, got {text!r}")
    return int(text, 16)


def fingerprint(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Fingerprint of a full state (name -> tensor), hashed as bf16 (one-byte codes of a
    quantized view by their bits).

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


def fingerprint_slices(slices: Iterable[tuple[str, torch.Tensor, int]]) -> int:
    """The sum (mod 2**64) of :func:`fingerprint_slice_share` over ``(name, values, offset)``
    items: the share of many contiguous slices, such as a server's live weights.

    Host slices of fewer than 64K elements are hashed together, each element keyed with its own
    name's seed, 64K elements at a time; larger ones alone, over the hashing threads. Slices on
    an accelerator are hashed there (:meth:`DeviceHasher.add_slices`: small ones together), with
    one read of each device's sum at the end. The cost follows the elements, not the number of
    slices; the sum is the same either way."""
    total = 0
    on_devices: dict[torch.device, list[tuple[str, torch.Tensor, int]]] = {}
    seeds: list[np.uint64] = []
    parts: list[np.ndarray] = []
    shifts: list[int] = []
    pending = 0

    def flush() -> None:
        nonlocal total, pending
        if not seeds:
            return
        lengths = [p.size for p in parts]
        index = np.arange(pending, dtype=np.int64)
        index += np.repeat(np.array(shifts, dtype=np.int64), lengths)
        keyed = np.repeat(np.array(seeds, dtype=np.uint64), lengths)
        total += _keyed_sum(keyed, index.view(np.uint64), np.concatenate(parts))
        seeds.clear()
        parts.clear()
        shifts.clear()
        pending = 0

    for name, values, offset in slices:
        n = values.numel()
        if n == 0:
            continue
        device = _on_device(values)
        if device is not None:
            on_devices.setdefault(device, []).append((name, values, offset))
        elif n >= _CHUNK:
            total += _tensor_sum(name, values, offset)
        else:
            seeds.append(_seed(name))
            parts.append(_bits_u16(values))
            shifts.append(offset - pending)  # the batch's element j of this slice is index j + shift
            pending += n
            if pending >= _CHUNK:
                flush()
    flush()
    for device, items in on_devices.items():
        hasher = DeviceHasher(device)
        hasher.add_slices(items)
        total += hasher.value()
    return total & _MASK


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
    return format_fingerprint(parse_fingerprint(value) + _move(name, index, old, new))


def fingerprint_move(name: str, index: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> int:
    """How much elements ``index`` of ``name`` going from ``old`` to ``new`` move the fingerprint
    sum (mod 2**64): ``fingerprint_share`` of the new values minus that of the old ones."""
    if index.numel() == 0:
        return 0
    return _move(name, index, old, new)


def fingerprint_runs_move(names: Sequence[str], counts: Sequence[int], index: torch.Tensor, old: torch.Tensor,
                          new: torch.Tensor) -> int:  # fmt: skip
    """:func:`fingerprint_moves` of consecutive runs of one set of changes: the first
    ``counts[0]`` elements of ``index``, ``old`` and ``new`` are ``names[0]``'s, the next
    ``counts[1]`` ``names[1]``'s, and so on (a fused parameter's changes, split into the
    checkpoint tensors it holds). On the host, one round of hashing for all of them, each element
    keyed with its run's name's seed."""
    if len(names) != len(counts) or sum(counts) != index.numel():
        raise ValueError(f"{len(names)} names and {len(counts)} runs of {sum(counts)} elements for {index.numel()} changes")
    if _on_device(index, old, new) is not None:
        ends = np.cumsum(counts).tolist()
        return fingerprint_moves((name, index[e - c : e], old[e - c : e], new[e - c : e])
                                 for name, c, e in zip(names, counts, ends) if c)  # fmt: skip
    seeds = np.repeat(np.array([_seed(name) for name in names], dtype=np.uint64), counts)
    idx, new_bits, old_bits = _host_move_bits(names[0] if len(names) == 1 else "runs", index, old, new)
    return _keyed_sum(seeds, idx, new_bits, old_bits) & _MASK


def fingerprint_moves(moves: Iterable[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]) -> int:
    """The sum (mod 2**64) of :func:`fingerprint_move` over ``(name, index, old, new)`` items: how
    far a version's changes move the fingerprint.

    Host changes of fewer than 64K elements per name are hashed together, each element keyed with
    its own name's seed, 64K elements at a time: one round of NumPy calls for many small tensors
    (a MoE checkpoint's experts, biases, norms) instead of one per tensor. Larger ones, and
    changes on an accelerator, are hashed as :func:`fingerprint_move` hashes them. The sum is the
    same either way."""
    total = 0
    seeds: list[np.uint64] = []
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    pending = 0

    def flush() -> None:
        nonlocal total, pending
        if not seeds:
            return
        idx, new_bits, old_bits = (p[0] if len(p) == 1 else np.concatenate(p) for p in parts)
        keyed = np.repeat(np.array(seeds, dtype=np.uint64), [len(i) for i in parts[0]])
        total += _keyed_sum(keyed, idx, new_bits, old_bits)
        seeds.clear()
        for p in parts:
            p.clear()
        pending = 0

    for name, index, old, new in moves:
        if index.numel() == 0:
            continue
        if index.numel() >= _CHUNK or _on_device(index, old, new) is not None:
            total += _move(name, index, old, new)
            continue
        bits = _host_move_bits(name, index, old, new)
        seeds.append(_seed(name))
        for p, a in zip(parts, bits):
            p.append(a)
        pending += bits[0].size
        if pending >= _CHUNK:
            flush()
    flush()
    return total & _MASK


def fingerprint_share(name: str, index: torch.Tensor, values: torch.Tensor) -> int:
    """The part of the fingerprint sum that elements ``index`` of ``name`` contribute (mod 2**64).

    A state split across processes (tensor-parallel shards) hashes as the sum of its
    parts' shares, provided every element is counted in exactly one part.
    """
    if index.numel() == 0:
        return 0
    device = _on_device(index, values)
    if device is not None:
        hasher = DeviceHasher(device)
        hasher.add(name, index, values)
        return hasher.value()
    return _hash_sum(name, _index_u64(index), _bits_u16(values))


def fingerprint_add(value: str | int, *shares: int) -> str:
    """``value`` (a fingerprint, or 0) moved by ``shares`` (sums of element hashes, may be negative)."""
    total = parse_fingerprint(value) if isinstance(value, str) else int(value)
    for share in shares:
        total += share
    return format_fingerprint(total)
