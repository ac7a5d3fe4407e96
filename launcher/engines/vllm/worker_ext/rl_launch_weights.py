"""vLLM worker extension: a checksum of every weight the engine computes with.

Why: vLLM 0.32's ``/weight_checker`` hashes each ``nn.Parameter`` as it stands. On the CPU build,
``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py``, called by every unquantized
linear layer's ``process_weights_after_loading`` with ``remove_weight=True``) repacks a linear layer's
weight for its kernel (sgl-kernel's VNNI packing, a oneDNN matmul handle, or zentorch's prepacked form),
keeps the packed copy only inside the closure ``layer.cpu_linear``, and replaces ``layer.weight`` with an
empty parameter. So the checker reports SHA-256 of zero bytes for every linear weight (qkv, o_proj,
gate_up, down_proj: 8 of the tiny model's 15 parameters), and a checkpoint differing in any of them has
the same checksum. The packed copy cannot be read back portably (a oneDNN handle is a C++ pointer).

What this hashes instead, per worker (``collective_rpc``, each TP/PP rank its own shard, named as vLLM's
checker names them, prefix included): every parameter as vLLM's checker does, and for every layer with a
CPU kernel (``cpu_linear``) the weight *as the kernel computes with it*: the kernel is run on an identity
matrix (``cpu_linear(I_K) = W^T``, chunked), which gives back the ``[N, K]`` weight in its dtype. That
is exact: each output is ``1 * w`` plus zeros, accumulated in float32 and written in the weight's dtype
(a ``-0.0`` comes back as ``0.0``, and a NaN spreads along its output column: neither changes what the
kernel computes). An emptied parameter's entry is the kernel's weight; where the parameter is still
there (``lm_head`` keeps it, and keeps a packed copy beside it), a kernel copy that differs from it is
reported as ``NAME:kernel``, so an engine that computes with other weights than it shows stands out.
On a GPU build no layer has ``cpu_linear``, and the table is vLLM's checker's: one form on every
device, the fused parameter's bytes (``qkv_proj`` = q, k and v stacked, as vLLM holds them).
What the probe costs: ``K x K x N`` multiply-adds per layer on the engine's own kernel (the tiny test
model: milliseconds; a 7B model on CPUs: tens of TFLOP, minutes), once per checksum read. A cheaper
fingerprint (a few random rows instead of the identity) was not taken: its outputs are rounded to the
weight's dtype, so a small change of one weight can vanish from it, and hashing the packed copy itself
would give engines on CPUs of another ISA (another packing) other checksums for the same weights.

Weights detached by a failed reload (on the meta device) fail the call, as vLLM's checker does, so a
refit's "checksum unreadable" still means "no weights".

Dependency-free beyond torch and the standard library, and torch is imported only when the method runs:
this file is imported by the engine's own interpreter (vLLM's venv, no rl-launch), named by the
launcher with ``--worker-extension-cls`` and found on the ``PYTHONPATH`` it sets
(``launcher.engines.vllm.worker_ext``); the router calls the method by name
(``router.fleet.weight_checksums.CHECKSUM_METHOD``).
"""

from __future__ import annotations

import hashlib
from typing import Any

try:  # the engine's interpreter: this directory is on its PYTHONPATH
    from rl_launch_amx import request_amx_tiles
    from rl_launch_gloo import register as register_gloo_transfer
except ImportError:  # the launcher's: imported as launcher.engines.vllm.worker_ext.rl_launch_weights
    from .rl_launch_amx import request_amx_tiles
    from .rl_launch_gloo import register as register_gloo_transfer

# Before any layer computes: vLLM's CPU build may run AMX code that never asks for it (rl_launch_amx).
AMX_TILES_GRANTED = request_amx_tiles()
# Before the worker loads its model (where vLLM's factory makes the transfer engine): streamed weights on
# CPU engines, --weight-transfer-config '{"backend": "rl_launch_gloo"}' (rl_launch_gloo).
GLOO_TRANSFER_REGISTERED = register_gloo_transfer()

