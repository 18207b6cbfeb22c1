"""What identifies a view's chain, and the checks that keep a reader on the chain it asked for.

A chain is what its name says. The bucket's root holds the bf16 chain; ``views/<SCHEME>/`` holds
the view ``SCHEME``, and nothing else: its codes of the scheme's dtype, its scales in bf16 and of
the scheme's layout. A :class:`ViewIdentity` spells that out (scheme, code dtype, scale dtype,
scale layout). A writer commits it in the view's pointer (key ``view``) and in every file's
metadata (``x-view``, ``x-view-codes``, ``x-view-scales``, ``x-view-scale-layout``); a reader
that knows which chain it asked for checks the pointer, every file's metadata and every tensor
of every anchor against it before it applies anything (docs/protocol.md, section 20).

A bucket written before views named themselves in the pointer still reads: its view anchors
carry ``x-view`` (the scheme's name), and every tensor is checked against the scheme.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import FormatError
from ..format.dtypes import ELEMENT_DTYPES, dtype_code
from .schemes import get_scheme, scale_name

__all__ = [
    "METADATA_KEYS",
    "ViewIdentity",
    "check_file_view",
    "check_pointer_view",
    "check_view_tensors",
    "describe_view",
]

METADATA_KEYS: dict[str, str] = {
    "scheme": "x-view",
    "codes": "x-view-codes",
    "scales": "x-view-scales",
    "scale_layout": "x-view-scale-layout",
}
"""Field of the identity -> the file metadata key that carries it."""

_SCALE_DTYPE = torch.bfloat16
"""Scales are bf16: views are of bf16 weights (docs/views.md)."""


@dataclass(frozen=True)
class ViewIdentity:
    """What a view's chain holds, as its scheme implies it."""

    scheme: str
    """The scheme's registered name (``"FP8_DYNAMIC"``): the folder's name."""
    codes: str
    """The safetensors code of the quantized weights' elements (``"F8_E4M3"``, ``"I8"``)."""
    scales: str
    """The safetensors code of the scales' elements (``"BF16"``)."""
    scale_layout: str
    """``"channel"`` (one scale per output row, ``[out, 1]``) or ``"block:RxC"`` (one per block of
    R rows and C columns, ``[ceil(out/R), ceil(in/C)]``)."""

    @classmethod
    def of(cls, name: str) -> ViewIdentity:
        """The identity of view ``name`` (a :class:`~deltasync.ConfigError` for an unknown scheme)."""
        scheme = get_scheme(name)
        layout = "channel" if scheme.block is None else f"block:{scheme.block[0]}x{scheme.block[1]}"
        return cls(scheme=scheme.name, codes=dtype_code(scheme.code_dtype), scales=dtype_code(_SCALE_DTYPE),
                   scale_layout=layout)  # fmt: skip

    def to_json(self) -> dict[str, str]:
        """The pointer's ``view`` object."""
        return {"scheme": self.scheme, "codes": self.codes, "scales": self.scales, "scale_layout": self.scale_layout}

    def metadata(self) -> dict[str, str]:
        """The ``x-`` metadata keys every file of the view carries."""
        return {key: getattr(self, field) for field, key in METADATA_KEYS.items()}

    def __str__(self) -> str:
        return describe_view(self.to_json())


def describe_view(found: Mapping[str, str] | None) -> str:
    """How messages name a chain's identity (None or empty: the bf16 chain)."""
    if not found:
        return "the bf16 chain"
    scheme = found.get("scheme", "(unnamed)")
    details = [f"{found[k]} {w}" for k, w in (("codes", "codes"), ("scales", "scales")) if k in found]
    if "scale_layout" in found:
        details.append(f"{found['scale_layout']} scale layout")
    return f"view {scheme}" + (f" ({', '.join(details)})" if details else "")


def _asked(expected: ViewIdentity | None) -> str:
    return "the bf16 chain" if expected is None else f"view {expected}"


def check_pointer_view(expected: ViewIdentity | None, found: Mapping[str, str] | None, where: str) -> None:
    """Refuse a pointer that names another chain than the one asked for (``expected``; None: the
    bf16 chain). A view pointer that names none (written before views named themselves) passes:
    its files are checked instead."""
    if expected is None and found is not None:
        raise FormatError(
            f"{where}: the bf16 chain was asked for, the pointer names {describe_view(found)}; the bucket's "
            "root holds the bf16 chain only (a view's chain lives in views/<SCHEME>/)"
        )
    if expected is not None and found is not None and dict(found) != expected.to_json():
        raise FormatError(
            f"{where}: {_asked(expected)} was asked for, the pointer names {describe_view(found)} "
            "(another chain under this view's name); nothing was read or applied"
        )


