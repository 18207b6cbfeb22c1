"""Which version sampled each token of a TRL sample, and what the trainer does with it.

The rollout loop (:class:`VersionedRolloutLoop`, TRL's ``_AsyncRolloutLoop`` in its child
process) reads each completion's ``x-deltasync-token-versions`` and hands the trainer
:class:`VersionedRolloutSample`\\ s: TRL's sample plus ``token_versions``, the version that
sampled each token of ``input_ids`` (-1 for tokens nobody sampled: prompts, tool results), and
``model_version`` set to the oldest of them, so TRL's ``max_staleness`` check sees the oldest
weights in the sample, not the version at request time.

On the trainer side, :class:`TokenLagQueue` sits between the rollout queue and TRL's dataset:
for every sample TRL keeps it logs the share of sampled tokens by their lag behind the trained
version (``tokens/lag_0_share`` ... ``tokens/lag_3plus_share``) and whether the sample straddles
an update (``sample/straddles_update``, averaged per step: the share), and with
``max_token_lag=N`` it masks from the loss the tokens sampled more than N versions behind.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from trl.experimental.async_grpo.async_rollout_worker import (
    RolloutSample,
    _AsyncRolloutLoop,
)

from ..errors import FormatError
from ..protocol.token_versions import (
    TOKEN_VERSIONS_HEADER,
    parse_token_versions,
    version_of_token,
)

__all__ = ["TokenLagQueue", "VersionedRolloutLoop", "VersionedRolloutSample", "align_versions", "stamps_of"]

#: Lags logged one by one; larger ones are pooled in ``tokens/lag_{LAG_BUCKETS}plus_share``.
LAG_BUCKETS = 3

_HEADERS: contextvars.ContextVar[list[str | None] | None] = contextvars.ContextVar("deltasync_headers", default=None)
_TURNS: contextvars.ContextVar[list[tuple[list[int], list[int]]] | None] = contextvars.ContextVar(
    "deltasync_turns", default=None
)


@dataclasses.dataclass(slots=True)
class VersionedRolloutSample(RolloutSample):
    """TRL's ``RolloutSample`` with the version that sampled each token."""

    token_versions: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Per token of ``input_ids``: the version whose weights sampled it; -1 where no model sampled
    it (the prompt, tool results) or the server did not say."""


def align_versions(input_ids: list[int], mask: list[int], turns: list[tuple[list[int], list[int]]]) -> list[int]:
    """Per token of a training row, the version that sampled it (-1 elsewhere): each run of
    trained tokens is the output of the next turn whose tokens it repeats."""
    versions = [-1] * len(input_ids)
    position, turn = 0, 0
    while position < len(input_ids):
        if not mask[position]:
            position += 1
            continue
        end = position
        while end < len(input_ids) and mask[end]:
            end += 1
        run = input_ids[position:end]
        for index in range(turn, len(turns)):
            ids, stamps = turns[index]
            if ids[: len(run)] == run:
                versions[position:end] = stamps[: len(run)]
                turn = index + 1
                break
        position = end
    return versions


class VersionedRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop, reading which version sampled each token from the server's answers."""

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        import aiohttp

        headers = _HEADERS.get()
        client_timeout = aiohttp.ClientTimeout(total=timeout)

        async def do_post() -> dict:
            assert self.session is not None
            async with self.session.post(f"{self.vllm_server_url}{path}", json=payload, timeout=client_timeout) as response:
                response.raise_for_status()
                content = await response.json()
                if headers is not None:
                    headers.append(response.headers.get(TOKEN_VERSIONS_HEADER))
                return content if content else {}

        return await self._retry(do_post, label=f"POST {path}", max_attempts=max_retries)

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        headers: list[str | None] = []
        reset = _HEADERS.set(headers)
        try:
            ids, logprobs = await super()._generate_one_turn(prompt_ids)
        finally:
            _HEADERS.reset(reset)
        turns = _TURNS.get()
        if turns is not None:
            turns.append((list(ids), stamps_of(headers[-1] if headers else None, len(ids))))
        return ids, logprobs

    async def _generate_one(self, *args: Any, **kwargs: Any) -> Any:
        turns: list[tuple[list[int], list[int]]] = []
        reset = _TURNS.set(turns)
        try:
            result = await super()._generate_one(*args, **kwargs)
        finally:
            _TURNS.reset(reset)
        for sequence in result[2]:  # TRL's TrainingSequence: a plain dataclass
            sequence.deltasync_versions = align_versions(sequence.input_ids, sequence.completion_mask, turns)
        return result

    async def _score_group(self, group: Any) -> list[RolloutSample]:
        samples = await super()._score_group(group)
        sequences = [s for conversation in group.completions_sequences for s in conversation]
        if len(sequences) != len(samples):  # not TRL 1.16's one sample per row: leave them as they are
            return samples
        versioned = []
        for sample, sequence in zip(samples, sequences, strict=True):
            stamps = np.asarray(getattr(sequence, "deltasync_versions", [-1] * len(sample.input_ids)), dtype=np.int64)
            sampled = stamps[(sample.completion_mask > 0) & (stamps >= 0)]
            oldest = int(sampled.min()) if sampled.size else sample.model_version
            fields = {f.name: getattr(sample, f.name) for f in dataclasses.fields(RolloutSample)}
            fields["model_version"] = oldest  # the truth where the server said it, else TRL's bound
            versioned.append(VersionedRolloutSample(**fields, token_versions=stamps))
        return versioned


