"""The engines' key guard: one rule (every route but ``/health`` takes the job's key), two servers.

``rl_launch_engine_guard`` is kept free of any import outside the standard library because it is loaded
by the engine's own interpreter (vLLM's venv, which has no rl-launch installed): the launcher puts this
directory on the engine's ``PYTHONPATH`` and names ``rl_launch_engine_guard.EngineKeyGuard`` in vLLM's
``--middleware``. The simulator applies the same rule from the same module (``--key-guard``), so what the
tests see of a simulated engine is what a user's vLLM engine does.
"""

from __future__ import annotations

from pathlib import Path

from .rl_launch_engine_guard import GUARD_IMPORT_PATH, OPEN_PATHS, authorized, needs_key

GUARD_DIR = str(Path(__file__).resolve().parent)
"""The directory to put on an engine's ``PYTHONPATH`` so ``GUARD_IMPORT_PATH`` imports there."""

__all__ = ["GUARD_DIR", "GUARD_IMPORT_PATH", "OPEN_PATHS", "authorized", "needs_key"]
