"""The per-token version lists: parser, format, the version of a token, and RolloutClient.complete
against a fake server (the real server: integration/vllm_ext/test_inflight_server.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from deltasync import FormatError, RolloutClient, parse_token_versions, version_of_token
from deltasync.protocol.token_versions import format_token_versions


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