EXTENSION_CLS = "rl_launch_weights.WeightChecksums"
METHOD = "rl_launch_weight_checksums"
"""The method ``collective_rpc`` calls (``router.fleet.weight_checksums.CHECKSUM_METHOD``)."""
KERNEL_SUFFIX = ":kernel"
PROBE_ROWS = 1024
"""Rows of the identity per kernel call: bounds the probe's memory at ``PROBE_ROWS x N`` values."""
META = "Cannot copy out of meta tensor; no data!"


def _digest(tensor: Any) -> str:
    import torch

    flat = tensor.detach().cpu().contiguous().view(-1)
    return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()


def _shape(module: Any, weight: Any) -> tuple[int, int]:
    """``(N, K)`` of a layer's weight: the parameter's own shape, or for an emptied one the layer's
    partition sizes (``LinearBase``)."""
    if weight.ndim == 2 and weight.numel() > 0:
        return int(weight.shape[0]), int(weight.shape[1])
    n = getattr(module, "output_size_per_partition", None)
    k = getattr(module, "input_size_per_partition", None)
    if not isinstance(n, int) or not isinstance(k, int):
        raise RuntimeError(f"{type(module).__name__}: emptied weight and no partition sizes to probe it")
    return n, k


def kernel_weight(module: Any) -> Any:
    """The ``[N, K]`` weight ``module.cpu_linear`` computes with, read back through the kernel itself."""
    import torch

    weight = module.weight
    n, k = _shape(module, weight)
    rows = []
    with torch.no_grad():
        for start in range(0, k, PROBE_ROWS):
            stop = min(k, start + PROBE_ROWS)
            probe = torch.zeros(stop - start, k, dtype=weight.dtype)
            probe[:, start:stop] = torch.eye(stop - start, dtype=weight.dtype)
            out = module.cpu_linear(probe, weight, None)
            rows.append(out.reshape(stop - start, n).to(weight.dtype))
    return torch.cat(rows).t().contiguous()


def weight_checksums(model: Any, prefix: str = "") -> dict[str, str]:
    """``{prefix + name: sha256 hex}`` of every parameter and every kernel's weight (see the module doc)."""
    import torch

    table: dict[str, str] = {}
    params: dict[str, Any] = {}
    for name, param in model.named_parameters():
        if param.is_meta:
            raise RuntimeError(META)
        params[name] = param
    try:  # vLLM's own walk: inner tensors of wrapper subclasses and shared parameters, by its names
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

        table.update(compute_tensor_digests(model))
    except ImportError:
        table.update({name: _digest(p) for name, p in params.items()})
    for mname, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        weight = getattr(module, "weight", None)
        if not callable(linear) or not isinstance(weight, torch.Tensor):
            continue
        if weight.is_meta:
            raise RuntimeError(META)
        key = f"{mname}.weight" if mname else "weight"
        kernel = kernel_weight(module)
        if weight.numel() == 0:
            table[key] = _digest(kernel)
        elif kernel.shape != weight.shape or not torch.equal(kernel, weight.to(kernel.dtype)):
            table[key + KERNEL_SUFFIX] = _digest(kernel)
    return {prefix + name: digest for name, digest in sorted(table.items())}


class WeightChecksums:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; its methods run on every worker."""

    def rl_launch_weight_checksums(self) -> dict[str, Any]:
        """``{"checksums": {...}, "kernels": n}``: this worker's table, and how many layers' weights were
        read through their CPU kernel."""
        worker: Any = self
        prefix_of = getattr(worker, "_weight_checksum_prefix", None)
        prefix = prefix_of() if callable(prefix_of) else ""
        model = worker.model_runner.get_model()
        kernels = sum(callable(getattr(m, "cpu_linear", None)) for m in model.modules())
        return {"checksums": weight_checksums(model, prefix), "kernels": kernels}
