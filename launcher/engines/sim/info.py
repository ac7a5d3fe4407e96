"""``GET /server_info``: the subset of vLLM 0.32's configuration dump that callers of the simulator read.

Why: the launcher's refit pre-checks read an engine's configuration before they send it anything (an
NCCL weight transfer on a CPU engine, or on one started without ``--weight-transfer-config``, would fail
in the worker), so the simulator must answer the same key paths with the same value types as vLLM.
Measured on vLLM 0.32 CPU (``?config_format=json``): the top level is ``{"vllm_config", "vllm_env",
"system_env"}``; in ``vllm_config``: ``device_config.device`` ("cpu"), ``weight_transfer_config``
(``null``, or ``{"backend": "nccl"}`` when started with it), ``parallel_config.tensor_parallel_size``,
``.pipeline_parallel_size``, ``.data_parallel_size``, ``.world_size`` (TP x PP), ``model_config.model``
(the path or name given to ``vllm serve``; a reload does not change it) and
``model_config.served_model_name``. With ``config_format=text`` (the default) ``vllm_config`` is one
string, ``str(VllmConfig)``. The simulator serves those keys and a few more; vLLM has many others.
"""

from __future__ import annotations

import platform
from typing import Any

from .config import SimConfig


def vllm_config(config: SimConfig) -> dict[str, Any]:
    model = config.model_path or config.model_name
    return {
        "model_config": {
            "model": model,
            "model_weights": "",
            "tokenizer": model,
            "served_model_name": config.model_name,
            "dtype": "torch.bfloat16",
            "seed": config.seed,
            "max_model_len": config.max_model_len,
            "quantization": None,
            "revision": None,
        },
        "cache_config": {
            "block_size": config.block_size,
            "enable_prefix_caching": config.enable_prefix_caching,
            "num_gpu_blocks": config.num_gpu_blocks,
        },
        "parallel_config": {
            "pipeline_parallel_size": 1,
            "tensor_parallel_size": config.world_size,
            "data_parallel_size": config.data_parallel_size,
            "data_parallel_size_local": config.data_parallel_size,
            "data_parallel_rank": 0,
            "world_size": config.world_size,
            "rank": 0,
        },
        "scheduler_config": {
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_seqs": config.max_num_seqs,
            "stream_interval": config.stream_interval,
        },
        "device_config": {"device": "cpu"},
        "load_config": {"load_format": "auto", "device": None},
        "weight_transfer_config": config.transfer_config(),
    }


def config_text(config: SimConfig) -> str:
    """Like ``str(VllmConfig)``: ``key=value`` pairs, the model first."""
    c = vllm_config(config)
    m, p = c["model_config"], c["parallel_config"]
    return (
        f"model={m['model']!r}, tokenizer={m['tokenizer']!r}, dtype={m['dtype']}, "
        f"max_seq_len={m['max_model_len']}, tensor_parallel_size={p['tensor_parallel_size']}, "
        f"pipeline_parallel_size={p['pipeline_parallel_size']}, "
        f"data_parallel_size={p['data_parallel_size']}, device_config=cpu, "
        f"served_model_name={m['served_model_name']}, "
        f"enable_prefix_caching={c['cache_config']['enable_prefix_caching']}, "
        f"weight_transfer_config={c['weight_transfer_config']}"
    )


def server_info(config: SimConfig, json_format: bool) -> dict[str, Any]:
    return {
        "vllm_config": vllm_config(config) if json_format else config_text(config),
        "vllm_env": {
            "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": config.keep_alive_on_engine_death,
            "VLLM_SERVER_DEV_MODE": True,
        },
        "system_env": {
            "is_cuda_available": "False",
            "os": platform.platform(),
            "python_version": platform.python_version(),
            "vllm_version": "0.32.0 (simulated)",
        },
    }
