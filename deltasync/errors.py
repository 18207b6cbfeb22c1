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
    "ConflictError",
    "AuthError",
    "PublishError",
    "WriterConflictError",
    "UpdateError",
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


class ConflictError(StoreError):
    """A conditional write was refused: the file is not the one the writer last read or wrote.
    Nothing was written."""


class AuthError(DeltaSyncError):
    """A request did not carry the right token."""


class PublishError(DeltaSyncError):
    """A collective publish failed on at least one rank; no rank committed the version."""


class WriterConflictError(PublishError):
    """Another writer holds the bucket's chain, or took it over: this publisher writes nothing
    more. The message names the other writer (host, process, start time, last commit)."""


class UpdateError(DeltaSyncError):
    """A server refused or failed an update; the message says why and what it still serves."""


class AdapterError(DeltaSyncError, ValueError):
    """An adapter, or an adapter bucket, cannot be served: the message says why and the fix."""
