"""The adapter flow's typed messages: the update request, parsed once at the route; the workers'
answers (``deltasync_lora_modules``, ``deltasync_lora_fingerprint``); and what the routes answer
(the last update, the last error, the status). Each ``to_json`` writes the JSON the routes have
always answered. Engine-neutral: no vLLM here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from deltasync.protocol import LoraFingerprintAnswer, LoraModulesAnswer, check_update_tag, check_version
from deltasync.protocol.lora import LORA_NAME_RE, AdapterError

__all__ = ["AdapterRequest", "AdapterStatus", "AdapterUpdate", "FailedUpdate", "LoraModules", "ServedFingerprint"]


@dataclass(frozen=True, kw_only=True)
class AdapterRequest:
    """``POST /deltasync/lora/update {"version": N, "auth": TAG, "name": NAME, "keep": K}``."""

    version: int
    name: str
    """Loaded as ``NAME-vN``."""
    keep: int = 2
    """How many of the newest versions stay loaded."""

    @property
    def adapter(self) -> str:
        return f"{self.name}-v{self.version}"

    @classmethod
    def parse(cls, body: Mapping[str, Any], token: str | None) -> AdapterRequest:
        """Check the body in the order the route always did: the version, its tag under
        ``token``, the name, ``keep``; the first problem raises, naming the field."""
        version = check_version(body.get("version"))
        check_update_tag(token, version, body.get("auth"))
        name = body.get("name")
        if not isinstance(name, str) or not LORA_NAME_RE.match(name):
            raise AdapterError(f"name {name!r}: use letters, digits, '.', '_' and '-' (at most 100)")
        keep = body.get("keep", 2)
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise AdapterError(f"keep must be an integer >= 1, got {keep!r}")
        return cls(version=version, name=name, keep=keep)


@dataclass(frozen=True, kw_only=True)
class AdapterUpdate:
    """What an adapter update did (``last_update`` in the status)."""

    version: int
    kind: str
    """"anchor", "delta", or "none" for a version already loaded under that name."""
    nbytes: int = 0
    stage_s: float = 0.0
    apply_s: float = 0.0
    adapter: str | None = None
    """The name it was loaded as (None for a no-op)."""
    time: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": self.version, "kind": self.kind, "nbytes": self.nbytes,
                               "stage_s": self.stage_s, "apply_s": self.apply_s}  # fmt: skip
        if self.adapter is not None:
            out.update(adapter=self.adapter, time=self.time)
        return out


@dataclass(frozen=True, kw_only=True)
class FailedUpdate:
    """The last update that failed (``last_error``): nothing changed."""

    version: object
    """As the request named it (it may be what made the update fail)."""
    error: str
    time: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "error": self.error, "time": self.time}


@dataclass(frozen=True, kw_only=True)
class LoraModules:
    """The adapter modules whose LoRA the workers load and apply (``deltasync_lora_modules``)."""

    modules: list[str] | None
    """Sorted, over every worker; None when they cannot tell (``problem``)."""
    problem: str | None = None

    @classmethod
    def from_answers(cls, answers: list[LoraModulesAnswer]) -> LoraModules:
        problem = next((a.problem for a in answers if a.problem), None)
        if problem:
            return cls(modules=None, problem=problem)
        return cls(modules=sorted({m for a in answers for m in a.modules}))


@dataclass(frozen=True, kw_only=True)
class ServedFingerprint:
    """An adapter's fingerprint as the workers hold it (``deltasync_lora_fingerprint``)."""

    fingerprint: str | None = None
    error: str | None = None
    mismatch: bool = False
    """A worker holds tensors that differ from the adapter's files (not merely cannot tell)."""

    @classmethod
    def from_answers(cls, adapter: str, answers: list[LoraFingerprintAnswer]) -> ServedFingerprint:
        for rank, reply in enumerate(answers):
            if reply.fingerprint is None:
                what = [f"{k}: {v}" for k, v in (("inexact", reply.inexact), ("missing", reply.missing),
                                                  ("unclaimed", reply.unclaimed)) if v]  # fmt: skip
                return cls(mismatch=True,
                           error=f"worker {rank} does not hold {adapter} as loaded from the bucket ({'; '.join(what)})")  # fmt: skip
        found = {a.fingerprint for a in answers if a.fingerprint is not None}  # (none is None by now)
        if len(found) != 1:
            return cls(error=f"the workers disagree on {adapter}: {sorted(found)}")
        return cls(fingerprint=found.pop())


@dataclass(frozen=True, kw_only=True)
class AdapterStatus:
    """``POST /deltasync/lora/status`` (and the first fields of an update's answer)."""

    version: int | None
    """The newest loaded version."""
    served: ServedFingerprint
    """Its fingerprint as vLLM's workers hold it, not this process's copy."""
    bucket_fingerprint: str | None
    bucket: str | None
    auth: bool
    loaded: list[str]
    lora_ids: dict[str, int]
    base_fingerprint: str | None
    last_update: AdapterUpdate | None
    last_error: FailedUpdate | None
    modules: LoraModules | None = None
    """Only in the status route's answer."""

    def to_json(self) -> dict[str, Any]:
        out = {
            "version": self.version,
            "fingerprint": self.served.fingerprint,
            "fingerprint_error": self.served.error,
            "bucket_fingerprint": self.bucket_fingerprint,
            "bucket": self.bucket,
            "auth": self.auth,
            "loaded": self.loaded,
            "lora_ids": self.lora_ids,
            "base_fingerprint": self.base_fingerprint,
            "last_update": None if self.last_update is None else self.last_update.to_json(),
            "last_error": None if self.last_error is None else self.last_error.to_json(),
        }
        if self.modules is not None:
            out.update(lora_modules=self.modules.modules, lora_modules_error=self.modules.problem)
        return out

    def answer(self, update: AdapterUpdate, unloaded: list[str] | None) -> dict[str, Any]:
        """The update route's answer: the status, what the update did and, unless it was a
        no-op, the adapters it unloaded."""
        out = {**self.to_json(), "kind": update.kind, "nbytes": update.nbytes, "stage_s": update.stage_s,
               "apply_s": update.apply_s}  # fmt: skip
        if unloaded is not None:
            out["unloaded"] = unloaded
        return out
