"""The wire format: file names, the pointer, and the bytes of anchors and deltas.

This package is the only code that knows how files in a bucket are laid out;
docs/protocol.md describes every byte of what it writes, and tests pin golden bytes. Both the
trainer side (``_publisher``) and the server side (``_receiver``) go through it. One module
per concern, lowest first:

- :mod:`~deltasync.format.versions`: the format's name and version numbers;
- :mod:`~deltasync.format.limited_json`: untrusted JSON parsed within limits, and checks of
  its integers and hex strings;
- :mod:`~deltasync.format.container`: safetensors files, written byte for byte (sorted
  metadata keys: the same content always gives the same bytes) and read after their tensor
  table was checked;
- :mod:`~deltasync.format.codecs`: the registry of delta codecs, one module each
  (:mod:`~deltasync.format.codecs.raw`, :mod:`~deltasync.format.codecs.zstd`), and
  :class:`Change`;
- :mod:`~deltasync.format.paths`: the paths of the pointer, the history, the data files and
  the views;
- :mod:`~deltasync.format.pointer_checks`: a pointer's JSON checked, within limits, before
  anything is built from it;
- :mod:`~deltasync.format.entries`: the entries of the files a pointer names;
- :mod:`~deltasync.format.writer_record`: who committed a pointer (and claimed a bucket);
- :mod:`~deltasync.format.pointer`: the pointer (``latest.json``);
- :mod:`~deltasync.format.header`: the metadata every anchor and delta carries;
- :mod:`~deltasync.format.anchors` and :mod:`~deltasync.format.delta`: the two kinds of file.
"""

from __future__ import annotations

from . import versions
from .anchors import ANCHOR_PART_BYTES, AnchorSource, anchor_parts, anchor_stream, decode_anchor, encode_anchor
from .codecs import CODECS, BaseLookup, Change, Codec, DeltaContext, get_codec, register_codec, unregister_codec
from .container import (
    MAX_HEADER_BYTES,
    TensorChunks,
    TensorSpan,
    load_safetensors,
    load_tensors,
    safetensors_bytes,
    safetensors_stream,
    tensor_spans,
)
from .delta import decode_delta, delta_pieces, encode_delta
from .header import (
    MAX_SLICES_BYTES,
    FileHeader,
    header_length,
    parse_header,
    read_header,
    read_metadata,
    with_extra_metadata,
)
from .limited_json import MAX_COUNT, check_hex, check_int, parse_json
from .manifest import manifest_digest, tensors_manifest
from .pointer import (
    DATA_PATH_RE,
    HISTORY_PATH,
    CLAIM_PATH,
    MAX_ANCHORS,
    MAX_HISTORY_BYTES,
    MAX_PARTS,
    MAX_POINTER_BYTES,
    POINTER_PATH,
    VIEW_NAME_RE,
    VIEWS_PREFIX,
    ChainEntry,
    PartEntry,
    Pointer,
    WriterRecord,
    anchor_path,
    data_path_version,
    delta_path,
    part_path,
    sha256_hex,
    view_names,
    view_prefix,
)
from .versions import (
    CHAIN_FORMAT_VERSION,  # noqa: F401  (exported: versions.__all__ below)
    FORMAT_NAME,  # noqa: F401  (exported: versions.__all__ below)
    FORMAT_VERSION,  # noqa: F401  (exported: versions.__all__ below)
    MANIFEST_FORMAT_VERSION,  # noqa: F401  (exported: versions.__all__ below)
    PARTS_FORMAT_VERSION,  # noqa: F401  (exported: versions.__all__ below)
    READABLE_FILE_FORMAT_VERSIONS,  # noqa: F401  (exported: versions.__all__ below)
    READABLE_FORMAT_VERSIONS,  # noqa: F401  (exported: versions.__all__ below)
)

__all__ = [
    "POINTER_PATH",
    "HISTORY_PATH",
    "CLAIM_PATH",
    "DATA_PATH_RE",
    "MAX_ANCHORS",
    "MAX_COUNT",
    "MAX_HEADER_BYTES",
    "MAX_HISTORY_BYTES",
    "MAX_PARTS",
    "MAX_POINTER_BYTES",
    "MAX_SLICES_BYTES",
    "CODECS",
    "Codec",
    "DeltaContext",
    "get_codec",
    "register_codec",
    "unregister_codec",
    "BaseLookup",
    "ChainEntry",
    "PartEntry",
    "Pointer",
    "WriterRecord",
    "Change",
    "FileHeader",
    "ANCHOR_PART_BYTES",
    "AnchorSource",
    "anchor_parts",
    "TensorChunks",
    "TensorSpan",
    "anchor_path",
    "delta_path",
    "part_path",
    "data_path_version",
    "encode_anchor",
    "anchor_stream",
    "encode_delta",
    "delta_pieces",
    "decode_anchor",
    "decode_delta",
    "read_header",
    "read_metadata",
    "with_extra_metadata",
    "parse_header",
    "header_length",
    "tensor_spans",
    "load_tensors",
    "load_safetensors",
    "safetensors_bytes",
    "safetensors_stream",
    "parse_json",
    "check_int",
    "check_hex",
    "sha256_hex",
    "VIEWS_PREFIX",
    "VIEW_NAME_RE",
    "view_prefix",
    "view_names",
    "manifest_digest",
    "tensors_manifest",
]
__all__ += versions.__all__  # the format's name and version numbers
