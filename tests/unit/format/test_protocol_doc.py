"""docs/protocol.md shows the bytes the code writes: every dump in it is what tests/format_example.py
renders. After a deliberate format change, ``PYTHONPATH=. python tests/format_example.py`` prints the new dumps."""

from __future__ import annotations

import re
from pathlib import Path

import zstandard

from format_example import render_examples
from format_golden import ZSTD_GOLDEN_LIBZSTD


DOC = Path(__file__).resolve().parents[3] / "docs" / "protocol.md"


def test_protocol_doc_shows_the_bytes_the_code_writes() -> None:
    doc = DOC.read_text()
    for name, text in render_examples().items():
        match = re.search(rf"<!-- dump: {re.escape(name)} -->\n```text\n(.*?)\n```", doc, re.S)
        assert match, f"docs/protocol.md has no <!-- dump: {name} --> block"
        if name == "zstd-delta" and zstandard.ZSTD_VERSION != ZSTD_GOLDEN_LIBZSTD:
            continue  # compressed bytes depend on the libzstd version
        assert match.group(1) == text, f"docs/protocol.md: dump {name!r} is stale; run python tests/format_example.py"
