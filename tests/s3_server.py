"""A real S3-protocol server for the tests: moto's standalone server, in a process of its own.

It speaks S3's HTTP protocol (ETags, conditional PUTs, ranged GETs, listings), so s3fs talks to
it as it would to S3. One server runs per test session (the ``s3_server`` fixture in
tests/conftest.py); every test takes a prefix of its own in one bucket.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BUCKET = "deltasync-test"

# What s3fs (botocore) needs to talk to the server without any real credentials.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class S3Server:
    """A running moto server at :attr:`endpoint`, holding the bucket :data:`BUCKET`."""

    def __init__(self, endpoint: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.endpoint = endpoint
        self.process = process
        self.log = log

    def url(self, name: str | None = None) -> str:
        """A fresh bucket URL: ``s3://deltasync-test/<name or a random one>``."""
        return f"s3://{BUCKET}/{name or uuid.uuid4().hex}"

    def storage_options(self, endpoint: str | None = None) -> dict[str, object]:
        """s3fs options for this server (or for a proxy in front of it at ``endpoint``)."""
        return {
            "endpoint_url": endpoint or self.endpoint,
            "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"region_name": CREDENTIALS["AWS_DEFAULT_REGION"]},
            "skip_instance_cache": True,
        }


@contextmanager
def running_s3_server(log_dir: Path, timeout: float = 60.0) -> Iterator[S3Server]:
    """Start moto's server on a free port, create :data:`BUCKET`, and stop it after."""
    port = free_port()
    log = log_dir / "moto-server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **CREDENTIALS},
        )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"moto server exited with {process.returncode}: {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not answer in {timeout:.0f} s: {log.read_text()[-2000:]}") from None
                time.sleep(0.1)
        request = urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")
        urllib.request.urlopen(request, timeout=10).close()
        yield S3Server(endpoint, process, log)
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
