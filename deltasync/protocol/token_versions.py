"""Which weights sampled each token: the ``x-deltasync-token-versions`` list and its parser.

A server with ``vllm_ext.UpdateMiddleware`` reports, for every completion and chat completion,
where each version began in each choice's output::

    x-deltasync-token-versions: 3:0,4:17,5:90          (a header of a non-streamed answer)
    : x-deltasync-token-versions 3:0,4:17,5:90         (an SSE comment just before data: [DONE])

``V:B`` says that output token ``B`` and those after it (up to the next entry) were sampled with
version ``V``'s weights; the first entry is the version at admission (``x-deltasync-version``),
at 0. With ``n > 1`` (or a list of prompts) there is one list per choice, ``;``-separated, in
choice order. ``none`` is the checkpoint the server started with. A later entry may start at
the same token as an earlier one: the earlier version sampled no token (it may have computed
part of the prompt's KV). ``?`` marks a start the server could not take exactly (an update
applied behind its flow, through vLLM's own weight-update routes).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from ..format.limited_json import MAX_COUNT
from .routes import TOKEN_VERSIONS_HEADER, VERSION_HEADER

__all__ = [
    "MAX_CHOICES",
    "MAX_ENTRIES",
    "MAX_NUMBER",
    "TOKEN_VERSIONS_HEADER",
    "TokenVersions",
    "VersionedCompletion",
    "fits_bounds",
    "format_token_versions",
    "parse_token_versions",
    "version_of_token",
    "versioned_completion",
]


#: One choice's list: ``[(version, first_token), ...]``; ``version`` None is the checkpoint the
#: server started with, ``first_token`` None a start the server could not take exactly.
TokenVersions = list[tuple[int | None, int | None]]

MAX_CHOICES = 16384
"""The most choices a list holds: vLLM's largest ``n`` (``VLLM_MAX_N_SEQUENCES``, 16384 unless
its environment raises it). A server never sends more; a parser refuses more."""
MAX_ENTRIES = 4 * MAX_CHOICES
"""The most ``VERSION:FIRST_TOKEN`` entries over all choices (4 per choice at the largest ``n``;
one choice of a small ``n`` may hold them all). A server never sends more; a parser refuses more."""
MAX_NUMBER = MAX_COUNT
"""The largest version or token index (2**50, the pointer's cap on versions)."""
_NUMBER_RE = re.compile(r"(?:0|[1-9][0-9]{0,15})\Z", re.ASCII)
_ENTRY_CHARS = 2 * 16 + 3
"""The longest entry with its separator and a space: two 16-digit numbers, ':' and ','."""
MAX_CHARS = MAX_ENTRIES * _ENTRY_CHARS + len(f": {TOKEN_VERSIONS_HEADER}") + 64
"""The longest value a parser reads (checked before anything is split)."""


def parse_token_versions(value: str) -> list[TokenVersions]:
    """The per-choice lists of an ``x-deltasync-token-versions`` header, or of the SSE comment
    (``: x-deltasync-token-versions ...``, with or without its prefix): one
    ``[(version, first_token), ...]`` per choice, in choice order.

    Raises :class:`~deltasync.FormatError` for anything else, naming the part that is not
    ``VERSION:TOKEN`` (ASCII decimal numbers up to :data:`MAX_NUMBER`, ``none``, ``?``), or the
    bound a value goes past (:data:`MAX_CHARS`, :data:`MAX_CHOICES`, :data:`MAX_ENTRIES`), which
    is checked before the value is split: refusing a huge value costs no more than reading it.
    """
    if not isinstance(value, str):
        raise FormatError(f"{TOKEN_VERSIONS_HEADER} is {type(value).__name__}, not text")
    if len(value) > MAX_CHARS:
        raise FormatError(
            f"{TOKEN_VERSIONS_HEADER} has {len(value)} characters, more than the {MAX_CHARS} of {MAX_ENTRIES} "
            f"entries over at most {MAX_CHOICES} choices (vLLM's largest n): not a server's list"
        )
    text = value.strip()
    prefix = f": {TOKEN_VERSIONS_HEADER}"
    if text.startswith(prefix):
        text = text[len(prefix) :].strip()
    if not text:
        raise FormatError(f"{TOKEN_VERSIONS_HEADER} is empty: expected 'VERSION:FIRST_TOKEN,...' per choice")
    choices = text.count(";") + 1
    if choices > MAX_CHOICES:
        raise FormatError(
            f"{TOKEN_VERSIONS_HEADER} lists {choices} choices, more than {MAX_CHOICES} (vLLM's largest n)"
        )
    entries = choices + text.count(",")
    if entries > MAX_ENTRIES:
        raise FormatError(
            f"{TOKEN_VERSIONS_HEADER} lists {entries} entries, more than {MAX_ENTRIES} "
            f"({MAX_ENTRIES // MAX_CHOICES} per choice at vLLM's largest n)"
        )
    return [_parse_choice(part, value) for part in text.split(";")]


def _parse_choice(part: str, whole: str) -> TokenVersions:
    entries: TokenVersions = []
    for item in part.split(","):
        version, sep, start = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            parsed = (None if version == "none" else _number(version), None if start == "?" else _number(start))
        except ValueError:
            raise FormatError(
                f"{TOKEN_VERSIONS_HEADER} {whole[:200]!r}: {item.strip()[:80]!r} is not VERSION:FIRST_TOKEN "
                f"(a version number or 'none', and a token index or '?'; ASCII decimals up to {MAX_NUMBER})"
            ) from None
        entries.append(parsed)
    known = [s for _, s in entries if s is not None]
    if entries[0][1] != 0 or known != sorted(known):
        raise FormatError(f"{TOKEN_VERSIONS_HEADER} {whole[:200]!r}: a choice's list must start at token 0 and never go back")
    return entries


def _number(text: str) -> int:
    """A canonical ASCII decimal up to :data:`MAX_NUMBER` (``ValueError`` otherwise)."""
    if not _NUMBER_RE.match(text):
        raise ValueError(text[:80])
    number = int(text)
    if number > MAX_NUMBER:
        raise ValueError(text)
    return number


def fits_bounds(choices: Sequence[TokenVersions]) -> bool:
    """Whether a parser takes ``choices`` (:data:`MAX_CHOICES`, :data:`MAX_ENTRIES`,
    :data:`MAX_NUMBER`): a server sends no list that does not."""
    if len(choices) > MAX_CHOICES or sum(len(entries) for entries in choices) > MAX_ENTRIES:
        return False
    return all(
        all(n is None or 0 <= n <= MAX_NUMBER for n in entry) for entries in choices for entry in entries
    )


def format_token_versions(choices: Sequence[TokenVersions]) -> str:
    """The header value of ``choices`` (the inverse of :func:`parse_token_versions`)."""
    return ";".join(
        ",".join(f"{'none' if v is None else v}:{'?' if s is None else s}" for v, s in entries) for entries in choices
    )


def version_of_token(entries: TokenVersions, index: int) -> int | None:
    """The version that sampled output token ``index`` of one choice (the last entry starting at
    or before it; an entry with an unknown start counts from the one before it)."""
    found = entries[0][0]
    for version, start in entries:
        if start is not None and start > index:
            break
        if start is not None:
            found = version
    return found


@dataclass(frozen=True, kw_only=True)
class VersionedCompletion:
    """A completion or chat answer with the versions that made it (``RolloutClient.complete``)."""

    body: dict[str, Any]
    """The answer's JSON, as the server sent it."""
    version: int | None
    """The version at admission (``x-deltasync-version``; None: the server's start checkpoint)."""
    token_versions: list[TokenVersions]
    """Per choice, in choice order: ``[(version, first_token), ...]``."""

    def versions_of(self, choice: int = 0) -> list[int | None]:
        """The version that sampled each output token of ``choice`` (its ``token_ids`` or
        ``logprobs`` give the token count)."""
        data = self.body["choices"][choice]
        count = len(data.get("token_ids") or (data.get("logprobs") or {}).get("token_logprobs") or [])
        entries = self.token_versions[choice]
        return [version_of_token(entries, i) for i in range(count)]


def versioned_completion(body: dict[str, Any], headers: Mapping[str, str]) -> VersionedCompletion:
    """A :class:`VersionedCompletion` from a non-streamed answer's JSON and headers.

    Raises :class:`~deltasync.FormatError` when the headers lack the versions (a server without
    ``vllm_ext.UpdateMiddleware``), naming the header."""
    value = headers.get(TOKEN_VERSIONS_HEADER)
    admitted = headers.get(VERSION_HEADER)
    if value is None or admitted is None:
        raise FormatError(
            f"the answer has no {TOKEN_VERSIONS_HEADER} header: the server needs vllm_ext.UpdateMiddleware "
            "(deltasync serve adds it)"
        )
    try:
        version = None if admitted == "none" else _number(admitted)
    except ValueError:
        raise FormatError(
            f"{VERSION_HEADER} {admitted[:80]!r} is not a version (an ASCII decimal up to {MAX_NUMBER}, or 'none')"
        ) from None
    return VersionedCompletion(body=body, version=version, token_versions=parse_token_versions(value))
