"""Checkpoint directories for the tests that refit from a directory (no torch needed).

The simulator's ``reload_weights`` and the router's checks before a refit (``router.fleet.checkpoint``) read
what vLLM reads: ``config.json`` and ``*.safetensors`` files. The layout is written by the module that reads
it (``launcher.engines.sim.checkpoint.write_checkpoint``); these are the tests' shorthands over it.
"""

from __future__ import annotations

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
