"""``Names``: the read-only, live sequence of a registry's names (``CODECS``, ``SCHEMES``)."""

from __future__ import annotations

import pytest

from deltasync.format.codecs import CODECS
from deltasync.format.registry import Names
from deltasync.views.schemes import SCHEMES


def test_names_follow_the_registry_in_order_and_cannot_change_it() -> None:
    registry = {"a": 1, "b": 2}
    names = Names(registry)
    assert list(names) == ["a", "b"] and names[1] == "b" and names[-1] == "b" and names[:1] == ("a",)
    assert len(names) == 2 and "a" in names and "c" not in names and 1 not in names
    assert repr(names) == "('a', 'b')" and names.index("b") == 1 and names.count("a") == 1
    registry["c"] = 3  # a name registered later is in it
    assert list(names) == ["a", "b", "c"] and names[2] == "c"
    with pytest.raises(TypeError):
        names[0] = "z"  # type: ignore[index]
    with pytest.raises(IndexError):
        names[3]
    assert not hasattr(names, "append")


def test_the_codecs_and_the_schemes_are_such_names() -> None:
    assert isinstance(CODECS, Names) and isinstance(SCHEMES, Names)
    assert list(CODECS)[:2] == ["raw", "zstd"] and list(SCHEMES)[:3] == ["FP8_DYNAMIC", "FP8_BLOCK", "W8A8"]
