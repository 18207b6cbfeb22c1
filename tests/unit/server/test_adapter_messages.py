"""The adapter flow's typed messages write the JSON the adapter routes have always answered
(``integration/lora/test_adapter_server.py`` reads it from a real server), and parse a request
in the order the route always checked it."""

from __future__ import annotations

import pytest

from deltasync import AuthError, VersionError
from deltasync.protocol.auth import update_tag
from deltasync.protocol.lora import AdapterError


def test_the_update_route_answers_the_status_and_what_the_update_did():
    from deltasync.server.adapter_messages import AdapterStatus, AdapterUpdate, FailedUpdate, LoraModules, ServedFingerprint

    loaded = AdapterUpdate(version=3, kind="delta", nbytes=10, stage_s=0.5, apply_s=0.25, adapter="p-v3", time=7.0)
    status = AdapterStatus(version=3, served=ServedFingerprint(fingerprint="ab"), bucket_fingerprint="ab", bucket="/b",
                           auth=True, loaded=["p-v2", "p-v3"], lora_ids={"p-v2": 1, "p-v3": 2}, base_fingerprint="cd",
                           last_update=loaded, last_error=FailedUpdate(version="x", error="bad", time=1.0))  # fmt: skip
    assert status.answer(loaded, ["p-v1"]) == {
        "version": 3, "fingerprint": "ab", "fingerprint_error": None, "bucket_fingerprint": "ab", "bucket": "/b",
        "auth": True, "loaded": ["p-v2", "p-v3"], "lora_ids": {"p-v2": 1, "p-v3": 2}, "base_fingerprint": "cd",
        "last_update": {"version": 3, "kind": "delta", "nbytes": 10, "stage_s": 0.5, "apply_s": 0.25,
                        "adapter": "p-v3", "time": 7.0},
        "last_error": {"version": "x", "error": "bad", "time": 1.0},
        "kind": "delta", "nbytes": 10, "stage_s": 0.5, "apply_s": 0.25, "unloaded": ["p-v1"],
    }  # fmt: skip
    noop = AdapterUpdate(version=3, kind="none")
    answer = status.answer(noop, None)  # a version already loaded: no "unloaded"
    assert noop.to_json() == {"version": 3, "kind": "none", "nbytes": 0, "stage_s": 0.0, "apply_s": 0.0}
    assert "unloaded" not in answer and answer["kind"] == "none" and "lora_modules" not in answer
    from dataclasses import replace

    full = replace(status, modules=LoraModules(modules=None, problem="why")).to_json()
    assert (full["lora_modules"], full["lora_modules_error"]) == (None, "why")


def test_the_workers_answers():
    from deltasync.server.adapter_messages import LoraModules, ServedFingerprint

    from deltasync.protocol import LoraFingerprintCall, LoraModulesCall

    modules, held = LoraModulesCall().answers, LoraFingerprintCall(lora_id=1, path="p", names=[]).answers
    assert LoraModules.from_answers(modules([{"modules": ["q_proj", "v_proj"]}, {"modules": ["q_proj"]}])).modules == ["q_proj", "v_proj"]
    assert LoraModules.from_answers(modules([{"modules": [], "problem": "MoE"}])) == LoraModules(modules=None, problem="MoE")
    ok = {"fingerprint": "ab", "inexact": [], "missing": [], "unclaimed": 0}
    assert ServedFingerprint.from_answers("p-v1", held([ok, ok])) == ServedFingerprint(fingerprint="ab")
    bad = ServedFingerprint.from_answers("p-v1", held([ok, {**ok, "fingerprint": None, "missing": ["a.lora_A"]}]))
    assert bad.mismatch and bad.error == "worker 1 does not hold p-v1 as loaded from the bucket (missing: ['a.lora_A'])"
    apart = ServedFingerprint.from_answers("p-v1", held([ok, {**ok, "fingerprint": "cd"}]))
    assert not apart.mismatch and apart.error == "the workers disagree on p-v1: ['ab', 'cd']"


def test_a_request_is_checked_in_the_routes_order():
    from deltasync.server.adapter_messages import AdapterRequest

    good = {"version": 2, "auth": update_tag("t", 2), "name": "policy", "keep": 3}
    request = AdapterRequest.parse(good, "t")
    assert (request.version, request.name, request.keep, request.adapter) == (2, "policy", 3, "policy-v2")
    assert AdapterRequest.parse({"version": 2, "name": "p"}, None).keep == 2
    for body, error, match in [
        ({**good, "version": "2", "name": "../x"}, VersionError, "version must be a non-negative integer, got '2'"),  # the version first
        ({**good, "auth": "00", "name": "../x"}, AuthError, "the auth tag of the update to version 2 is wrong"),
        ({**good, "name": "../x", "keep": 0}, AdapterError, r"name '../x': use letters"),
        ({**good, "keep": True}, AdapterError, "keep must be an integer >= 1, got True"),
    ]:
        with pytest.raises(error, match=match):
            AdapterRequest.parse(body, "t")
