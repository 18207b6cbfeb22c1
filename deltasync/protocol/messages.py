"""What a server's workers answer, typed: parsed once where the answer arrives.

The workers of a vLLM server (``vllm_ext``) answer ``collective_rpc`` calls with plain data
(tensors and objects do not cross that boundary). The API-server process
(``deltasync.server.server_sync``) and the trainer's :class:`~deltasync.RolloutClient` read those
answers through these classes instead of dicts read with ``.get``: a field of the wrong type
is a :class:`~deltasync.FormatError` naming the field, not a surprise further on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..errors import FormatError, VersionError

__all__ = [
    "Heal", "LoraFingerprintAnswer", "LoraModulesAnswer", "PrefetchState", "ServedBody", "UpdateAnswer", "WorkerStatus",
    "check_version",
]  # fmt: skip


def check_version(version: object, error: type[Exception] = VersionError) -> int:
    """``version`` if it is a version number (a non-negative ``int``, not a ``bool``), else
    ``error`` naming it: the one rule for every version a request, a call or a reader names."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise error(f"version must be a non-negative integer, got {version!r}")
    return version


def _take(data: Mapping[str, Any], name: str, kinds: tuple[type, ...], where: str, default: Any = ...) -> Any:
    if name not in data or data[name] is None:
        if default is ...:
            raise FormatError(f"{where}: the field {name!r} is missing")
        return default
    value = data[name]
    if isinstance(value, bool) and bool not in kinds:
        raise FormatError(f"{where}: {name} is {value!r}, expected {' or '.join(k.__name__ for k in kinds)}")
    if not isinstance(value, kinds):
        raise FormatError(f"{where}: {name} is {type(value).__name__}, expected {' or '.join(k.__name__ for k in kinds)}")
    return float(value) if kinds == (int, float) else value  # type: ignore[arg-type]


def _mapping(data: object, where: str) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise FormatError(f"{where}: expected an object, got {type(data).__name__}")
    return data


