"""Read a checkpoint directory the way vLLM's safetensors loader does, failing with the same messages.

Why: a refit test against simulated engines must meet the failures a real fleet meets (a missing
directory, one without weights, a truncated or garbage ``model.safetensors``) and must see two engines
that loaded the same directory agree while engines on different directories disagree. So the simulator
parses every ``*.safetensors`` header (8-byte little-endian length N, then N bytes of JSON naming each
tensor's dtype, shape and byte range) and checks it as the ``safetensors`` library does (messages
measured with safetensors' ``safe_open`` on crafted files), with the parser the router's check before a
refit uses (``router.fleet.safetensors``: one parser, so the check refuses what this load fails on), and
the loaded "weights" are a SHA-256 over the files' names and bytes.

vLLM with ``load_format=auto`` falls back to ``*.bin`` / ``*.pt`` files and filters shards through
``model.safetensors.index.json``; the simulator reads ``*.safetensors`` only, all of them. A path that
is not a directory is taken for a Hugging Face repo id, as vLLM does, and fails as it does offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Any

from router.fleet.safetensors import HeaderError, read_header


class CheckpointError(Exception):
    """The message vLLM's worker fails with (``str`` of the loader's exception)."""


def check_safetensors(path: str) -> None:
    """Validate one file's header against its size; raises ``CheckpointError`` with the library's words
    (the parser is the router's check's own, ``router.fleet.safetensors``)."""
    with open(path, "rb") as fh:
        try:
            read_header(fh, os.fstat(fh.fileno()).st_size)
        except HeaderError as e:
            raise CheckpointError(str(e)) from None


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
    bytes, other weights). For the tests and the benches: one writer of the layout this module reads.
    The modes are set, not left to the umask: the router refuses a group-writable checkpoint."""
    os.makedirs(directory)
    os.chmod(directory, 0o755)
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
    for name in ("config.json", "model.safetensors"):
        os.chmod(os.path.join(directory, name), 0o644)
    return directory
