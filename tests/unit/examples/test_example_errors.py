"""The examples' errors are deltasync errors, defined by the examples, not by the core."""

from __future__ import annotations

import deltasync
import deltasync.errors
import deltasync.examples


def test_the_examples_errors_are_deltasync_errors_and_not_the_cores() -> None:
    for name in deltasync.examples.__all__:
        error = getattr(deltasync.examples, name)
        assert issubclass(error, deltasync.DeltaSyncError), name
        assert not hasattr(deltasync.errors, name), name
    from deltasync.examples.launcher import ServerError, VLLMServerError
    from deltasync.examples.wordle import WordleRequestError, WordleServerError

    assert (ServerError, VLLMServerError, WordleRequestError, WordleServerError) == tuple(
        getattr(deltasync.examples, name) for name in deltasync.examples.__all__
    )
