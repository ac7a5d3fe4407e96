"""Checks on a checkpoint directory before the fleet is paused for it.

A refit that pauses every engine and only then finds that the directory is missing, unreadable or holds
another model has stopped rollouts for nothing, and on vLLM 0.32 a failed ``reload_weights`` leaves the
engine without weights (its next generation step kills the engine core): one typo in a path would take
every engine of the fleet out at once. So the router, which
runs the load, refuses such a directory before anything is paused, naming the reason. What it can check
cheaply: the path is absolute (an engine on another node resolves a relative one elsewhere), the directory
exists and can be read, its ``config.json`` parses, it holds weight files, and the config's architecture
and sizes are those of the served model. What it cannot: that every node sees the same files (the issue's
premise: storage every node sees), or that the weight files' contents are whole; a broken file is found by
the engine's load, and that engine is quarantined.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")
"""What vLLM's default loader reads from a directory."""
MATCHED_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
"""The config fields that must agree with the served model's: the shapes the engine allocated."""


class CheckpointRefused(ValueError):
    """A directory the fleet must not be paused for; the message says which and why."""


def read_checkpoint(path: str) -> dict[str, Any]:
    """The directory's ``config.json``, or ``CheckpointRefused`` naming what is wrong with it."""
    if not isinstance(path, str) or not path:
        raise CheckpointRefused('"from" must name a checkpoint directory')
    p = Path(path)
    if not p.is_absolute():
        raise CheckpointRefused(
            f"checkpoint directory {path!r} is relative: give an absolute path (each engine resolves it "
            "on its own node)"
        )
    if not p.exists():
        raise CheckpointRefused(f"checkpoint directory {path} does not exist")
    if not p.is_dir():
        raise CheckpointRefused(f"checkpoint {path} is not a directory")
    if not os.access(p, os.R_OK | os.X_OK):
        raise CheckpointRefused(f"checkpoint directory {path} is not readable (check its permissions)")
    config = p / "config.json"
    try:
        data = json.loads(config.read_text())
    except FileNotFoundError:
        raise CheckpointRefused(f"checkpoint directory {path} has no config.json") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointRefused(f"{config} is unreadable or not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointRefused(f"{config} is not a JSON object")
    weights = sorted(f for pattern in WEIGHT_PATTERNS for f in p.glob(pattern))
    if not weights:
        raise CheckpointRefused(
            f"checkpoint directory {path} holds no weight files ({', '.join(WEIGHT_PATTERNS)})"
        )
    unreadable = [f.name for f in weights if not os.access(f, os.R_OK)]
    if unreadable:
        raise CheckpointRefused(f"checkpoint directory {path}: weight files not readable: {unreadable}")
    return data


def mismatches(served: dict[str, Any], candidate: dict[str, Any]) -> list[str]:
    """``field: served != candidate`` for each matched field the two configs disagree on."""
    out = []
    for field in MATCHED_FIELDS:
        if field in served or field in candidate:
            a, b = served.get(field), candidate.get(field)
            if a != b:
                out.append(f"{field}: served {a!r}, checkpoint {b!r}")
    return out


def check_against(path: str, reference: dict[str, Any] | None, reference_name: str) -> dict[str, Any]:
    """``read_checkpoint`` and the comparison with the served model's config (``reference``, read from
    ``reference_name``; ``None``: none could be read, so only the directory itself is checked)."""
    candidate = read_checkpoint(path)
    if reference is not None:
        bad = mismatches(reference, candidate)
        if bad:
            raise CheckpointRefused(
                f"checkpoint directory {path} does not match the served model ({reference_name}): "
                + "; ".join(bad)
            )
    return candidate


def reference_config(root: str | None) -> dict[str, Any] | None:
    """The served model's ``config.json`` when ``root`` is a directory this process can read."""
    if not root:
        return None
    try:
        data = json.loads((Path(root) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None
