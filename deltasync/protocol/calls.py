"""The worker calls: each method a server's workers answer, its arguments and its answer, once.

The API-server process (the update flow, the follower, the update route, the adapter flow) and
the trainer's :class:`~deltasync.RolloutClient` call the workers of a vLLM server through
``collective_rpc``; the worker extension (``vllm_ext.DeltaWorkerExtension``) has one method per
call. A call is a frozen dataclass:

- its class attribute ``method`` names the worker method it runs;
- its fields are the method's arguments, in the order the method takes them, and
  :meth:`WorkerCall.args` is what is sent (``collective_rpc(call.method, args=call.args())``);
- :meth:`WorkerCall.answer` parses one worker's answer (plain data) into its typed form.

A call that names a version is a :class:`VersionRequest`: :meth:`VersionRequest.parse` checks
the version and the tag once, where they enter (a route's body, a worker's arguments), and
everything after holds an ``int``. A new optional argument is one line in its call,
``name: T | None = optional()``: it is sent only when set, so a worker that predates it still
gets the call it knows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Generic, Self, TypeVar

from ..errors import AuthError, FormatError
from .messages import LoraFingerprintAnswer, LoraModulesAnswer, PrefetchState, UpdateAnswer, WorkerStatus, check_version

__all__ = [
    "ALL_CALLS",
    "ApplyCall",
    "BeginCall",
    "LoraFingerprintCall",
    "LoraModulesCall",
    "PrefetchCall",
    "StatusCall",
    "VerifyCall",
    "VersionRequest",
    "WorkerCall",
    "optional",
]

A = TypeVar("A")

_SENT_WHEN_SET = "deltasync.sent_when_set"


def optional(default: Any = None) -> Any:
    """A field added to a call after its first release: sent only when it is not ``default``, so
    a worker that predates it gets the arguments it takes."""
    return field(default=default, metadata={_SENT_WHEN_SET: True})


@dataclass(frozen=True, kw_only=True)
class WorkerCall(Generic[A]):
    """One call of a worker-extension method, answered by every worker (see the module)."""

    method: ClassVar[str]
    """The worker-extension method it runs."""

    def args(self) -> tuple[Any, ...]:
        """The method's positional arguments, as sent: every field in order, less the trailing
        :func:`optional` fields that are not set."""
        items = [(f, getattr(self, f.name)) for f in fields(self)]
        while items and items[-1][0].metadata.get(_SENT_WHEN_SET) and items[-1][1] == items[-1][0].default:
            items.pop()
        return tuple(value for _, value in items)

    def answer(self, data: object) -> A:
        """One worker's answer, typed (:class:`~deltasync.FormatError` naming the field if it is not)."""
        raise NotImplementedError

    def answers(self, data: Iterable[object]) -> list[A]:
        """Every worker's answer, in rank order, typed."""
        return [self.answer(item) for item in data]


def _as_mapping(data: object, where: str) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise FormatError(f"{where}: expected an object, got {type(data).__name__}")
    return dict(data)


@dataclass(frozen=True, kw_only=True)
class VersionRequest:
    """An update to ``version`` with its tag, as every entry point takes it."""

    version: int
    """A committed version (a non-negative ``int``)."""
    auth: str | None = None
    """The tag of the update (``deltasync.protocol.update_tag``); None without a token."""

    @classmethod
    def parse(cls, version: object, auth: object = None, **more: Any) -> Self:
        """``version`` and ``auth`` checked where they enter: :class:`~deltasync.VersionError`
        unless the version is a non-negative ``int``; :class:`~deltasync.AuthError` unless the
        tag is a string or None (a tag of another type can authenticate nothing). ``more``: the
        call's further fields, as given."""
        checked = check_version(version)
        if auth is not None and not isinstance(auth, str):
            raise AuthError(f"the auth tag of the update to version {checked} must be a string, got {type(auth).__name__}")
        return cls(version=checked, auth=auth, **more)


@dataclass(frozen=True, kw_only=True)
class StatusCall(WorkerCall[WorkerStatus]):
    """``deltasync_status()``: what the worker serves."""

    method: ClassVar[str] = "deltasync_status"

    def answer(self, data: object) -> WorkerStatus:
        return WorkerStatus.from_answer(data)


@dataclass(frozen=True, kw_only=True)
class PrefetchCall(VersionRequest, WorkerCall[PrefetchState]):
    """``deltasync_prefetch(version, auth)``: start staging ``version`` in the background."""

    method: ClassVar[str] = "deltasync_prefetch"

    def answer(self, data: object) -> PrefetchState:
        return PrefetchState.from_answer(data)


@dataclass(frozen=True, kw_only=True)
class BeginCall(VersionRequest, WorkerCall[WorkerStatus]):
    """``deltasync_begin(version, auth[, pointer])``: a prefetch and the status in one call; the
    status's ``prefetch`` answers the prefetch ("refused", with the reason, where it could not
    start)."""

    method: ClassVar[str] = "deltasync_begin"
    pointer: bytes | None = optional()
    """The committed pointer's bytes as the follower read them: the workers stage from them
    instead of reading the pointer again (sent only by the follower)."""

    def answer(self, data: object) -> WorkerStatus:
        return WorkerStatus.from_answer(data)


@dataclass(frozen=True, kw_only=True)
class ApplyCall(VersionRequest, WorkerCall[UpdateAnswer]):
    """``deltasync_apply(version, auth)``: stage (or take the staged), check and apply ``version``
    on every worker, all ranks or none."""

    method: ClassVar[str] = "deltasync_apply"

    def answer(self, data: object) -> UpdateAnswer:
        return UpdateAnswer.from_answer(data)


@dataclass(frozen=True, kw_only=True)
class VerifyCall(WorkerCall[dict[str, Any]]):
    """``deltasync_verify()``: recompute the served fingerprint in full (``ok``, ``fingerprint``,
    ``expected``, ``mode``)."""

    method: ClassVar[str] = "deltasync_verify"

    def answer(self, data: object) -> dict[str, Any]:
        return _as_mapping(data, f"{self.method} answer")


@dataclass(frozen=True, kw_only=True)
class LoraModulesCall(WorkerCall[LoraModulesAnswer]):
    """``deltasync_lora_modules()``: the adapter modules whose LoRA the worker loads and applies."""

    method: ClassVar[str] = "deltasync_lora_modules"

    def answer(self, data: object) -> LoraModulesAnswer:
        return LoraModulesAnswer.from_answer(data)


@dataclass(frozen=True, kw_only=True)
class LoraFingerprintCall(WorkerCall[LoraFingerprintAnswer]):
    """``deltasync_lora_fingerprint(lora_id, path, names)``: the fingerprint of loaded adapter
    ``lora_id`` from the tensors the worker holds."""

    method: ClassVar[str] = "deltasync_lora_fingerprint"

    lora_id: int
    """vLLM's id of the loaded adapter."""
    path: str
    """The adapter's directory as loaded."""
    names: list[str]
    """The adapter's tensor names in the bucket."""

    def answer(self, data: object) -> LoraFingerprintAnswer:
        return LoraFingerprintAnswer.from_answer(data)


#: Every worker call, each answered by the worker-extension method of its ``method``.
ALL_CALLS: tuple[type[WorkerCall[Any]], ...] = (
    StatusCall, PrefetchCall, BeginCall, ApplyCall, VerifyCall, LoraModulesCall, LoraFingerprintCall,
)  # fmt: skip
