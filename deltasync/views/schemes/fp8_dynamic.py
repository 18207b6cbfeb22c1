"""``FP8_DYNAMIC``: ``float8_e4m3fn`` codes, one bf16 scale per output row (``[out, 1]``).

Live layout: vLLM's compressed-tensors FP8 layers keep the fp8 weight they loaded, only
transposed to ``[in, out]`` (a view of the same storage), and the scale in a float32 parameter
the bf16 scale is widened into; both are written in place.
"""

from __future__ import annotations

import torch

from .base import LiveLayout
from .preset import PresetScheme

FP8_DYNAMIC = PresetScheme(
    "FP8_DYNAMIC", torch.float8_e4m3fn, "channel", live=LiveLayout(codes="transposed", scales="widened")
)
