"""``python -m deltasync.envs.wordle``, deprecated: ``python -m deltasync.examples.wordle`` runs the server."""
from __future__ import annotations

import warnings

from ...examples.wordle import main

# Run as __main__, so Python's default filters show it (the package's own warning names its importer).
warnings.warn("python -m deltasync.envs.wordle is deprecated: run python -m deltasync.examples.wordle", DeprecationWarning, stacklevel=1)
raise SystemExit(main())
