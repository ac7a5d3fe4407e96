"""LoRA adapter directories for the tests (no torch, no peft): what vLLM's loader and the simulator's read.

PEFT's layout: ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``...) and
``adapter_model.safetensors`` holding one ``lora_A``/``lora_B`` pair per target module, shaped by the rank.
One writer, so the simulator's tests and the router's adapter tests load the same kind of directory.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

HIDDEN = 64
"""The width of the simulated model's projections (``checkpoint.SIM_CONFIG``'s ``hidden_size``)."""


def write_adapter(
    directory: Path,
    rank: int = 8,
    *,
    broken: bool = False,
    fill: bytes = b"a",
    rank_pattern: dict[str, int] | None = None,
    base_model: str = "sim",
    hidden: int = HIDDEN,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
) -> Path:
    """A LoRA adapter of ``rank`` in ``directory`` (made): ``fill`` bytes as its weights (other bytes,
    another adapter); ``broken``: its ``adapter_model.safetensors`` is garbage, which vLLM's load fails
    on ("header too large"); ``hidden``: the width its matrices take (another than the model's passes
    every check of the files and fails only the engine's load, as an adapter of another base model).
    ``targets``: its ``target_modules`` (the tensors stay two attention projections' either way).
    Returns ``directory``."""
    directory.mkdir(parents=True)
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "base_model_name_or_path": base_model,
    }
    if rank_pattern:
        config["rank_pattern"] = rank_pattern
    (directory / "adapter_config.json").write_text(json.dumps(config))
    tensors: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for module in ("q_proj", "v_proj"):
        prefix = f"base_model.model.model.layers.0.self_attn.{module}"
        for part, shape in (("lora_A", [rank, hidden]), ("lora_B", [HIDDEN, rank])):
            size = 4 * shape[0] * shape[1]
            tensors[f"{prefix}.{part}.weight"] = {
                "dtype": "F32",
                "shape": shape,
                "data_offsets": [offset, offset + size],
            }
            offset += size
    header = json.dumps(tensors).encode()
    path = directory / "adapter_model.safetensors"
    if broken:
        path.write_bytes(b"garbage" * 100)
    else:
        path.write_bytes(struct.pack("<Q", len(header)) + header + (fill * offset)[:offset])
    return directory
