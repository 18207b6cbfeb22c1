"""``FP8_BLOCK``: ``float8_e4m3fn`` codes, one bf16 scale per 128x128 block
(``[ceil(out / 128), ceil(in / 128)]``).

Live layout: the weight stays ``[out, in]`` as loaded, the scale may be widened into float32.
"""

from __future__ import annotations

import torch

from .base import LiveLayout
from .preset import PresetScheme

FP8_BLOCK = PresetScheme(
    "FP8_BLOCK", torch.float8_e4m3fn, "block", (128, 128), live=LiveLayout(codes="as_loaded", scales="widened")
)
