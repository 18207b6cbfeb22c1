"""Per-token versions in TRL samples: aligning them to a training row, and the trainer-side
queue that logs lags and masks old tokens (the real trainer: integration/trl/test_trainer.py)."""

from __future__ import annotations

from collections import defaultdict
from queue import Queue

import numpy as np
import pytest

pytest.importorskip("trl")

from deltasync.trl._token_lag import (
    TokenLagQueue,
    VersionedRolloutSample,
    align_versions,
    stamps_of,
)


def test_each_run_of_trained_tokens_takes_its_turns_versions():
    # prompt, turn 1 (versions 3,3,4), a tool result, turn 2 (4,5)
    ids = [1, 2, 10, 11, 12, 7, 7, 20, 21]
    mask = [0, 0, 1, 1, 1, 0, 0, 1, 1]
    turns = [([10, 11, 12], [3, 3, 4]), ([20, 21], [4, 5])]
    assert align_versions(ids, mask, turns) == [-1, -1, 3, 3, 4, -1, -1, 4, 5]
    # A forked row holds only the second turn; a row whose tokens no turn made stays unknown.
    assert align_versions([1, 20, 21], [0, 1, 1], turns) == [-1, 4, 5]
    assert align_versions([1, 30], [0, 1], turns) == [-1, -1]


def test_a_turns_tokens_take_the_versions_its_header_names_and_a_bad_header_leaves_them_unknown():
    assert stamps_of("3:0,4:2", 4) == [3, 3, 4, 4]
    assert stamps_of("none:0,4:1", 2) == [-1, 4]  # the start checkpoint is no version
    assert stamps_of("3:0,4:?", 2) == [3, 3]  # an unknown start: the version before it
    assert stamps_of(None, 2) == stamps_of("3:x", 2) == stamps_of("4:1", 2) == [-1, -1]


def _sample(stamps, mask, model_version):
    return VersionedRolloutSample(
        prompt=[], completion=[], input_ids=np.arange(len(mask)), completion_mask=np.array(mask),
        old_log_probs=np.zeros(len(mask), dtype=np.float32), advantage=0.0, model_version=model_version, group_id=0,
        metrics={}, token_versions=np.array(stamps),
    )  # fmt: skip


def test_the_queue_logs_lags_and_masks_tokens_older_than_the_limit():
    queue, metrics = Queue(), defaultdict(list)
    queue.put(_sample([-1, 5, 5, 6, 7], [0, 1, 1, 1, 1], 5))
    queue.put(_sample([-1, 2, 2], [0, 1, 1], 2))  # stale for max_staleness=2: TRL drops it, untouched
    lag = TokenLagQueue(queue, lambda: 7, metrics, max_staleness=2, max_token_lag=1)
    first = lag.get()
    assert first.completion_mask.tolist() == [0, 0, 0, 1, 1]  # lags 2, 2, 1, 0
    assert metrics["tokens/lag_0_share"] == [0.25] and metrics["tokens/lag_1_share"] == [0.25]
    assert metrics["tokens/lag_2_share"] == [0.5] and metrics["tokens/lag_3plus_share"] == [0.0]
    assert metrics["sample/straddles_update"] == [1.0] and metrics["tokens/masked_share"] == [0.5]
    second = lag.get()
    assert second.completion_mask.tolist() == [0, 1, 1] and len(metrics["tokens/lag_0_share"]) == 1
    assert lag.qsize() == 0 and lag.version == 7


def test_a_sample_with_every_token_too_old_is_skipped_not_trained_on_empty():
    """Masking every token would leave the sample nothing to add to the loss (and a batch of
    such samples no token at all, which TRL's loss cannot take): the queue takes the next."""
    queue, metrics = Queue(), defaultdict(list)
    queue.put(_sample([-1, 4, 4], [0, 1, 1], 4))  # lag 2 everywhere, within max_staleness=2
    queue.put(_sample([-1, 5, 6], [0, 1, 1], 5))
    lag = TokenLagQueue(queue, lambda: 6, metrics, max_staleness=2, max_token_lag=1)
    taken = lag.get()
    assert taken.token_versions.tolist() == [-1, 5, 6] and taken.completion_mask.tolist() == [0, 1, 1]
    assert metrics["sample/dropped_all_masked"] == [1.0] and metrics["tokens/masked_share"] == [1.0, 0.0]
    assert lag.qsize() == 0


def test_the_config_checks_update_mode_and_max_token_lag():
    from deltasync import ConfigError
    from deltasync.trl import DeltaSyncConfig

    config = DeltaSyncConfig()
    assert (config.update_mode, config.max_token_lag) == ("inflight", None)
    assert DeltaSyncConfig(update_mode=None, max_token_lag=0).max_token_lag == 0
    for kwargs, why in (({"update_mode": "later"}, "update_mode must be one of pause, inflight or None, got 'later'"),
                        ({"max_token_lag": -1}, "max_token_lag must be a whole number of versions >= 0 or None, got -1"),
                        ({"max_token_lag": 1.5}, "got 1.5"), ({"max_token_lag": True}, "got True")):  # fmt: skip
        with pytest.raises(ConfigError) as error:
            DeltaSyncConfig(**kwargs)
        assert why in str(error.value)
