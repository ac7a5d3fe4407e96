"""The one parser of a safetensors header: the router's check before a refit and the simulator's load.

Why one: the check before the pause must refuse exactly the files an engine's load fails on (a file
cut short by a trainer killed mid-save, or still being copied, passed a check that only looked for
``*.safetensors`` names and cost the fleet every engine), and the simulator must fail where vLLM's
loader fails. Two parsers drift; one cannot. It lives in ``router/`` because the router must not
import the launcher; the simulator imports it from here.

The format: 8 bytes little-endian N, N bytes of UTF-8 JSON mapping each tensor's name to its
``dtype``, ``shape`` and ``data_offsets`` (begin, end relative to the data region), an optional
``__metadata__`` of strings; the tensors' byte ranges tile the data region from 0 without gaps or
overlaps, each exactly its shape times its dtype's size, and the data region ends at the end of the
file. The messages are the ``safetensors`` library's (measured with its ``safe_open`` on crafted
files), so an engine's error and this one read the same. What is not checked here: the tensor values
(any bytes are valid floats). Each header's tensors (``Header.tensors_of``: name, dtype, shape) are
what ``router.fleet.tensor_manifest`` compares with the served model's.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any, BinaryIO

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library refuses larger headers ("header too large")."""

DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip
HEADER_ERROR = "Error while deserializing header: "


class HeaderError(ValueError):
    """A file the safetensors library refuses; ``str`` is the library's message.

    ``size_said``: the file size its header implies, when the header could be read that far (the
    header alone for "invalid header length", header plus data for "incomplete metadata"), so a
    refusal can name both byte counts."""

    def __init__(self, detail: str, size_said: int | None = None) -> None:
        super().__init__(HEADER_ERROR + detail)
        self.detail = detail
        self.size_said = size_said


@dataclass(frozen=True)
class Header:
    """What a header that parsed says about its file."""

    header_bytes: int
    tensors: int
    size: int
    """8 + header + data: the file's size, which it was checked to be."""
    tensors_of: dict[str, tuple[str, tuple[int, ...]]] = dataclass_field(default_factory=dict)
    """Each tensor's ``(dtype, shape)`` by name."""
    digest: str = ""
    """SHA-256 of the 8 + N header bytes: names, dtypes, shapes and byte ranges, as written."""


def _json_kind(value: Any) -> str:
    """serde's name for a JSON value's type, as in its "invalid type" messages."""
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    if isinstance(value, list):
        return "sequence"
    return "null" if value is None else "map"


def _tensor_bytes(name: str, info: Any) -> tuple[int, int, int]:
    """(begin, end, expected size) of one tensor entry; raises for a malformed entry."""
    if not isinstance(info, dict):
        raise HeaderError(
            f"invalid JSON in header: invalid type: {_json_kind(info)}, expected struct TensorInfo"
        )
    for field in ("dtype", "shape", "data_offsets"):
        if field not in info:
            raise HeaderError(f"invalid JSON in header: missing field `{field}`")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise HeaderError(f"invalid JSON in header: invalid type: {_json_kind(dtype)}, expected a dtype name")
    if dtype not in DTYPE_BITS:
        expected = ", ".join(f"`{d}`" for d in DTYPE_BITS)
        raise HeaderError(f"invalid JSON in header: unknown variant `{dtype}`, expected one of {expected}")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise HeaderError(f"invalid JSON in header: invalid shape for tensor `{name}`")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise HeaderError(f"invalid JSON in header: invalid data_offsets for tensor `{name}`")
    return offsets[0], offsets[1], math.prod(shape) * DTYPE_BITS[dtype] // 8


def read_header(fh: BinaryIO, size: int) -> Header:
    """Parse and check the header of the file open as ``fh`` (at its start) whose size is ``size``;
    ``HeaderError`` with the library's message for any file the library refuses. Reads 8 + N bytes."""
    prefix = fh.read(8)
    if len(prefix) < 8:
        raise HeaderError("header too small")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise HeaderError("header too large")
    if 8 + n > size:
        raise HeaderError("invalid header length", size_said=8 + n)
    raw = fh.read(n)
    if len(raw) < n:  # the file shrank since its size was taken
        raise HeaderError("invalid header length", size_said=8 + n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"invalid UTF-8 in header: {e.reason}") from None
    try:
        header = json.loads(text)
    except json.JSONDecodeError as e:
        raise HeaderError(f"invalid JSON in header: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:  # "[[[[...": serde stops at depth 128
        raise HeaderError("invalid JSON in header: recursion limit exceeded") from None
    if not isinstance(header, dict):
        kind = _json_kind(header)
        raise HeaderError(f"invalid JSON in header: invalid type: {kind}, expected struct HashMetadata")
    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        bad = [v for v in metadata.values() if not isinstance(v, str)] if isinstance(metadata, dict) else [0]
        if bad:
            raise HeaderError(
                f"invalid JSON in header: invalid type: {_json_kind(bad[0])}, expected a string"
            )
    entries = sorted((_tensor_bytes(name, info), name) for name, info in header.items())
    start = 0
    for (begin, end, expected), name in entries:
        if begin != start or end < begin:
            raise HeaderError(f"invalid offset for tensor `{name}`")
        if end - begin != expected:
            raise HeaderError("invalid shape, data type, or offset for tensor")
        start = end
    if start + 8 + n != size:
        raise HeaderError("incomplete metadata, file not fully covered", size_said=start + 8 + n)
    tensors_of = {name: (info["dtype"], tuple(info["shape"])) for name, info in header.items()}
    digest = hashlib.sha256(prefix + raw).hexdigest()
    return Header(header_bytes=n, tensors=len(entries), size=size, tensors_of=tensors_of, digest=digest)
