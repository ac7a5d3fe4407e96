"""The vLLM worker extension the launcher names in every engine's ``--worker-extension-cls``.

``rl_launch_weights`` is kept free of any import outside the standard library (torch only inside its
methods) because it is loaded by the engine's own interpreter (vLLM's venv, which has no rl-launch
installed): the launcher puts this directory on the engine's ``PYTHONPATH``, as it does the key guard's.
"""

from __future__ import annotations

from pathlib import Path

from .rl_launch_weights import EXTENSION_CLS, METHOD

WORKER_EXT_DIR = str(Path(__file__).resolve().parent)
"""The directory to put on an engine's ``PYTHONPATH`` so ``EXTENSION_CLS`` imports there."""
WORKER_EXT_FLAG = "--worker-extension-cls"

__all__ = ["EXTENSION_CLS", "METHOD", "WORKER_EXT_DIR", "WORKER_EXT_FLAG"]
