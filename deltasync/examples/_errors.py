"""The examples' errors: the process launcher's and the Wordle environment's.

Each is a :class:`deltasync.DeltaSyncError`, so one ``except`` still catches every error of the
package; the core's own errors stay in ``deltasync.errors``.
"""

from __future__ import annotations

from ..errors import DeltaSyncError

__all__ = ["ServerError", "VLLMServerError", "WordleRequestError", "WordleServerError"]


class ServerError(DeltaSyncError, RuntimeError):
    """A server process this package started (or waits for) did not become healthy, or died."""


class VLLMServerError(ServerError):
    """A vLLM server did not start, or died; the message carries the end of its log."""


class WordleRequestError(DeltaSyncError, ValueError):
    """A reset or step the game cannot take; ``status`` is its HTTP status, ``code`` a short tag."""

    def __init__(self, message: str, *, code: str = "BAD_REQUEST", status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


class WordleServerError(DeltaSyncError, RuntimeError):
    """The Wordle server answered a client's message with an error; ``code`` is the server's tag."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(f"{message} (code: {code})")
        self.code = code
