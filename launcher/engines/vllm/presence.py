"""Whether this machine has a vLLM for the engines to run, and the fix when it has none.

An engine runs ``$RL_LAUNCH_VLLM_PYTHON -m vllm.entrypoints.openai.api_server`` when the variable is set,
else the ``vllm`` console script found on PATH (``launcher.engines.vllm.engine``). Without either, a local
``submit`` started Ray (10-15 s) before the first engine failed with "cannot run 'vllm': [Errno 2] No such
file or directory" and no word of what to install. ``cluster: local`` runs the engines here, so the spec
check (``launcher.spec.machine``) refuses it before anything starts; on Slurm the nodes decide (``rl-launch
check SPEC`` asks them), and an engine that cannot start names the same fix.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from launcher.engines.vllm.kind import VLLM_PYTHON_ENV

INSTALL = (
    f'install it: export {VLLM_PYTHON_ENV}="$(scripts/install-vllm.sh --cpu)" from rl-launch\'s repository '
    f"(--cuda on GPU nodes), or export {VLLM_PYTHON_ENV}=<the python of a venv that has vLLM>"
)
"""The fix, said wherever a missing vLLM shows."""


def no_vllm_here(environ: Mapping[str, str]) -> str | None:
    """Why the engines could not start vLLM with ``environ`` (the engines' environment), or None when
    they would find one. Only that there is an interpreter or a ``vllm`` to run: importing vLLM takes
    seconds, and an interpreter without it fails at once with "No module named 'vllm'" and its log."""
    python = environ.get(VLLM_PYTHON_ENV)
    if python:
        if os.path.isfile(python) and os.access(python, os.X_OK):
            return None
        return f"{VLLM_PYTHON_ENV}={python} is not an executable file; {INSTALL}"
    if shutil.which("vllm", path=environ.get("PATH", os.defpath)) is not None:
        return None
    return f"no vLLM for the engines: {VLLM_PYTHON_ENV} is not set and no `vllm` is on PATH; {INSTALL}"