@dataclass(frozen=True, kw_only=True)
class Heal:
    """A version built from an anchor because its deltas could not be used: a delta file that is
    corrupt (fails its size, SHA-256 or fingerprint check) or missing, while an anchor of the
    chain could replace it. The result is exact (the anchor is checked like any file); the
    record is there so that the bucket's bad file does not go unnoticed."""

    version: int
    """The version staged."""
    anchor: int
    """The anchor it was built from."""
    error: str
    """Why the deltas could not be used: the refusal, naming the file."""
    time: float | None = None
    """When it was staged (seconds since the epoch)."""

    @classmethod
    def from_answer(cls, data: object, where: str = "heal") -> Heal:
        d = _mapping(data, where)
        return cls(
            version=_take(d, "version", (int,), where),
            anchor=_take(d, "anchor", (int,), where),
            error=_take(d, "error", (str,), where),
            time=_take(d, "time", (int, float), where, None),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _heal(data: Mapping[str, Any], name: str, where: str) -> Heal | None:
    value = _take(data, name, (Mapping,), where, None)
    return None if value is None else Heal.from_answer(value, f"{where}: {name}")


@dataclass(frozen=True, kw_only=True)
class PrefetchState:
    """A worker's background staging of one version (``deltasync_prefetch`` / status)."""

    version: int | None
    state: str
    """"running", "ready", "failed", "applied" (already served) or "refused" (not started:
    the version, tag or bucket was wrong; ``error`` says why)."""
    error: str | None = None
    kind: str | None = None
    nbytes: int = 0
    stage_s: float = 0.0
    cpus: tuple[int, ...] | None = None
    """The CPUs the staging thread ran on, where it was moved off the engine's cores (None: the
    worker's own; see ``deltasync.server.cpus``)."""
    nice: int = 0
    """The staging thread's nice value (``DELTASYNC_STAGING_NICE`` above the worker's)."""
    idle: bool = False
    """Whether the staging thread ran as Linux SCHED_IDLE (``DELTASYNC_STAGING_NICE=idle``)."""

    @classmethod
    def from_answer(cls, data: object, where: str = "prefetch answer") -> PrefetchState:
        d = _mapping(data, where)
        return cls(
            version=_take(d, "version", (int,), where, None),
            state=_take(d, "state", (str,), where, "failed" if d.get("error") else "running"),
            error=_take(d, "error", (str,), where, None),
            kind=_take(d, "kind", (str,), where, None),
            nbytes=_take(d, "nbytes", (int,), where, 0),
            stage_s=_take(d, "stage_s", (int, float), where, 0.0),
            cpus=None if (cpus := _take(d, "cpus", (list, tuple), where, None)) is None else tuple(int(c) for c in cpus),
            nice=_take(d, "nice", (int,), where, 0),
            idle=_take(d, "idle", (bool,), where, False),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class UpdateAnswer:
    """One worker's answer to an update (``deltasync_apply``, or its record in the status)."""

    version: int | None
    error: str | None = None
    """Set when this worker reports the update failed (only the last worker raises)."""
    fingerprint: str | None = None
    kind: str | None = None
    """"delta", "anchor" or "none"."""
    mode: str | None = None
    nbytes: int = 0
    """Bytes this worker downloaded."""
    prefetched: bool = False
    stage_s: float = 0.0
    apply_s: float = 0.0
    changed: int = 0
    sent: int = 0
    time: float | None = None
    healed: Heal | None = None
    """Set when the version was built from an anchor because a delta file was corrupt or missing."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further timings a target reports (an anchor's load and hash seconds)."""

    @classmethod
    def from_answer(cls, data: object, where: str = "update answer") -> UpdateAnswer:
        d = _mapping(data, where)
        known = {f.name for f in fields(cls)}
        return cls(
            version=_take(d, "version", (int,), where, None),
            error=_take(d, "error", (str,), where, None),
            fingerprint=_take(d, "fingerprint", (str,), where, None),
            kind=_take(d, "kind", (str,), where, None),
            mode=_take(d, "mode", (str,), where, None),
            nbytes=_take(d, "nbytes", (int,), where, 0),
            prefetched=_take(d, "prefetched", (bool,), where, False),
            stage_s=_take(d, "stage_s", (int, float), where, 0.0),
            apply_s=_take(d, "apply_s", (int, float), where, 0.0),
            changed=_take(d, "changed", (int,), where, 0),
            sent=_take(d, "sent", (int,), where, 0),
            time=_take(d, "time", (int, float), where, None),
            healed=_heal(d, "healed", where),
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(out.pop("extra"))
        return out


@dataclass(frozen=True, kw_only=True)
class WorkerStatus:
    """What one worker serves (``deltasync_status``)."""

    rank: int
    version: int | None
    """None before the first update, or when the served weights are no version (tainted)."""
    fingerprint: str | None
    """Of the weights served: hashed from the live weights in place, from the host copy in reload mode."""
    mode: str
    """"in-place" or "reload"."""
    fallback: tuple[str, ...] = ()
    tainted: str | None = None
    host_copy_bytes: int = 0
    bucket: str | None = None
    auth: bool = False
    checkpoint: str | None = None
    last_update: UpdateAnswer | None = None
    last_error: dict[str, Any] | None = None
    prefetch: PrefetchState | None = None
    view: str | None = None
    """The quantized view served and followed (None: the bf16 chain); ``fingerprint`` is then
    that of the view's state (codes, scales and bf16 parameters)."""
    last_heal: Heal | None = None
    """The last version this worker built from an anchor because a delta file was corrupt or
    missing (None: none since it started)."""

    @classmethod
    def from_answer(cls, data: object, where: str = "worker status") -> WorkerStatus:
        d = _mapping(data, where)
        fallback = _take(d, "fallback", (list, tuple), where, ())
        last = _take(d, "last_update", (Mapping,), where, None)
        prefetch = _take(d, "prefetch", (Mapping,), where, None)
        return cls(
            rank=_take(d, "rank", (int,), where),
            version=_take(d, "version", (int,), where, None),
            fingerprint=_take(d, "fingerprint", (str,), where, None),
            mode=_take(d, "mode", (str,), where, "reload"),
            fallback=tuple(str(name) for name in fallback),
            tainted=_take(d, "tainted", (str,), where, None),
            host_copy_bytes=_take(d, "host_copy_bytes", (int,), where, 0),
            bucket=_take(d, "bucket", (str,), where, None),
            auth=_take(d, "auth", (bool,), where, False),
            checkpoint=_take(d, "checkpoint", (str,), where, None),
            last_update=None if last is None else UpdateAnswer.from_answer(last, f"{where}: last_update"),
            last_error=None if _take(d, "last_error", (Mapping,), where, None) is None else dict(d["last_error"]),
            prefetch=None if prefetch is None else PrefetchState.from_answer(prefetch, f"{where}: prefetch"),
            view=_take(d, "view", (str,), where, None),
            last_heal=_heal(d, "last_heal", where),
        )

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["fallback"] = list(self.fallback)
        out["last_update"] = None if self.last_update is None else self.last_update.to_json()
        return out


@dataclass(frozen=True, kw_only=True)
class LoraModulesAnswer:
    """One worker's answer to ``deltasync_lora_modules``: the adapter modules whose LoRA it loads
    and applies."""

    modules: list[str]
    """Loaded and applied (empty where ``problem`` says why none can be)."""
    loadable: list[str] = field(default_factory=list)
    """What vLLM's loader accepts in an adapter file."""
    problem: str | None = None
    """Why this worker serves no adapter (a model vLLM cannot serve LoRA on)."""

    @classmethod
    def from_answer(cls, data: object, where: str = "lora modules answer") -> LoraModulesAnswer:
        d = _mapping(data, where)
        return cls(
            modules=[str(m) for m in _take(d, "modules", (list, tuple), where)],
            loadable=[str(m) for m in _take(d, "loadable", (list, tuple), where, ())],
            problem=_take(d, "problem", (str,), where, None),
        )


@dataclass(frozen=True, kw_only=True)
class LoraFingerprintAnswer:
    """One worker's answer to ``deltasync_lora_fingerprint``: a loaded adapter's fingerprint
    from the tensors it holds."""

    fingerprint: str | None
    """None unless every tensor held is exactly what vLLM makes of the adapter's files."""
    inexact: list[str] = field(default_factory=list)
    """Tensor names whose held tensor differs."""
    missing: list[str] = field(default_factory=list)
    """Tensor names the worker holds nothing for."""
    unclaimed: int = 0
    """Held tensors that no name maps to."""
    dtype: str | None = None

    @classmethod
    def from_answer(cls, data: object, where: str = "lora fingerprint answer") -> LoraFingerprintAnswer:
        d = _mapping(data, where)
        return cls(
            fingerprint=_take(d, "fingerprint", (str,), where, None),
            inexact=[str(n) for n in _take(d, "inexact", (list, tuple), where, ())],
            missing=[str(n) for n in _take(d, "missing", (list, tuple), where, ())],
            unclaimed=_take(d, "unclaimed", (int,), where, 0),
            dtype=_take(d, "dtype", (str,), where, None),
        )


@dataclass(frozen=True, kw_only=True)
class ServedBody:
    """The answer of ``GET /deltasync/status``: what a server serves, and its follow mode."""

    version: int | None
    """The lowest version any worker serves."""
    fingerprint: str | None
    """Of what is served (None when the workers disagree)."""
    mode: str
    follow: dict[str, Any]
    workers: tuple[WorkerStatus, ...]
    view: str | None = None
    """The quantized view served (None: the bf16 chain)."""

    @classmethod
    def from_answer(cls, data: object, where: str = "status") -> ServedBody:
        d = _mapping(data, where)
        workers = _take(d, "workers", (list,), where)
        return cls(
            version=_take(d, "version", (int,), where, None),
            fingerprint=_take(d, "fingerprint", (str,), where, None),
            mode=_take(d, "mode", (str,), where),
            follow=dict(_mapping(_take(d, "follow", (Mapping,), where), f"{where}: follow")),
            workers=tuple(WorkerStatus.from_answer(w, f"{where}: workers[{i}]") for i, w in enumerate(workers)),
            view=_take(d, "view", (str,), where, None),
        )
