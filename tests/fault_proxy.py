"""An HTTP proxy that breaks requests on purpose, in front of the test S3 server.

Each request is matched against the proxy's rules, in order; the first rule that matches and
still has faults to give decides what the client gets:

- ``"503"``: ``503 SlowDown`` (S3's throttling answer), the request never reaches the server;
- ``"500"``: ``500 InternalError``, the request never reaches the server;
- ``"reset"``: the connection is closed without an answer, before the server sees the request;
- ``"lost"``: the request reaches the server, then the connection is closed without its answer
  (a PUT that landed, whose client cannot know it did);
- ``"truncate"``: the server's answer, with its full ``Content-Length``, cut after half its body;
- ``"slow"``: the server's answer, ``delay`` seconds late.

Everything else is passed through. :attr:`FaultProxy.injected` counts the faults given, by kind.
"""

from __future__ import annotations

import http.client
import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("503", "500", "reset", "lost", "truncate", "slow")

_ERRORS = {
    "503": (503, "SlowDown", "Please reduce your request rate."),
    "500": (500, "InternalError", "We encountered an internal error. Please try again."),
}


@dataclass
class Rule:
    """Faults of one ``kind`` for requests whose method is ``method`` (None: any) and whose
    path matches ``path`` (a regular expression searched in the URL path)."""

    kind: str
    method: str | None = None
    path: str = ""
    count: int = 1
    """How many requests get the fault (then the rule is spent); -1: every one."""
    probability: float = 1.0
    """The chance that a matching request gets it."""
    delay: float = 0.5
    """Seconds, for ``"slow"``."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault {self.kind!r}; known: {', '.join(KINDS)}")


class FaultProxy:
    """A proxy to ``upstream`` (``http://host:port``) on a free local port, while it runs."""

    def __init__(self, upstream: str, *, seed: int = 0) -> None:
        self.upstream = urlsplit(upstream)
        self.rules: list[Rule] = []
        self.injected: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        """Requests seen, by method."""
        self.log: list[tuple[str, str, int, int]] = []
        """Every request forwarded and answered (logged as its answer goes out): method, URL path,
        bytes sent up, body bytes sent back."""
        self._lock = threading.Lock()
        self._random = random.Random(seed)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _handle(self) -> None:
                proxy._serve(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, kind: str, method: str | None = None, path: str = "", **options: float) -> None:
        """Add a rule (see :class:`Rule`)."""
        with self._lock:
            self.rules.append(Rule(kind, method, path, **options))  # type: ignore[arg-type]

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()

    def take_log(self) -> list[tuple[str, str, int, int]]:
        """The requests logged since the last call (see :attr:`log`)."""
        with self._lock:
            taken, self.log = self.log, []
        return taken

    def _fault(self, method: str, path: str) -> Rule | None:
        with self._lock:
            self.requests[method] += 1
            for rule in self.rules:
                if rule.count == 0 or (rule.method is not None and rule.method != method):
                    continue
                if not re.search(rule.path, path) or self._random.random() >= rule.probability:
                    continue
                if rule.count > 0:
                    rule.count -= 1
                self.injected[rule.kind] += 1
                return rule
        return None

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        method, path = handler.command, handler.path
        body = _read_body(handler)
        rule = self._fault(method, urlsplit(path).path)
        kind = rule.kind if rule is not None else None
        if kind in _ERRORS:
            status, code, message = _ERRORS[kind]
            xml = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                   "<RequestId>fault-proxy</RequestId></Error>").encode()  # fmt: skip
            handler.send_response(status)
            handler.send_header("Content-Type", "application/xml")
            handler.send_header("Content-Length", str(len(xml)))
            handler.end_headers()
            handler.wfile.write(xml)
            return
        if kind == "reset":
            handler.close_connection = True
            return
        connection = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=60)
        try:
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("transfer-encoding", "content-length")}
            headers["Content-Length"] = str(len(body))
            connection.request(method, path, body=body if body else None, headers=headers)
            response = connection.getresponse()
            data = response.read()
            answer_headers = response.getheaders()
        finally:
            connection.close()
        if kind == "lost":
            handler.close_connection = True
            return
        # Logged before the client can have the answer: a test that reads the log right after
        # its request returns finds it there.
        with self._lock:
            self.log.append((method, urlsplit(path).path, len(body), 0 if method == "HEAD" else len(data)))
        if kind == "slow":
            time.sleep(rule.delay)  # type: ignore[union-attr]
        handler.send_response(response.status, response.reason)
        # A HEAD answer keeps the object's Content-Length (its body is empty); others get the body's.
        dropped = ("transfer-encoding", "connection", "date", "server") + (() if method == "HEAD" else ("content-length",))
        for key, value in answer_headers:
            if key.lower() not in dropped:
                handler.send_header(key, value)
        if method != "HEAD":
            handler.send_header("Content-Length", str(len(data)))
        if kind == "truncate":
            handler.send_header("Connection", "close")
        handler.end_headers()
        if method != "HEAD":
            handler.wfile.write(data[: len(data) // 2] if kind == "truncate" else data)
        if kind == "truncate":
            handler.wfile.flush()
            handler.close_connection = True


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""
