"""Who committed a pointer: the writer record (the pointer's ``writer``, and a claim's).

A publisher holds a chain by writing its record into every pointer it commits (and, on an
empty bucket, into its claim); :mod:`deltasync.trainer.ownership` reads another writer's
record to learn whether the chain is held. docs/protocol.md describes its fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from .limited_json import check_int

__all__ = ["WriterRecord"]


_TOKEN_RE = re.compile(r"[0-9a-f]{32}\Z", re.ASCII)
_MAX_HOST = 255


@dataclass(frozen=True, kw_only=True)
class WriterRecord:
    """Who committed a pointer, and until when it holds the chain (the pointer's ``writer``).

    A publisher makes one when it starts (a random ``token``) and writes it, with the time of
    the commit, into every pointer it commits; another publisher reads it to learn whether the
    chain is held. Times are Unix milliseconds (integers: a pointer holds no floats)."""

    host: str
    """The writer's host name."""
    pid: int
    """The writer's process id on that host."""
    started_ms: int
    """When the writer started."""
    token: str
    """32 lower-case hex digits, random per writer: what tells two writers apart."""
    committed_ms: int
    """When this pointer was committed."""
    lease_ms: int
    """How long after ``committed_ms`` the writer holds the chain; 0 once it let go (closed)."""

    @property
    def expires_ms(self) -> int:
        """When the hold ends, unless the writer commits again."""
        return self.committed_ms + self.lease_ms

    def describe(self) -> str:
        """``host H, process P, started <UTC time>``: the writer, for an error message."""
        return f"host {self.host!r}, process {self.pid}, started {_utc(self.started_ms)}"

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host, "pid": self.pid, "started_ms": self.started_ms, "token": self.token,
            "committed_ms": self.committed_ms, "lease_ms": self.lease_ms,
        }  # fmt: skip

    @classmethod
    def from_json(cls, item: object, where: str) -> WriterRecord:
        if not isinstance(item, dict):
            raise FormatError(f"{where}: writer must be an object, got {type(item).__name__}")
        host, token = item.get("host"), item.get("token")
        if not isinstance(host, str) or not 0 < len(host) <= _MAX_HOST:
            raise FormatError(f"{where}: writer.host must be a string of 1 to {_MAX_HOST} characters")
        if not isinstance(token, str) or not _TOKEN_RE.match(token):
            raise FormatError(f"{where}: writer.token must be 32 lower-case hex digits")
        ints = {key: check_int(item.get(key), where=where, field=f"writer.{key}")
                for key in ("pid", "started_ms", "committed_ms", "lease_ms")}  # fmt: skip
        return cls(host=host, token=token, **ints)


def _utc(ms: int) -> str:
    import datetime

    return datetime.datetime.fromtimestamp(ms / 1000, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
