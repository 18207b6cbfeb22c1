"""The worker calls (deltasync/protocol/calls.py): each method's name, arguments and answer are
defined once; the worker extension has a method for each; what is sent is what the workers have
always been sent; a version and a tag are parsed once, where they enter."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, fields
from typing import ClassVar

import pytest
from servers import requires_vllm

from deltasync import AuthError, FormatError, VersionError
from deltasync.protocol import (
    ALL_CALLS,
    ApplyCall,
    BeginCall,
    LoraFingerprintCall,
    LoraModulesAnswer,
    LoraModulesCall,
    PrefetchCall,
    PrefetchState,
    StatusCall,
    UpdateAnswer,
    VersionRequest,
    WorkerStatus,
)
from deltasync.protocol.calls import optional


@requires_vllm  # importing vllm_ext registers its backend with vLLM
def test_every_call_is_a_method_of_the_worker_extension_taking_its_arguments() -> None:
    from vllm_ext._extension import DeltaWorkerExtension

    names = [call.method for call in ALL_CALLS]
    assert len(set(names)) == len(names) and all(name.startswith("deltasync_") for name in names)
    for call in ALL_CALLS:
        method = getattr(DeltaWorkerExtension, call.method)
        params = list(inspect.signature(method).parameters)[1:]  # after self
        assert params == [f.name for f in fields(call)], call


def test_the_arguments_sent_are_those_the_workers_have_always_had() -> None:
    assert StatusCall().args() == ()
    assert PrefetchCall(version=2, auth="tag").args() == (2, "tag")
    assert BeginCall(version=3).args() == (3, None)  # the tag is sent even when there is none
    assert ApplyCall(version=0, auth=None).args() == (0, None)
    assert LoraFingerprintCall(lora_id=7, path="/a/b", names=["x", "y"]).args() == (7, "/a/b", ["x", "y"])
    assert (ApplyCall.method, BeginCall.method, PrefetchCall.method, StatusCall.method) == (
        "deltasync_apply", "deltasync_begin", "deltasync_prefetch", "deltasync_status")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class _BeginWithPointer(BeginCall):
    """A call grown by one optional field, as a later release may grow ``deltasync_begin``."""

    method: ClassVar[str] = "deltasync_begin"
    pointer: bytes | None = optional()


def test_an_optional_field_is_one_line_and_is_sent_only_when_set() -> None:
    assert _BeginWithPointer(version=3, auth="t").args() == (3, "t")  # what a worker that predates it takes
    assert _BeginWithPointer(version=3, pointer=b"{}").args() == (3, None, b"{}")
    assert _BeginWithPointer.parse(4, "t") == _BeginWithPointer(version=4, auth="t", pointer=None)
    assert _BeginWithPointer.parse(4, None, pointer=b"{}").args() == (4, None, b"{}")


@pytest.mark.parametrize("version", ["1", True, False, -1, 1.0, None, [1]])
def test_a_version_that_is_not_one_is_refused_where_it_enters(version: object) -> None:
    for call in (VersionRequest, PrefetchCall, BeginCall, ApplyCall):
        with pytest.raises(VersionError, match=re.escape(f"version must be a non-negative integer, got {version!r}")):
            call.parse(version, "tag")


def test_a_parsed_request_holds_an_int_and_a_tag() -> None:
    assert ApplyCall.parse(5, "t") == ApplyCall(version=5, auth="t")
    assert VersionRequest.parse(0) == VersionRequest(version=0, auth=None)
    with pytest.raises(AuthError, match="the auth tag of the update to version 5 must be a string, got int"):
        ApplyCall.parse(5, 1234)


def test_answers_are_typed_and_a_malformed_one_names_its_field() -> None:
    status = {"rank": 0, "version": 3, "fingerprint": "ab" * 8, "mode": "in-place",
              "prefetch": {"version": 4, "state": "ready"}}  # fmt: skip
    (worker,) = BeginCall(version=4).answers([status])
    assert isinstance(worker, WorkerStatus) and worker.prefetch == PrefetchState(version=4, state="ready")
    assert StatusCall().answers([status, {**status, "rank": 1}])[1].rank == 1
    assert PrefetchCall(version=4).answers([{"version": 4, "state": "running"}]) == [PrefetchState(version=4, state="running")]
    assert ApplyCall(version=4).answers([{"version": 4, "nbytes": 10}]) == [UpdateAnswer(version=4, nbytes=10)]
    with pytest.raises(FormatError, match="worker status: version is str, expected int"):
        StatusCall().answers([{**status, "version": "3"}])
    with pytest.raises(FormatError, match="lora fingerprint answer: expected an object, got list"):
        LoraFingerprintCall(lora_id=1, path="p", names=[]).answers([[1]])
    with pytest.raises(FormatError, match="lora modules answer: modules is str, expected list or tuple"):
        LoraModulesCall().answers([{"modules": "q_proj"}])
    assert LoraModulesCall().answers([{"modules": ["q_proj"], "loadable": ["q_proj", "k_proj"]}]) == [
        LoraModulesAnswer(modules=["q_proj"], loadable=["q_proj", "k_proj"])]  # fmt: skip


@requires_vllm
def test_the_engine_cores_counted_apply_takes_the_applys_arguments_one_by_one() -> None:
    # vLLM's engine core checks a utility's arguments against its signature (no *args).
    from vllm_ext._vllm_engine import _apply_counted

    params = list(inspect.signature(_apply_counted).parameters.values())[1:]
    assert [p.name for p in params] == [f.name for f in fields(ApplyCall)]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
