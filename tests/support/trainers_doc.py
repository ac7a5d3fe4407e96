"""docs/trainers.md as the tests read it: its fenced blocks, its one NeMo-RL ``remote_vllm_cfg`` block, and
OmegaConf's ``${oc.env:NAME}`` resolved with a job's environment. Shared by the page's unit test (the block
obeys NeMo-RL's config rules) and its replay against a router (the block works)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "trainers.md"
NEMO_RL_EXAMPLE = ROOT / "examples" / "trainers" / "nemo-rl-remote-vllm.yaml"
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)


def fences(lang: str) -> list[str]:
    """The page's fenced blocks of language ``lang``, in page order."""
    return [m.group(2) for m in FENCE.finditer(PAGE.read_text()) if m.group(1).strip() == lang]


def nemo_rl_block() -> dict[str, Any]:
    """The page's one YAML block holding a ``remote_vllm_cfg``, parsed."""
    blocks = [yaml.safe_load(b) for b in fences("yaml")]
    found = [b for b in blocks if "remote_vllm_cfg" in str(b)]
    assert len(found) == 1, "docs/trainers.md must have exactly one remote_vllm_cfg block"
    return found[0]


def resolved(value: Any, env: dict[str, str]) -> Any:
    """OmegaConf's ``${oc.env:NAME}`` with the job's values (an unset one fails, as OmegaConf does)."""
    if isinstance(value, dict):
        return {k: resolved(v, env) for k, v in value.items()}
    if isinstance(value, str):
        return re.sub(r"\$\{oc\.env:(\w+)\}", lambda m: env[m.group(1)], value)
    return value
