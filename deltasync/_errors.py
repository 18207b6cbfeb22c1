"""The package's exception hierarchy.

Every error that bad input, a bad bucket or a bad request can cause is a
:class:`DeltaSyncError`; messages name the file, version and parameter involved and,
where there is one, the fix.
"""

from __future__ import annotations

__all__ = [
    "AdapterError",
    "DeltaSyncError",
    "ConfigError",
    "FormatError",
    "IntegrityError",
    "VersionError",
    "StoreError",
    "NotFoundError",
    "AuthError",
    "PublishError",
    "ServerError",
    "UpdateError",
    "VLLMServerError",
    "WordleRequestError",
    "WordleServerError",
]


class DeltaSyncError(Exception):
    """Base class of every error raised by deltasync."""


class ConfigError(DeltaSyncError, ValueError):
    """An option, or a combination of options, is invalid."""


class FormatError(DeltaSyncError):
    """A file is not a valid deltasync file: unreadable, wrong metadata, wrong tensors."""


class IntegrityError(DeltaSyncError):
    """A file's bytes or the state it produces do not match its checksum or fingerprint."""


class VersionError(DeltaSyncError):
    """A version was asked for that is not committed, or does not follow from the current one."""


class StoreError(DeltaSyncError):
    """A bucket operation failed."""


class NotFoundError(StoreError, FileNotFoundError):
    """A file the bucket should hold is missing."""


class AuthError(DeltaSyncError):
    """A request did not carry the right token."""


class PublishError(DeltaSyncError):
    """A collective publish failed on at least one rank; no rank committed the version."""


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


class UpdateError(DeltaSyncError):
    """A server refused or failed an update; the message says why and what it still serves."""


class AdapterError(DeltaSyncError, ValueError):
    """An adapter, or an adapter bucket, cannot be served: the message says why and the fix."""
