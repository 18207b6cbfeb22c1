"""The Wordle Space: serve deltasync.examples.wordle until stopped.

Configured by environment variables (Space variables): ``HOST`` (default 0.0.0.0), ``PORT``
(8000, the Space's ``app_port``), ``MAX_SESSIONS`` (256 games at once), ``MAX_GUESSES`` (6),
``LOG_LEVEL`` (info). The trainer plays over the WebSocket ``/ws``; ``/health`` answers probes.
"""

from __future__ import annotations

import os
import sys

from deltasync.examples.wordle import main


def argv(environ: dict[str, str] | os._Environ[str] = os.environ) -> list[str]:
    """The server's command line from the Space's variables."""
    return [
        "--host", environ.get("HOST", "0.0.0.0"),
        "--port", environ.get("PORT", "8000"),
        "--max-sessions", environ.get("MAX_SESSIONS", "256"),
        "--max-guesses", environ.get("MAX_GUESSES", "6"),
        "--log-level", environ.get("LOG_LEVEL", "info"),
    ]  # fmt: skip


if __name__ == "__main__":
    sys.exit(main(argv()))