def stamps_of(value: str | None, count: int) -> list[int]:
    """The version that sampled each of a turn's ``count`` tokens, from its first choice's
    ``x-deltasync-token-versions`` (-1 for each where the server said nothing, or nothing sound:
    a header it cannot read leaves the tokens unknown instead of failing the rollout)."""
    try:
        entries = parse_token_versions(value)[0] if value else None
    except FormatError:
        entries = None
    if entries is None:
        return [-1] * count
    return [_known(version_of_token(entries, i)) for i in range(count)]


def _known(version: int | None) -> int:
    return -1 if version is None else version


class TokenLagQueue:
    """The rollout queue as TRL's dataset reads it: each sample's tokens logged by lag, and
    masked beyond ``max_token_lag`` (see the module)."""

    def __init__(self, queue: Any, model_version: Callable[[], int], metrics: Any, *, max_staleness: int,
                 max_token_lag: int | None) -> None:  # fmt: skip
        self.queue = queue
        self.model_version = model_version
        self.metrics = metrics
        self.max_staleness = max_staleness
        self.max_token_lag = max_token_lag
        self.version: int | None = None
        """The trained version the last sample was judged against."""

    def qsize(self) -> int:
        return int(self.queue.qsize())

    def get(self, *args: Any, **kwargs: Any) -> Any:
        while True:
            sample = self._judge(self.queue.get(*args, **kwargs))
            if sample is not None:
                return sample
            # Every token it would train on is too old: it would add nothing to the loss, and a
            # batch of such samples leaves TRL's loss with no token at all. Take the next one.
            self.metrics["sample/dropped_all_masked"].append(1.0)

    def _judge(self, sample: Any) -> Any:
        """The sample, logged and masked; None when masking leaves it no token to train on."""
        stamps = getattr(sample, "token_versions", None)
        version = self.version = self.model_version()
        if stamps is None or version - sample.model_version > self.max_staleness:
            return sample  # TRL drops it (stale) or it carries no versions
        sampled = (sample.completion_mask > 0) & (stamps >= 0)
        lags = version - stamps[sampled]
        if lags.size:
            for lag in range(LAG_BUCKETS):
                self.metrics[f"tokens/lag_{lag}_share"].append(float(np.mean(lags == lag)))
            self.metrics[f"tokens/lag_{LAG_BUCKETS}plus_share"].append(float(np.mean(lags >= LAG_BUCKETS)))
            self.metrics["sample/straddles_update"].append(float(np.unique(stamps[sampled]).size > 1))
        if self.max_token_lag is not None:
            too_old = sampled & (version - stamps > self.max_token_lag)
            if too_old.any():
                self.metrics["tokens/masked_share"].append(float(too_old.sum() / max(1, int(sampled.sum()))))
                masked = np.where(too_old, 0, sample.completion_mask)
                if not (masked > 0).any():
                    return None
                sample.completion_mask = masked
            else:
                self.metrics["tokens/masked_share"].append(0.0)
        return sample