def check_file_view(
    expected: ViewIdentity | None, metadata: Mapping[str, str], where: str, *, kind: str, named: bool
) -> None:
    """Refuse a file whose metadata says it belongs to another chain than the one asked for.

    ``named``: the pointer names the view's identity; every file must then carry all of it.
    Otherwise (a bucket written before that) an anchor of a view must carry ``x-view`` with the
    scheme's name, and whatever identity keys a file carries must be the view's."""
    found = {field: metadata[key] for field, key in METADATA_KEYS.items() if key in metadata}
    if expected is None:
        if found:
            raise FormatError(
                f"{where}: the bf16 chain was asked for, the file is of {describe_view(found)}; the bucket's root "
                "holds the bf16 chain only"
            )
        return
    want = expected.to_json()
    required = set(want) if named else ({"scheme"} if kind == "anchor" else set())
    if any(found.get(k) != want[k] for k in required) or any(want[k] != v for k, v in found.items()):
        what = describe_view(found) if found else "the bf16 chain's (it names no view)"
        raise FormatError(f"{where}: {_asked(expected)} was asked for, the file is {what}")


def check_view_tensors(expected: ViewIdentity | None, tensors: Mapping[str, torch.Tensor], where: str) -> None:
    """Refuse an anchor's tensors that do not fit the chain asked for.

    The bf16 chain holds bf16 only. A view holds, for each quantized weight ``M.weight`` (a 2-D
    ``[out, in]``), codes of the scheme's dtype and ``M.weight_scale`` in bf16 of the scheme's
    scale shape; every other tensor in bf16; and at least one quantized weight."""
    if expected is None:
        for name, t in tensors.items():
            if t.dtype != torch.bfloat16:
                raise FormatError(
                    f"{where}: the bf16 chain was asked for, parameter {name!r} holds {ELEMENT_DTYPES.get(t.dtype, t.dtype)} "
                    "elements (a quantized view's); the bucket's root holds the bf16 chain only"
                )
        return
    scheme = get_scheme(expected.scheme)
    asked = f"view {expected.scheme} was asked for"
    scales = sorted(n for n in tensors if n.endswith(".weight_scale"))
    if not scales:
        raise FormatError(
            f"{where}: {asked}, the anchor holds no quantized weight (no '<module>.weight_scale'): "
            "the bf16 chain's, or another model's"
        )
    codes = set()
    for scale in scales:
        weight = scale[: -len("_scale")]
        assert scale_name(weight) == scale
        w, s = tensors.get(weight), tensors[scale]
        if w is None:
            raise FormatError(f"{where}: {asked}, {scale!r} has no codes {weight!r} beside it")
        found = ELEMENT_DTYPES.get(w.dtype, str(w.dtype))
        if w.dtype != scheme.code_dtype:
            raise FormatError(
                f"{where}: {asked}, {weight!r} holds {found} codes; {expected.scheme}'s codes are {expected.codes}"
            )
        if w.dim() != 2:
            raise FormatError(f"{where}: {asked}, the codes {weight!r} have shape {list(w.shape)}, not [out, in]")
        if s.dtype != _SCALE_DTYPE:
            raise FormatError(
                f"{where}: {asked}, the scale {scale!r} holds {ELEMENT_DTYPES.get(s.dtype, s.dtype)} elements; "
                f"{expected.scheme}'s scales are {expected.scales}"
            )
        want = list(scheme.scale_shape(tuple(w.shape)))
        if list(s.shape) != want:
            raise FormatError(
                f"{where}: {asked}, the scale {scale!r} has shape {list(s.shape)}; a {expected.scale_layout} scale "
                f"of a weight {list(w.shape)} has shape {want}"
            )
        codes.add(weight)
    for name, t in tensors.items():
        if name not in codes and name not in scales and t.dtype != torch.bfloat16:
            raise FormatError(
                f"{where}: {asked}, {name!r} holds {ELEMENT_DTYPES.get(t.dtype, t.dtype)} elements with no scale "
                "beside it; a view's parameters other than quantized weights are BF16"
            )
