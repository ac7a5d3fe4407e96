"""What an engine's weight checksum covers, and how its answer is read.

Why not vLLM's ``/weight_checker`` alone: on vLLM 0.32's CPU build it hashes zero bytes for every linear
weight (the kernel's packed copy lives outside the parameter, which is emptied), so a checkpoint that
differs in any linear layer got the same checksum, and the refit's verify, ``expected_checksum`` and the
restore's comparison saw only embeddings, norms and ``lm_head``. The launcher starts every vLLM engine
with its worker extension (``launcher.engines.vllm.worker_ext``: ``--worker-extension-cls``), whose
method ``CHECKSUM_METHOD`` hashes every weight the engine computes with, read back through the kernel;
``EngineClient.checksum`` calls it through ``/collective_rpc`` (one table per worker, merged here) and
falls back to ``/weight_checker`` only on an engine that has no such method (one the launcher did not
start, or started with a worker extension of the user's). Such an answer says which parameters it
cannot see (``uncovered``: hashed as zero bytes), and the refit's report carries them.

The table's form, on every path: ``{"dp0:pp0:pcp0:tp0:NAME": sha256 hex}``, the names vLLM's checker
uses (its fused parameters: ``qkv_proj`` is q, k and v stacked), each digest over the bytes the engine
holds, which for an unquantized checkpoint are the checkpoint's tensors' bytes (stacked where vLLM
fuses them). One engine's table goes into one short digest (``router.fleet.ops.checksum_digest``):
equal digests, equal weights. On a GPU engine both paths give the same table; on a CPU engine the
fallback's zero-byte entries differ from the extension's, so a fleet of mixed engines disagrees loudly
instead of comparing less.
"""

from __future__ import annotations

import hashlib
from typing import Any

CHECKSUM_METHOD = "rl_launch_weight_checksums"
"""The worker extension's method (``launcher/engines/vllm/worker_ext/rl_launch_weights.py``: ``METHOD``)."""
EXTENSION = "rl_launch"
CHECKER = "weight_checker"
"""``source`` of a table: the launcher's worker extension, or vLLM's ``/weight_checker`` (fallback)."""
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()
"""What vLLM's checker reports for a parameter with no bytes (an emptied CPU linear weight)."""


def no_such_method(detail: str) -> bool:
    """Whether a failed ``collective_rpc`` says the workers lack the method (vLLM: "'CPUWorker' object
    has no attribute 'rl_launch_weight_checksums'"), the one failure that falls back."""
    return "has no attribute" in detail and CHECKSUM_METHOD in detail


def merge_workers(body: Any) -> tuple[dict[str, Any] | None, str]:
    """The engine's answer from ``/collective_rpc``'s ``{"results": [one per worker]}``: ``({"checksums":
    {...}, "source", "kernels", "uncovered"}, "")``, or ``(None, why)`` for an answer that is not one."""
    results = body.get("results") if isinstance(body, dict) else None
    if not isinstance(results, list) or not results:
        return None, f"{CHECKSUM_METHOD} answered no worker results: {str(body)[:200]}"
    table: dict[str, str] = {}
    kernels = 0
    for result in results:
        part = result.get("checksums") if isinstance(result, dict) else None
        if not isinstance(part, dict) or not all(isinstance(v, str) for v in part.values()):
            return None, f"{CHECKSUM_METHOD}: a worker answered no checksums: {str(result)[:200]}"
        clash = sorted(k for k in table.keys() & part.keys() if table[k] != part[k])
        if clash:  # vLLM's names carry each rank's prefix; one name with two digests is no table
            return None, f"{CHECKSUM_METHOD}: workers disagree on one weight name: {clash[:5]}"
        table.update(part)
        kernels += int(result.get("kernels") or 0)
    return {"checksums": table, "source": EXTENSION, "kernels": kernels, "uncovered": uncovered(table)}, ""


def from_checker(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``/weight_checker`` answer, marked as such, with the parameters it hashed as zero bytes."""
    table = body.get("checksums") or {}
    return {**body, "source": CHECKER, "uncovered": uncovered(table)}


def uncovered(table: dict[str, str]) -> list[str]:
    """The parameters whose checksum is that of zero bytes: nothing of them was compared."""
    return sorted(name for name, digest in table.items() if digest == EMPTY_DIGEST)
