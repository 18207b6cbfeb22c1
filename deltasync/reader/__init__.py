"""The reader side: what a rollout server (or any follower) runs to read a bucket's chain.

- :mod:`.chain`: a chain's pointer, files and their checks, read (:class:`~.chain.ChainReader`);
- :mod:`.parts`: the parts several trainer ranks wrote, put back together;
- :mod:`.receiver`: :class:`~.receiver.DeltaReceiver`, a state brought to any version;
- :mod:`.poll`: when a follower reads the pointer again.

Nothing here imports a trainer-side module (``deltasync.trainer``) or an engine.
"""
from __future__ import annotations

from .chain import ChainReader, Overlay
from .poll import PointerWatch, PollOptions, PollPolicy
from .receiver import DeltaReceiver, StagedUpdate

__all__ = ["ChainReader", "DeltaReceiver", "Overlay", "PointerWatch", "PollOptions", "PollPolicy", "StagedUpdate"]
