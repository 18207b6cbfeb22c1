"""``W8A8``: ``int8`` codes, one bf16 scale per output row (``[out, 1]``).

Live layout: as loaded. vLLM-CPU packs the int8 weight for oneDNN and frees ``weight``, so the
in-place writer finds those layers unfit and they fall back to the layerwise reload; a layer
that keeps its dense ``[out, in]`` weight is written in place.
"""

from __future__ import annotations

import torch

from .base import LiveLayout
from .preset import PresetScheme

W8A8 = PresetScheme("W8A8", torch.int8, "channel", live=LiveLayout(codes="as_loaded", scales="widened"))
