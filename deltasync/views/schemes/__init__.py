"""The view schemes, by the name a view's folder (``views/<NAME>/``) and its users give.

This registry is the one place schemes are known: the publisher (``PublishOptions(views=...)``),
a view's identity and its checks, the chain reader, ``deltasync export``, a server picking the
view its checkpoint is (:func:`from_quantization_config`) and the server's in-place writer (a
scheme's :class:`~.base.LiveLayout`) all look a scheme up here. A new scheme is one module (a
:class:`~.base.ViewScheme`, or a :class:`~.preset.PresetScheme` for a compressed-tensors
preset, with its live layout) and one :func:`register_scheme` line below; docs/views.md says
what else a scheme brings (its golden tests against llm-compressor, for a preset).

The schemes here are compressed-tensors' preset schemes (:mod:`.preset`): ``FP8_DYNAMIC``
(:mod:`.fp8_dynamic`), ``FP8_BLOCK`` (:mod:`.fp8_block`) and ``W8A8`` (:mod:`.w8a8`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...errors import ConfigError
from ...format.paths import VIEW_NAME_RE
from ...format.registry import Names
from .base import LiveLayout, ViewScheme, check_codes, check_scale, scale_name
from .fp8_block import FP8_BLOCK
from .fp8_dynamic import FP8_DYNAMIC
from .preset import PresetScheme, is_preset, refuse_config
from .w8a8 import W8A8

__all__ = [
    "SCHEMES",
    "LiveLayout",
    "PresetScheme",
    "ViewScheme",
    "check_codes",
    "check_scale",
    "from_quantization_config",
    "get_scheme",
    "register_scheme",
    "scale_name",
    "unregister_scheme",
]

_REGISTRY: dict[str, ViewScheme] = {}

SCHEMES: Sequence[str] = Names(_REGISTRY)
"""The names of the schemes deltasync publishes views of ("FP8_DYNAMIC", "FP8_BLOCK", "W8A8")."""


def register_scheme(scheme: ViewScheme) -> ViewScheme:
    """Make ``scheme`` known under ``scheme.name`` (a ``ValueError`` if that name is taken or is
    no view name: capitals, digits and ``_``, at most 64). Returns it."""
    if not VIEW_NAME_RE.match(scheme.name):
        raise ValueError(f"{scheme.name!r} is no view name (capitals, digits and '_', at most 64)")
    if scheme.name in _REGISTRY:
        raise ValueError(f"a view scheme named {scheme.name!r} is already registered")
    _REGISTRY[scheme.name] = scheme
    return scheme


def unregister_scheme(name: str) -> None:
    """Forget the scheme ``name`` (``KeyError`` if none is registered)."""
    del _REGISTRY[name]


def get_scheme(name: str) -> ViewScheme:
    """The view scheme named ``name`` (any case).

    Raises :class:`ConfigError` naming ``name`` and the supported schemes; a preset that
    compressed-tensors knows but deltasync does not publish (e.g. ``NVFP4``) is said to be one.
    """
    key = str(name).upper()
    found = _REGISTRY.get(key)
    if found is not None:
        return found
    supported = ", ".join(_REGISTRY)
    if is_preset(key):
        raise ConfigError(
            f"view {name!r} is a compressed-tensors preset that deltasync does not support; supported views: {supported}"
        )
    raise ConfigError(f"unknown view {name!r}; supported views (compressed-tensors preset names): {supported}")


def from_quantization_config(cfg: Mapping[str, Any]) -> ViewScheme:
    """The registered scheme a checkpoint's config.json ``quantization_config`` is (the first
    whose :meth:`~.base.ViewScheme.matches` says so). Raises :class:`ConfigError` naming what
    was found otherwise."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"quantization_config is {type(cfg).__name__}, expected a dict")
    for scheme in list(_REGISTRY.values()):
        if scheme.matches(cfg):
            return scheme
    raise refuse_config(cfg, ", ".join(_REGISTRY))


register_scheme(FP8_DYNAMIC)
register_scheme(FP8_BLOCK)
register_scheme(W8A8)
