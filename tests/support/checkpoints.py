"""Checkpoint directories for the tests that refit from a directory (no torch needed).

The simulator's ``reload_weights`` and the router's checks before a refit (``router.fleet.checkpoint``) read
what vLLM reads: ``config.json`` and ``*.safetensors`` files. The layout is written by the module that reads
it (``launcher.engines.sim.checkpoint.write_checkpoint``); these are the tests' shorthands over it.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import zipfile
from pathlib import Path
from typing import Any

from launcher.engines.sim.checkpoint import SIM_CONFIG, write_checkpoint

CONFIG = SIM_CONFIG


def checkpoint(root: Path, name: str, fill: bytes = b"a", config: dict[str, Any] | None = None) -> Path:
    """``root/name`` with ``config`` (default ``CONFIG``) and one F32 tensor of ``fill`` bytes."""
    return Path(write_checkpoint(str(root / name), fill, config=config))


def broken(root: Path, name: str) -> Path:
    """Its config is right, its ``model.safetensors`` is garbage: the router's check refuses it before a
    refit pauses anything, and an engine's own load fails on it ("header too large")."""
    d = checkpoint(root, name)
    (d / "model.safetensors").write_bytes(b"garbage" * 100)
    return d


def unloadable(root: Path, name: str) -> Path:
    """Passes the router's check and fails the engine's load: found only by the load, as a file the check
    cannot judge is. Its weights are a ``pytorch_model.bin`` whose zip directory is whole but whose pickle
    is not a model's (the check reads a torch file's container, not its pickle; vLLM's ``torch.load``
    fails on it, and the simulator, which reads ``*.safetensors`` only, finds no weights)."""
    d = checkpoint(root, name)
    (d / "model.safetensors").unlink()
    with zipfile.ZipFile(d / "pytorch_model.bin", "w") as archive:
        archive.writestr("archive/data.pkl", b"not a pickle")
        archive.writestr("archive/version", b"3\n")
    return d


FUSED = {
    "q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
    "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
}
"""How vLLM's Llama stacks checkpoint tensors into one parameter: the first part names the fused one."""
FUSED_PARTS = {p for _, parts in FUSED.values() for p in parts}


def tensor_bytes(directory: Path) -> dict[str, bytes]:
    """Every tensor's raw bytes over the directory's ``*.safetensors`` (standard library only)."""
    out: dict[str, bytes] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        raw = path.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        for name, info in header.items():
            begin, end = info["data_offsets"]
            out[name] = raw[8 + n + begin : 8 + n + end]
    return out


def llama_weight_table(directory: Path) -> dict[str, str]:
    """The checksum table an unquantized Llama checkpoint gives on a vLLM engine (TP 1), computed from its
    files: each parameter's SHA-256 over its bytes, vLLM's fused ones over their parts stacked in order."""
    tensors = tensor_bytes(directory)
    table = {}
    for name, data in tensors.items():
        module, _, leaf = name.rpartition(".")
        owner, _, part = module.rpartition(".")
        if part in FUSED:
            fused, parts = FUSED[part]
            stacked = b"".join(tensors[f"{owner}.{p}.{leaf}"] for p in parts)
            table[f"{owner}.{fused}.{leaf}"] = hashlib.sha256(stacked).hexdigest()
        elif part not in FUSED_PARTS:
            table[name] = hashlib.sha256(data).hexdigest()
    return table


def tensors_checkpoint(root: Path, name: str, tensors: dict[str, list[int]], fill: bytes = b"a") -> Path:
    """``root/name``: ``CONFIG`` and one ``model.safetensors`` of F32 ``tensors`` (name -> shape), each
    value's bytes ``fill``: a checkpoint whose tensors the check before the pause compares."""
    d = checkpoint(root, name, fill)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor, shape in tensors.items():
        size = 4 * math.prod(shape)
        header[tensor] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + fill * offset)
    return d
