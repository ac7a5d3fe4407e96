"""Ask Linux for the AMX tile state before a vLLM CPU worker computes, so short prompts do not kill it.

Why: on x86-64 Linux (5.16 and later) a process must request the AMX tile data state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``) before its first AMX instruction, or the
kernel answers that instruction with SIGILL. vLLM 0.32's CPU build packs small linear layers for
sgl-kernel's AMX GEMM on every CPU that reports ``amx_tile`` (Sapphire Rapids and later), and that
kernel never makes the request: oneDNN does, but only once it takes a GEMM itself, which it does for
longer prompts. So an engine whose first request is short (measured here: ``"hello 1"``, 3 prompt
tokens) loses its worker with exit code -4 and answers every request 500 from then on, while one whose
first prompt is long serves normally. Measured on this project's machines (a Xeon with AMX in a
Firecracker VM): the stock ``vllm.entrypoints.openai.api_server`` died on ``"hello 1"``; the same
server with this request made in its worker served it.

This module is imported by every engine worker through the launcher's worker extension
(``rl_launch_weights``, named by ``--worker-extension-cls``). The request is harmless where AMX is
absent or already granted (the kernel answers an error or 0; either is ignored), and it changes no
computed value: it only lets the process use an instruction set it already chose to use. Standard
library only: the engine's interpreter has no rl-launch installed.
"""

from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86-64 syscall number of arch_prctl
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx_tiles() -> bool:
    """Request the AMX tile state for this process; whether the kernel granted it (False off x86-64 Linux)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False
