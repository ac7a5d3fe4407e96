"""Read a checkpoint directory the way vLLM's safetensors loader does, failing with the same messages.

Why: a refit test against simulated engines must meet the failures a real fleet meets (a missing
directory, one without weights, a truncated or garbage ``model.safetensors``) and must see two engines
that loaded the same directory agree while engines on different directories disagree. So the simulator
parses every ``*.safetensors`` header (8-byte little-endian length N, then N bytes of JSON naming each
tensor's dtype, shape and byte range) and checks it as the ``safetensors`` library does (messages
measured with safetensors' ``safe_open`` on crafted files), and the loaded "weights" are a SHA-256 over
the files' names and bytes.

vLLM with ``load_format=auto`` falls back to ``*.bin`` / ``*.pt`` files and filters shards through
``model.safetensors.index.json``; the simulator reads ``*.safetensors`` only, all of them. A path that
is not a directory is taken for a Hugging Face repo id, as vLLM does, and fails as it does offline.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from typing import Any

MAX_HEADER_BYTES = 100_000_000
"""The safetensors library refuses larger headers ("header too large")."""

DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}  # fmt: skip
_HEADER_ERROR = "Error while deserializing header: "


class CheckpointError(Exception):
    """The message vLLM's worker fails with (``str`` of the loader's exception)."""


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


def _bad(detail: str) -> CheckpointError:
    return CheckpointError(_HEADER_ERROR + detail)


def _tensor_bytes(name: str, info: Any) -> tuple[int, int, int]:
    """(begin, end, expected size) of one tensor entry; raises for a malformed entry."""
    if not isinstance(info, dict):
        raise _bad(f"invalid JSON in header: invalid type: {_json_kind(info)}, expected struct TensorInfo")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in info:
            raise _bad(f"invalid JSON in header: missing field `{field}`")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_BITS:
        expected = ", ".join(f"`{d}`" for d in DTYPE_BITS)
        raise _bad(f"invalid JSON in header: unknown variant `{dtype}`, expected one of {expected}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _bad(f"invalid JSON in header: invalid shape for tensor `{name}`")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets):
        raise _bad(f"invalid JSON in header: invalid data_offsets for tensor `{name}`")
    return offsets[0], offsets[1], math.prod(shape) * DTYPE_BITS[dtype] // 8


def check_safetensors(path: str) -> None:
    """Validate one file's header against its size; raises ``CheckpointError`` with the library's words."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        prefix = fh.read(8)
        if len(prefix) < 8:
            raise _bad("header too small")
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise _bad("header too large")
        if 8 + n > size:
            raise _bad("invalid header length")
        raw = fh.read(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _bad(f"invalid UTF-8 in header: {e.reason}") from None
    try:
        header = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(f"invalid JSON in header: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(header, dict):
        kind = _json_kind(header)
        raise _bad(f"invalid JSON in header: invalid type: {kind}, expected struct HashMetadata")
    metadata = header.pop("__metadata__", None)
    if metadata is not None:
        bad = [v for v in metadata.values() if not isinstance(v, str)] if isinstance(metadata, dict) else [0]
        if bad:
            raise _bad(f"invalid JSON in header: invalid type: {_json_kind(bad[0])}, expected a string")
    entries = sorted((_tensor_bytes(name, info), name) for name, info in header.items())
    start = 0
    for (begin, end, expected), name in entries:
        if begin != start or end < begin:
            raise _bad(f"invalid offset for tensor `{name}`")
        if end - begin != expected:
            raise _bad("invalid shape, data type, or offset for tensor")
        start = end
    if start + 8 + n != size:
        raise _bad("incomplete metadata, file not fully covered")


def safetensors_files(directory: str) -> list[str]:
    """The directory's ``*.safetensors`` files, sorted (vLLM loads them in that order)."""
    return sorted(
        os.path.join(directory, f)
        for f in os.listdir(directory)
        if f.endswith(".safetensors") and os.path.isfile(os.path.join(directory, f))
    )


def read_checkpoint(path: str) -> str:
    """Check every header of the checkpoint at ``path``; returns its digest (hex SHA-256 over the files'
    names and bytes). Blocking: call it in a thread."""
    if not os.path.isdir(path):
        raise CheckpointError(
            "Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
            f"'{path}'. Use `repo_type` argument if needed."
        )
    files = safetensors_files(path)
    if not files:
        raise CheckpointError(f"Cannot find any model weights with `{path}`")
    for f in files:
        check_safetensors(f)
    digest = hashlib.sha256()
    for f in files:
        digest.update(os.path.basename(f).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


SIM_CONFIG: dict[str, Any] = {
    "architectures": ["SimForCausalLM"],
    "model_type": "sim",
    "hidden_size": 64,
    "vocab_size": 512,
}
"""The ``config.json`` of a checkpoint written for the simulator (what a refit compares)."""


def write_checkpoint(
    directory: str, fill: bytes = b"a", floats: int = 256, config: dict[str, Any] | None = None
) -> str:
    """Write a checkpoint the simulator (and ``read_checkpoint``) loads: ``config.json`` and one
    ``model.safetensors`` holding one F32 tensor of ``floats`` values made of ``fill`` bytes (other
    bytes, other weights). For the tests and the benches: one writer of the layout this module reads."""
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config or SIM_CONFIG, f)
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "lm_head.weight": {"dtype": "F32", "shape": [floats], "data_offsets": [0, 4 * floats]},
        }
    ).encode()
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.write(fill * 4 * floats)
    return directory
