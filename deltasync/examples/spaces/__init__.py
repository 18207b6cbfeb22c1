"""``deltasync spaces``: deploy the Wordle example's servers as Hugging Face Spaces.

Three things on the Hub, each created only if missing and configured every time:

1. the bucket ``NAMESPACE/BUCKET`` (private unless asked otherwise) that the trainer publishes to;
2. the rollout Space (``spaces/vllm``: vLLM with deltasync's extension, on a GPU) with the
   variables ``MODEL``, ``DELTASYNC_BUCKET`` and ``DELTASYNC_FOLLOW`` (``1`` with ``follow``: the
   Space follows the bucket by itself, every ``DELTASYNC_FOLLOW_INTERVAL`` seconds; else ``0``),
   the secrets ``DELTASYNC_TOKEN`` and ``HF_TOKEN`` and its hardware;
3. the Wordle Space (``spaces/wordle``, on a CPU) with ``MAX_SESSIONS`` and its hardware;

then each Space's files are uploaded (which starts its build). Variables and secrets are set
before the upload, so the first build already runs with them. The shared token is taken from
an environment variable, or from a file, or generated and written to that file; it is never
printed. :func:`deploy_spaces` takes the ``HfApi`` to call, so tests pass a recorder.

Modules: ``_plan`` (options and the calls they need), ``_hub`` (making the calls), ``_command``
(the command line).
"""

from __future__ import annotations

from ._command import add_parser, run
from ._hub import deploy_spaces
from ._plan import DEFAULT_MODEL, SpacesConfig, SpacesPlan, Step, default_token_file, space_files, space_url

__all__ = [
    "DEFAULT_MODEL",
    "SpacesConfig",
    "SpacesPlan",
    "Step",
    "add_parser",
    "default_token_file",
    "deploy_spaces",
    "run",
    "space_files",
    "space_url",
]
