"""The per-token version lists: parser, format, the version of a token, and RolloutClient.complete
against a fake server (the real server: integration/vllm_ext/test_inflight_server.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from deltasync import FormatError, RolloutClient, parse_token_versions, version_of_token
from deltasync.protocol.token_versions import (
    MAX_CHOICES,
    MAX_ENTRIES,
    fits_bounds,
    format_token_versions,
    versioned_completion,
)


def test_the_header_and_the_comment_parse_to_one_list_per_choice():
    assert parse_token_versions("3:0,4:17,5:90") == [[(3, 0), (4, 17), (5, 90)]]
    assert parse_token_versions(": x-deltasync-token-versions 3:0,4:17;3:0\n") == [[(3, 0), (4, 17)], [(3, 0)]]
    assert parse_token_versions("none:0,1:0,2:?") == [[(None, 0), (1, 0), (2, None)]]
    for value in ("3:0,4:17;none:0,1:0,2:?", "7:0"):
        assert format_token_versions(parse_token_versions(value)) == value


@pytest.mark.parametrize(
    ("value", "why"),
    [("", "is empty"), ("3:0,4", "'4' is not VERSION:FIRST_TOKEN"), ("3:0,x:4", "'x:4' is not VERSION:FIRST_TOKEN"),
     ("3:0,4:-1", "'4:-1' is not"), ("3:2", "must start at token 0"), ("3:0,4:9,5:3", "never go back")],
)  # fmt: skip
def test_a_bad_list_is_refused_naming_the_part(value, why):
    with pytest.raises(FormatError, match="x-deltasync-token-versions") as error:
        parse_token_versions(value)
    assert why in str(error.value)


def test_the_version_of_each_token():
    entries = [(3, 0), (4, 2), (5, 2), (6, 5)]
    assert [version_of_token(entries, i) for i in range(7)] == [3, 3, 5, 5, 5, 6, 6]
    assert [version_of_token([(3, 0), (4, None)], i) for i in range(2)] == [3, 3]  # unknown: the older


def test_complete_returns_the_answer_with_its_token_versions():
    seen = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, json.loads(request.content), request.headers.get("authorization")))
        body = {"choices": [{"index": 0, "token_ids": [5, 6, 7, 8]}, {"index": 1, "token_ids": [5, 9]}]}
        headers = {"x-deltasync-version": "3", "x-deltasync-token-versions": "3:0,4:2;3:0,4:2"}
        return httpx.Response(200, json=body, headers=headers)

    client = RolloutClient("http://a:8000", "secret", transport=httpx.MockTransport(handle))
    answer = client.complete({"prompt": "hi", "n": 2}, chat=True)
    assert seen == [("/v1/chat/completions", {"prompt": "hi", "n": 2}, "Bearer secret")]
    assert answer.version == 3 and answer.token_versions == [[(3, 0), (4, 2)], [(3, 0), (4, 2)]]
    assert answer.versions_of(0) == [3, 3, 4, 4] and answer.versions_of(1) == [3, 3]


def test_complete_says_what_is_missing():
    plain = httpx.MockTransport(lambda request: httpx.Response(200, json={"choices": []}))
    with pytest.raises(FormatError, match="needs vllm_ext.UpdateMiddleware"):
        RolloutClient("http://a:8000", transport=plain).complete({"prompt": "hi"})
    with pytest.raises(Exception, match="takes non-streamed requests"):
        RolloutClient("http://a:8000", transport=plain).complete({"prompt": "hi", "stream": True})


# --------------------------------------------------------------------------- hostile values


@pytest.mark.parametrize("admitted", ["x", "-1", "", "9" * 5000, "٣", "３", "03", str(2**50 + 1), " 3"])
def test_a_bad_admission_version_is_a_format_error_naming_the_header(admitted):
    with pytest.raises(FormatError, match=r"x-deltasync-version '.*' is not a version \(an ASCII decimal up to "
                       r"1125899906842624, or 'none'\)"):  # fmt: skip
        versioned_completion({}, {"x-deltasync-token-versions": "3:0", "x-deltasync-version": admitted})
    assert versioned_completion({}, {"x-deltasync-token-versions": "3:0", "x-deltasync-version": str(2**50)}).version == 2**50


@pytest.mark.parametrize(
    "value",
    ["٣:٠,٤:١٧", "３:０", "3:0,٤:17", "9" * 4300 + ":0", "3:0," + "9" * 5000 + ":1", f"{2**50 + 1}:0", "03:0",
     "3:0,4:01", "-1:0", "3:0,4:-1", "3:0,+4:1", "3:0,4:1e3", "3 :0", "3:0;", ";3:0", "3:0,,4:1"],
)  # fmt: skip
def test_only_ascii_decimals_up_to_the_pointers_cap_are_versions(value):
    with pytest.raises(FormatError, match="x-deltasync-token-versions"):
        parse_token_versions(value)


def test_the_largest_version_and_the_bounds_themselves_parse():
    assert parse_token_versions(f"{2**50}:0,none:{2**50}") == [[(2**50, 0), (None, 2**50)]]
    most = ";".join(["3:0"] * MAX_CHOICES)
    assert len(parse_token_versions(most)) == MAX_CHOICES
    one = ",".join(["3:0"] * MAX_ENTRIES)
    assert len(parse_token_versions(one)[0]) == MAX_ENTRIES
    widest = ",".join([f"{2**50}:{2**50}"] * (MAX_ENTRIES - 1))
    assert len(parse_token_versions(f": x-deltasync-token-versions {2**50}:0,{widest}\n")[0]) == MAX_ENTRIES


def test_a_list_past_the_bounds_is_refused_saying_which():
    with pytest.raises(FormatError, match=f"lists {MAX_CHOICES + 1} choices, more than {MAX_CHOICES} \\(vLLM's largest n\\)"):
        parse_token_versions(";".join(["3:0"] * (MAX_CHOICES + 1)))
    with pytest.raises(FormatError, match=f"lists {MAX_ENTRIES + 1} entries, more than {MAX_ENTRIES}"):
        parse_token_versions(",".join(["3:0"] * (MAX_ENTRIES + 1)))
    with pytest.raises(FormatError, match="characters, more than"):
        parse_token_versions(": x-deltasync-token-versions " + "3:0," * 2_600_000 + "3:0")


def test_a_server_sends_no_list_a_parser_refuses():
    assert fits_bounds([[(3, 0)]] * MAX_CHOICES) and not fits_bounds([[(3, 0)]] * (MAX_CHOICES + 1))
    assert fits_bounds([[(3, 0)] * MAX_ENTRIES]) and not fits_bounds([[(3, 0)] * (MAX_ENTRIES + 1)])
    assert not fits_bounds([[(2**50 + 1, 0)]]) and fits_bounds([[(None, 0), (2**50, None)]])


def _seconds(call) -> float:
    """Seconds ``call()`` takes (whatever it raised)."""
    import time

    start = time.perf_counter()
    try:
        call()
    except FormatError:
        pass
    return time.perf_counter() - start


def _cost(call) -> tuple[float, int]:
    """Seconds and peak bytes Python allocated for ``call()`` (whatever it raised)."""
    import time
    import tracemalloc

    tracemalloc.start()
    start = time.perf_counter()
    try:
        call()
    except FormatError:
        pass
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return seconds, peak


# Adversarial pieces: non-ASCII digits, huge numbers, signs, separators, reversed boundaries.
_PIECES = st.sampled_from([
    "3", "0", "17", "none", "?", ":", ",", ";", " ", "-", "+", "٣", "３", "٠", "1e3", "9" * 17, "9" * 5000, "\n",
    ": x-deltasync-token-versions ", str(2**50), str(2**50 + 1), "\x00", "é",
])  # fmt: skip
_ENTRY = st.tuples(st.one_of(st.integers(-5, 2**51), st.just(None)), st.one_of(st.integers(-5, 2**51), st.just(None)))


def _listed(choices: list[list[tuple[int | None, int | None]]]) -> str:
    return ";".join(",".join(f"{'none' if v is None else v}:{'?' if s is None else s}" for v, s in c) for c in choices)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.one_of(
        st.text(max_size=200),
        st.lists(_PIECES, max_size=60).map("".join),
        st.lists(st.lists(_ENTRY, min_size=1, max_size=6), min_size=1, max_size=6).map(_listed),
        st.tuples(st.lists(_PIECES, max_size=4).map("".join), st.integers(1, 3_000_000)).map(lambda p: p[0] * (p[1] // max(len(p[0]), 1))),
    )
)  # fmt: skip
def test_any_value_parses_or_is_a_format_error_cheaply(value):
    def both() -> None:
        try:
            parse_token_versions(value)
        finally:
            versioned_completion({}, {"x-deltasync-token-versions": "3:0", "x-deltasync-version": value})

    _, peak = _cost(both)
    seconds = _seconds(both)  # a guard against quadratic work, not a speed figure (see below)
    assert seconds < 20.0 and peak < 64 << 20, (len(value), seconds, peak)


@pytest.mark.parametrize(
    "value",
    [
        ": x-deltasync-token-versions " + "3:0," * 2_600_000 + "3:0",  # the 10 MB SSE comment (2.6M choices' worth)
        ";".join(["3:0"] * 2_600_000),
        "9" * 10_000_000,
        "٣:٠," * 2_000_000,
        ",".join(["3:0"] * MAX_ENTRIES),  # the largest accepted
        ",".join([f"{2**50}:{2**50}"] * MAX_ENTRIES),
        ";".join(["3:0,4:9,5:3"] * (MAX_CHOICES - 1)),  # reversed boundaries in every choice
    ],
    ids=["10MB-comment", "2.6M-choices", "10M-digits", "arabic-digits", "largest", "widest", "reversed"],
)
def test_huge_values_cost_under_64_mib_and_no_superlinear_work(value):
    # The memory bound is exact (tracemalloc). The time is taken without tracemalloc, which
    # slows allocation several times over, and its bound is a guard against quadratic work on
    # a hostile header (that would take minutes), not a speed figure: a loaded 2-core machine
    # takes 0.1-2.4 s here.
    _, peak = _cost(lambda: parse_token_versions(value))
    seconds = _seconds(lambda: parse_token_versions(value))
    assert seconds < 20.0 and peak < 64 << 20, (seconds, peak)
