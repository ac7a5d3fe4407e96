"""Checkpoint directories for the tests that refit from a directory (no torch needed).

The simulator's ``reload_weights`` and the router's checks before a refit (``router.fleet.checkpoint``) read
what vLLM reads: ``config.json`` and ``*.safetensors`` files. The layout is written by the module that reads
it (``launcher.engines.sim.checkpoint.write_checkpoint``); these are the tests' shorthands over it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from launcher.engines.sim.checkpoint import SIM_CONFIG, write_checkpoint

CONFIG = SIM_CONFIG


def checkpoint(root: Path, name: str, fill: bytes = b"a", config: dict[str, Any] | None = None) -> Path:
    """``root/name`` with ``config`` (default ``CONFIG``) and one F32 tensor of ``fill`` bytes."""
    return Path(write_checkpoint(str(root / name), fill, config=config))


def broken(root: Path, name: str) -> Path:
    """Its config is right, its weights are not (a half-written copy): found only by the engine's load."""
    d = checkpoint(root, name)
    (d / "model.safetensors").write_bytes(b"garbage" * 100)
    return d
