"""Every knob of one simulated engine, with defaults calibrated to an 8B-class model on one H100.

Calibration basis (Llama-3.1-8B, bf16, vLLM v1, one H100 SXM 80 GB, ``gpu_memory_utilization=0.9``):

* KV cache: a token costs 32 layers x 8 KV heads x 128 dims x 2 (K and V) x 2 bytes = 128 KiB. Of the
  72 GB vLLM may use, ~16 GB hold the weights and ~6 GB activations and CUDA graphs, leaving ~50 GB:
  ~384k tokens, i.e. ``num_gpu_blocks = 24_000`` blocks of 16 tokens.
* Prefill: ~75 us per token, so a full 8192-token chunk step takes ~0.62 s, ~13k prompt tok/s (public
  H100 benchmarks give 10-20k tok/s for 8B prefill).
* Decode: a step re-reads the 16 GB of weights (~5 ms at ~3.3 TB/s) plus launch overhead: ~6 ms base,
  plus ~40 us per running sequence (sampling, small GEMM growth) and ~40 ns per context token
  (128 KiB of KV at ~3 TB/s). Batch 1 gives ~6 ms/token; batch 64 at 2k context ~14 ms; batch 256 at
  1.5k context ~32 ms, in line with measured vLLM inter-token latencies.
* Scheduler limits: vLLM's ``max_num_batched_tokens=8192`` and ``max_num_seqs=256``.

A ``speed`` factor divides every time, so tests and large replays run the same schedule faster.

The weight-loading knobs (``model_path``, ``reload_delay_s``, ``weight_transfer_config``, the parallel
sizes, ``engine_death_s``, ``keep_alive_on_engine_death``) mirror vLLM 0.32 CPU as measured on a real
engine; ``weights`` explains what they drive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from router.adapters.plan import VLLM_LORA_RANKS

WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc", "sparse_nccl", "sharded_rdt", "nccl_m2n", "rl_launch_gloo")
"""vLLM 0.32's ``WeightTransferConfig.backend`` choices, and rl-launch's CPU one (registered by the
launcher's worker extension: ``launcher/engines/vllm/worker_ext/rl_launch_gloo.py``)."""
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""Read from the environment, as vLLM reads it (``allow_runtime_lora_updating``); never a flag."""


@dataclass
class SimConfig:
    """Knobs of one simulated engine. Times are seconds at ``speed == 1``."""

    model_name: str = "sim"
    """Name served on ``/v1/models`` and used as the ``model_name`` metric label; requests naming
    another model get 404, as vLLM answers, so a misrouted request is not silently served."""

    max_model_len: int = 32768
    """Longest prompt + output a request may ask for; longer requests get 400 like vLLM."""

    block_size: int = 16
    """Tokens per KV block; the prefix cache hits in whole blocks, as vLLM's does."""

    num_gpu_blocks: int = 24_000
    """KV capacity in blocks (~384k tokens). Requests also get 400 when their prompt + output could not
    fit even alone, because an admitted request that can never fit would block the FIFO queue forever."""

    enable_prefix_caching: bool = True
    """Keep freed full blocks (by chained hash) for reuse until evicted (LRU); off = every prompt cold."""

    max_num_batched_tokens: int = 8192
    """Per-step token budget shared by decode tokens and chunked prefill of uncached prompt tokens."""

    max_num_seqs: int = 256
    """Most requests running (holding KV) at once; the rest wait in the FIFO queue."""

    step_base_s: float = 0.006
    """Fixed cost of one scheduler step (weights read, kernel launches)."""

    prefill_token_s: float = 75e-6
    """Cost per prompt token computed in a step (cached tokens cost nothing)."""

    decode_seq_s: float = 40e-6
    """Cost per sequence decoding one token in a step."""

    context_token_s: float = 40e-9
    """Attention cost per token of KV context of every request scheduled in a step, so steps slow down
    as batches grow long contexts, as real decode does."""

    speed: float = 1.0
    """Divides every time; tests run at 10-50x. A busy CPU makes the engine slower than modelled (it
    never catches up in bursts, see ``max_lag_s``), never faster."""

    max_lag_s: float = 0.05
    """When the event loop falls further behind the modelled clock than this, the clock is reset
    instead of running back-to-back steps to catch up, which would make a starved engine bursty."""

    default_max_tokens: int = 64
    """Output length when a request gives neither ``max_tokens`` nor ``max_completion_tokens``."""

    eos_min_tokens: int = 0
    """With ``eos_max_tokens > 0`` and no ``ignore_eos``, the model ends a sequence ("stop") with
    probability 1/mean per token, mean = (eos_min_tokens + eos_max_tokens) / 2, decided by the context
    alone (``decoding.greedy``) so a continued request stops where the uninterrupted one would."""

    eos_max_tokens: int = 0
    """0 = never stop early: every request produces its full max_tokens ("length"), which keeps
    replays and tests exactly predictable."""

    stream_interval: int = 1
    """Tokens per SSE chunk when streaming (vLLM's ``--stream-interval``); a larger value cuts the
    per-token write cost when many engines stream in one process."""

    seed: int = 0
    """Seeds output text (with the request's own ``seed`` and prompt) and the error-fault dice."""

    weights_tag: str = ""
    """Stands for the weights the engine loaded: ``/weight_checker`` checksums derive from it and the
    model name, so engines with different tags disagree as engines from different checkpoints do."""

    model_path: str = ""
    """Where the engine "loaded" its model from: ``root`` on ``/v1/models`` and
    ``model_config.model`` on ``/server_info`` (vLLM: the path or hub name given to ``vllm serve``), and
    what ``reload_weights`` without a ``weights_path`` reads. Empty: the model name. A directory holding
    ``*.safetensors`` files gives the engine that directory's weights from the start, so an engine
    started on DIR and one that reloaded DIR agree on their checksums, as vLLM engines do."""

    reload_delay_s: float = 0.0
    """How long a ``reload_weights`` takes once the checkpoint's headers were read (vLLM: ~16 ms for
    a tiny model, minutes for a big one); the engine core makes no step meanwhile."""

    env_collect_s: float = 1.6
    """How long the engine's first ``/server_info`` waits: vLLM collects its system environment then
    (``vllm.collect_env``: ``pip list``, compilers, ``nvidia-smi``), 1.6 s on an idle 2-core machine and
    over 5 s on a loaded one, and keeps it; reads that arrive while it collects each collect too
    (``functools.lru_cache`` does not hold a second caller back)."""

    weight_transfer_config: dict[str, Any] | None = None
    """vLLM's ``--weight-transfer-config`` (``{"backend": "nccl"}``; the CLI takes it as JSON). None: the
    weight-transfer routes fail with vLLM's "Weight transfer not configured...", as on such an engine."""

    world_size: int = 1
    """The engine's TP x PP ranks (its share of a weight-transfer group): ``/get_world_size`` with
    ``include_dp=false``, and ``tensor_parallel_size`` on ``/server_info`` (``pipeline_parallel_size``
    there is 1)."""

    data_parallel_size: int = 1
    """DP replicas: ``/get_world_size`` counts them by default (``include_dp=true``), as vLLM does."""

    engine_death_s: float = 1.4
    """From the first step run on detached weights (a failed reload or transfer) to the engine core
    declared dead: on vLLM 0.32 CPU the worker segfaults and the request answers 500 ~1.4 s later."""

    keep_alive_on_engine_death: bool = False
    """vLLM's ``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH``: keep the HTTP server up after the engine core died
    (every engine route 500, ``/health`` 503) instead of exiting, which is vLLM's default."""

    enable_lora: bool = False
    """vLLM's ``--enable-lora``: requests may name a loaded adapter as their model (``lora``)."""

    max_loras: int = 1
    """vLLM's ``--max-loras`` (adapters one batch mixes); checked at start as vLLM does, not modelled."""

    max_lora_rank: int = 16
    """vLLM's ``--max-lora-rank``: one of ``VLLM_LORA_RANKS``; a load of a larger rank fails (500)."""

    max_cpu_loras: int = 0
    """vLLM's ``--max-cpu-loras`` (0: ``max_loras``, vLLM's default). Not a limit on names: vLLM evicts
    the least recently used adapter and reloads it from its directory on its next request."""

    allow_runtime_lora_updating: bool = False
    """``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` in the server's environment (the command line reads it from
    there): with ``enable_lora``, mounts ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""

    def transfer_config(self) -> dict[str, Any] | None:
        """``weight_transfer_config`` as vLLM's ``WeightTransferConfig`` dumps it (None when unset)."""
        raw = self.weight_transfer_config
        if raw is None:
            return None
        if not isinstance(raw, dict) or set(raw) - {"backend"}:
            raise ValueError('weight_transfer_config must be an object with at most a "backend" key')
        backend = raw.get("backend", "nccl")
        if backend not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(f"weight transfer backend must be one of {WEIGHT_TRANSFER_BACKENDS}")
        return {"backend": backend}

    def scaled(self, seconds: float) -> float:
        """Wall-clock seconds for a modelled duration."""
        return seconds / self.speed

    def validate(self) -> None:
        """Reject settings that would make the scheduler stall rather than fail loudly at start."""
        if self.speed <= 0:
            raise ValueError("speed must be > 0")
        for name in (
            "block_size",
            "num_gpu_blocks",
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "stream_interval",
            "world_size",
            "data_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.eos_max_tokens and self.eos_min_tokens > self.eos_max_tokens:
            raise ValueError("eos_min_tokens must be <= eos_max_tokens")
        if self.reload_delay_s < 0 or self.engine_death_s < 0 or self.env_collect_s < 0:
            raise ValueError("reload_delay_s, engine_death_s and env_collect_s must be >= 0")
        self.transfer_config()
        if self.enable_lora:  # vLLM's LoRAConfig checks, at start
            if self.max_lora_rank not in VLLM_LORA_RANKS:
                raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, VLLM_LORA_RANKS))}")
            if self.max_loras < 1:
                raise ValueError("max_loras must be >= 1")
            if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
                raise ValueError(
                    f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
                )
