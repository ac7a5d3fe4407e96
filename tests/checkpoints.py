"""Checkpoint directories as a safetensors loader reads them, made by the tests (no torch needed).

The simulator's ``reload_weights`` and the router's checks before a refit (``router.fleet.checkpoint``) read
what vLLM reads: ``config.json`` and ``*.safetensors`` files (an 8-byte header length, a JSON header, the
data). One maker for every test that refits from a directory, so they all load the same layout.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

CONFIG: dict[str, Any] = {
    "architectures": ["SimForCausalLM"],
    "model_type": "sim",
    "hidden_size": 64,
    "vocab_size": 512,
}


def checkpoint(root: Path, name: str, fill: bytes = b"a", config: dict[str, Any] | None = None) -> Path:
    """``root/name`` with ``config`` (default ``CONFIG``) and one F32 tensor of ``fill`` bytes."""
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config or CONFIG))
    n = 256
    header = json.dumps(
        {
            "__metadata__": {"format": "pt"},
            "lm_head.weight": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]},
        }
    ).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + fill * 4 * n)
    return d


def broken(root: Path, name: str) -> Path:
    """Its config is right, its weights are not (a half-written copy): found only by the engine's load."""
    d = checkpoint(root, name)
    (d / "model.safetensors").write_bytes(b"garbage" * 100)
    return d
