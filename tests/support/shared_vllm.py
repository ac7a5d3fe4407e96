"""Two real vLLM CPU engines several test modules share (``tests/vllm/conftest.py``'s ``lora_engines``).

Each engine start costs ~40-50 s of one core on 2 cores (three Python processes importing torch and
vLLM, one after the other), and modules that each started their own engines of the same kind paid it
again: the fleet-reset test started one engine to flush its prefix cache, the LoRA router-restart test
two more of the same build. These engines are what both need: behind the launcher's key guard (its key
``ENGINE_KEY``), LoRA served as the router's plan says (``PLAN``: 2 adapters of rank <= 8, loadable at
run time), and vLLM's dev routes on (``/reset_prefix_cache``, the refit window's routes), as a fleet
with adapters and refits runs them. What one test leaves on them (an adapter loaded, a flushed cache)
must not be what another test's check depends on.
"""

from __future__ import annotations

import time
from pathlib import Path

from launcher.engines.base import EngineSpec, EngineStartError
from launcher.engines.vllm.engine import VllmEngine
from router.adapters.plan import RUNTIME_LORA_ENV, LoraPlan

ENGINE_KEY = "engine-key-of-the-shared-lora-engines"
PLAN = LoraPlan(max_adapters=2, max_lora_rank=8)
STARTUP_TIMEOUT_S = 600.0
HEALTH_POLL_S = 0.2
"""``wait_ready``'s poll (default 1 s): an engine that is up is seen up within 0.2 s, not 1 s."""


def lora_engines(python: str, model: Path, logdir: Path, n: int = 2) -> list[VllmEngine]:
    """``n`` engines, not started: keyed, LoRA per ``PLAN``, dev routes on; logs in ``logdir``."""
    return [
        VllmEngine(
            EngineSpec(
                model=str(model),
                served_name="tiny",
                port=0,
                api_key=ENGINE_KEY,
                extra_args=["--max-model-len", "512", "--enforce-eager", *PLAN.engine_flags()],
                env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", **RUNTIME_LORA_ENV},
                log_path=str(logdir / f"engine{i}.log"),
                startup_timeout_s=STARTUP_TIMEOUT_S,
            ),
            python=python,
            health_poll_s=HEALTH_POLL_S,
        )
        for i in range(n)
    ]


def start_all(engines: list[VllmEngine]) -> float:
    """Start every engine at once and wait for all; seconds taken. ``EngineStartError`` names the one
    that failed, with its log tail (the others are stopped by the caller's cleanup)."""
    t0 = time.monotonic()
    for e in engines:
        e.start()
    for e in engines:
        e.wait_ready(t0 + STARTUP_TIMEOUT_S)
    return time.monotonic() - t0


__all__ = ["ENGINE_KEY", "PLAN", "EngineStartError", "lora_engines", "start_all"]
