"""Which weight-transfer backends an engine on the CPU can run, read from its ``/server_info``.

Why: the weight-transfer set-up (``/fleet/weight_transfer/init``) refuses, before anything is sent, an
engine whose backend cannot work where it runs: on vLLM 0.32 a failed transfer call can leave an engine
without weights (the next generation step kills its engine core). Every backend vLLM 0.32 ships needs a
GPU (``nccl``, ``sparse_nccl``, ``nccl_m2n``: libnccl and the current CUDA device; ``ipc``: CUDA IPC;
``sharded_rdt``: Ray actors, NIXL and CUDA events; ``modelexpress``: a package of its own), so a CPU
engine was refused whatever its backend. rl-launch's ``rl_launch_gloo`` (the launcher's worker extension,
``launcher/engines/vllm/worker_ext/rl_launch_gloo.py``) streams over gloo and runs on a CPU engine; a CPU
engine started with it is accepted.
"""

from __future__ import annotations

from typing import Any

CPU_BACKENDS = ("rl_launch_gloo",)
"""The backends that run on a CPU engine (measured on vLLM 0.32 CPU; the rest need a GPU)."""


def backend_of(config: dict[str, Any]) -> str | None:
    """The engine's weight-transfer backend from its ``/server_info`` config (``weight_transfer_config``:
    null, or ``{"backend": ...}``), or None when it was started without one."""
    section = config.get("weight_transfer_config")
    value = section.get("backend") if isinstance(section, dict) else None
    return value if isinstance(value, str) and value else None


def runs_on_cpu(config: dict[str, Any]) -> bool:
    """Whether the engine's backend (its ``/server_info`` config) can stream weights into a CPU engine."""
    return backend_of(config) in CPU_BACKENDS
