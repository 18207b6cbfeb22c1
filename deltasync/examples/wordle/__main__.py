"""``python -m deltasync.examples.wordle``: run the Wordle server."""
from __future__ import annotations

from ._server import main

raise SystemExit(main())
