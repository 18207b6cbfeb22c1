"""``python -m deltasync.examples.wordle``: run the Wordle server."""

from ._server import main

raise SystemExit(main())
