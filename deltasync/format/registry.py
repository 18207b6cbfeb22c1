"""The names in a registry (the codecs', the view schemes'), as a live, read-only sequence."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

__all__ = ["Names"]


class Names(Sequence[str]):
    """The keys of ``registry`` in registration order: a view, so a name registered later is
    in it too, and it cannot be changed through it."""

    def __init__(self, registry: Mapping[str, Any]) -> None:
        self._registry = registry

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return tuple(self._registry)[index]

    def __len__(self) -> int:
        return len(self._registry)

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._registry))

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __repr__(self) -> str:
        return repr(tuple(self._registry))
