"""Where new weights began in a response, found independently of the server.

The truth is a replay. After the requests, the server under test is given the first version's
weights again, and each choice is generated once more from the same prompt ids with the same
sampling (greedy, or ``n2``'s seed): a decode of the same weights at the same positions, so
every token the first version sampled comes back with the same id and the same logprob, bit for
bit, and the first token that does not is the first one the new weights sampled. A choice made
by one version alone comes back whole, which checks the replay itself on every run.

(Teacher-forced logprobs, ``prompt_logprobs`` over the prompt and the generated tokens, are not
an exact truth: a prefill and a decode of the same weights differ at a few positions of a long
answer, by about 0.008 on the tiny model's newline token, and a token sampled just after an
in-flight write, on keys and values of the old weights, lies between the two versions'
teacher-forced logprobs.) :func:`ask` makes the requests (streamed or not, ``n > 1``, chat)
and reads the server's ``x-deltasync-token-versions``; :func:`check_boundaries` finds the truth.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests

from deltasync import parse_token_versions

#: The requests of :func:`ask`, by kind: a streamed completion, a completion with two choices,
#: a chat answer and a streamed chat answer.
KINDS = ("stream", "n2", "chat", "chat-stream")


@dataclass
class Answer:
    kind: str
    prompt_ids: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    """Per choice: the generated token ids."""
    logprobs: list[list[float]] = field(default_factory=list)
    starts: list[list[tuple[int | None, int | None]]] = field(default_factory=list)
    """Per choice: ``[(version, first_token), ...]`` as the server reported it."""


def ask(url: str, kind: str, prompt: list[int], max_tokens: int, progress: dict[str, int] | None = None) -> Answer:
    """One request of ``kind`` (see :data:`KINDS`), greedy (``n2``: sampled), with token ids and
    logprobs; a streamed one sets ``progress[kind]`` to its token count so far as chunks arrive."""
    answer = Answer(kind)
    chat = kind.startswith("chat")
    stream = kind.endswith("stream")
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                            "stream": stream}  # fmt: skip
    if chat:
        # The prompt's ids are the chat template's; the server reports them.
        body |= {"messages": [{"role": "user", "content": " ".join(map(str, prompt))}], "logprobs": True}
    else:
        body |= {"prompt": prompt, "logprobs": 1}
        if kind == "n2":  # two choices need sampling; the logprobs reported are the model's own (raw)
            body |= {"n": 2, "temperature": 1.0, "seed": 7}
        answer.prompt_ids = list(prompt)
    route = "/v1/chat/completions" if chat else "/v1/completions"
    response = requests.post(url + route, json=body, timeout=600, stream=stream)
    assert response.status_code == 200, response.text
    if not stream:
        data = response.json()
        answer.starts = parse_token_versions(response.headers["x-deltasync-token-versions"])
        if chat:
            answer.prompt_ids = data["prompt_token_ids"]
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            answer.tokens.append(choice["token_ids"])
            answer.logprobs.append(_logprobs(choice, chat))
        return answer
    answer.tokens, answer.logprobs = [[]], [[]]
    comment = None
    # SSE lines end at "\n" only (a generated U+2028 must not cut a data line).
    for raw in response.iter_lines(delimiter=b"\n"):
        line = raw.decode()
        if line.startswith(": x-deltasync-token-versions "):
            comment = line
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[len("data: ") :])
        if chat and chunk.get("prompt_token_ids"):
            answer.prompt_ids = chunk["prompt_token_ids"]
        for choice in chunk["choices"]:
            answer.tokens[0] += choice.get("token_ids") or []
            answer.logprobs[0] += _logprobs(choice, chat)
        if progress is not None:
            progress[kind] = len(answer.tokens[0])
    assert comment is not None, answer.kind
    answer.starts = parse_token_versions(comment)
    return answer


def _logprobs(choice: dict[str, Any], chat: bool) -> list[float]:
    logprobs = choice.get("logprobs") or {}
    if chat:
        return [item["logprob"] for item in logprobs.get("content") or []]
    return list(logprobs.get("token_logprobs") or [])


def replay(url: str, answer: Answer) -> list[tuple[list[int], list[float]]]:
    """Each of ``answer``'s choices generated again on ``url`` from its prompt ids, with its
    sampling: per choice, the token ids and their logprobs."""
    length = max(len(tokens) for tokens in answer.tokens)
    body: dict[str, Any] = {"prompt": answer.prompt_ids, "max_tokens": length, "temperature": 0, "ignore_eos": True,
                            "return_token_ids": True, "logprobs": 1}  # fmt: skip
    if answer.kind == "n2":
        body |= {"n": 2, "temperature": 1.0, "seed": 7}
    response = requests.post(url + "/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    return [(choice["token_ids"], _logprobs(choice, chat=False)) for choice in choices]


def first_departure(tokens: list[int], logprobs: list[float], again: tuple[list[int], list[float]]) -> int | None:
    """The first token whose id or logprob differs from the replay ``again`` (None: none does)."""
    for index, pair in enumerate(zip(tokens, logprobs, strict=True)):
        if pair != (again[0][index], again[1][index]):
            return index
    return None


class Requests:
    """Requests of every kind in :data:`KINDS` at once, each in its own thread; ``answers`` and
    ``errors`` once :meth:`join` returns."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int, kinds: tuple[str, ...] = KINDS) -> None:
        self.answers: list[Answer] = []
        self.errors: list[str] = []
        self.streamed = [kind for kind in kinds if kind.endswith("stream")]
        self.progress: dict[str, int] = {}
        """Token counts of the streamed requests so far, by kind."""
        self.threads = [threading.Thread(target=self._run, args=(url, kind, prompt, max_tokens), daemon=True) for kind in kinds]
        for thread in self.threads:
            thread.start()

    def _run(self, url: str, kind: str, prompt: list[int], max_tokens: int) -> None:
        try:
            self.answers.append(ask(url, kind, prompt, max_tokens, self.progress))
        except Exception as exc:  # noqa: BLE001  (recorded: the test asserts there are none)
            self.errors.append(f"{kind}: {type(exc).__name__}: {exc}")

    def wait_tokens(self, count: int, timeout: float = 300.0) -> None:
        """Wait until every streamed request has ``count`` tokens."""
        deadline = time.monotonic() + timeout
        while min((self.progress.get(kind, 0) for kind in self.streamed), default=count) < count:
            assert time.monotonic() < deadline and not self.errors, (self.progress, self.errors)
            time.sleep(0.01)

    def wait_running(self, url: str, count: int, timeout: float = 60.0) -> bool:
        """Wait until the server at ``url`` runs ``count`` requests (a choice of ``n`` counts once
        each), so the ones not streamed are generating too; False if that did not happen within
        ``timeout`` (a machine short of CPU may admit a request late: the caller checks what
        the server says of each answer)."""
        deadline = time.monotonic() + timeout
        while running(url) < count:
            assert not self.errors, (self.progress, self.errors)
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def most(self) -> int:
        """The most tokens a streamed request has so far."""
        return max(self.progress.values(), default=0)

    def join(self) -> list[Answer]:
        for thread in self.threads:
            thread.join(600)
        assert self.errors == [], self.errors
        return sorted(self.answers, key=lambda a: a.kind)


