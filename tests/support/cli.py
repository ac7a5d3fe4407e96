"""The command line as a user runs it: the venv's own ``rl-launch``, by path (no ``$PATH`` lookup)."""

from __future__ import annotations

import sys
from pathlib import Path

RL_LAUNCH = str(Path(sys.executable).with_name("rl-launch"))