def running(url: str) -> float:
    """How many requests the server at ``url`` runs now (vLLM's ``num_requests_running`` gauge)."""
    name = "vllm:num_requests_running"
    text = requests.get(url + "/metrics", timeout=60).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def straddling(answers: list[Answer]) -> int:
    """How many choices the server says changed version strictly inside the answer (after the
    first token, before the end)."""
    return sum(
        1
        for answer in answers
        for tokens, starts in zip(answer.tokens, answer.starts, strict=True)
        if len(starts) > 1 and 0 < (starts[1][1] or 0) < len(tokens)
    )


def check_boundaries(
    reference_url: str, answers: list[Answer], first: int, second: int, hold_first: Callable[[], None]
) -> int:
    """Each choice that reports ``first`` then ``second`` starts ``second`` where the truth says
    (:func:`first_departure` from its :func:`replay` on ``first``'s weights: ``hold_first()``
    puts them on ``reference_url`` again); the number of choices whose boundary fell inside the
    answer. Choices of one version come back whole."""
    hold_first()
    with ThreadPoolExecutor(len(answers) or 1) as pool:  # at once: a decode is the same in any batch
        replays = list(pool.map(lambda answer: replay(reference_url, answer), answers))
    inside = 0
    for answer, again in zip(answers, replays, strict=True):
        for tokens, logprobs, starts, replayed in zip(answer.tokens, answer.logprobs, answer.starts, again, strict=True):
            assert len(tokens) == len(logprobs) == len(replayed[0]) > 0, answer.kind
            assert starts[0] == (first, 0), (answer.kind, starts)
            truth = first_departure(tokens, logprobs, replayed)
            if len(starts) == 1:
                assert truth is None, (answer.kind, starts, truth)  # one version made every token
                continue
            assert [v for v, _ in starts] == [first, second], (answer.kind, starts)
            reported = starts[1][1]
            if reported == len(tokens):
                assert truth is None, (answer.kind, starts, truth)  # the update came after the last token
            else:
                assert reported == truth, (answer.kind, starts, truth)
                inside += reported > 0
    return inside
