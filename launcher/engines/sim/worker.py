"""The simulated engine's GPU worker: its weights and the weight-update methods vLLM 0.32's worker has.

Why: what a refit meets on a real fleet is decided in vLLM's worker (``vllm/v1/worker/gpu_worker.py``
and the NCCL transfer engine): which calls fail, with which message, and in which state they leave the
model. Measured on vLLM 0.32 CPU (the tiny test model), and mirrored here:

* A failing call (an unknown method, a bad argument, "Weight transfer not configured") fails that call
  only: the engine keeps serving.
* But some calls *detach* the weights first (vLLM's layerwise reload moves every layer onto the meta
  device until all its weights arrived): ``reload_weights`` does so before it reads the checkpoint, so a
  missing directory, one without ``*.safetensors`` or a bad header leaves the model detached;
  ``start_weight_update`` (with a transfer engine) detaches until ``finish_weight_update``; a failed
  ``update_weights`` ends the update but leaves the model detached. While detached the engine answers
  ``/health`` 200 and checksums fail ("Cannot copy out of meta tensor; no data!"); a later good reload (or
  a finished update) re-attaches it; but the first generation step on detached weights kills the engine
  core (``core``).
* ``init_weight_transfer_engine`` cannot succeed on a CPU engine ("Cannot access accelerator device when
  none is available."), so ``update_weights`` always fails ("NCCL weight transfer not initialized..."),
  except with rl-launch's CPU backend ``rl_launch_gloo`` (the same init and update fields as ``nccl``):
  its init records the engine's place in the group (``transfer_group``: ``rank_offset``, ``world_size``
  and the rest as given), and a round is taken as broadcast (the simulator has no wire): the weights
  become a digest of the round's update info at ``finish_weight_update``, the same on every engine of
  the round.
* ``reload_weights`` does not change the weight version; ``finish_weight_update`` with a
  ``weight_version`` sets it (after the worker succeeded).

The weights themselves are a digest: ``None`` for the engine's built-in weights (the model name and
``weights_tag``, as before), or a checkpoint directory's digest (``checkpoint.read_checkpoint``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from .checkpoint import CheckpointError, read_checkpoint
from .config import SimConfig

SIM_PARAMETERS = ("model.embed_tokens.weight", "model.layers.0.weight", "lm_head.weight")
WORKER_CLASS = "CPUWorker"
META_TENSOR = "Cannot copy out of meta tensor; no data!"
NOT_CONFIGURED = (
    "Weight transfer not configured. Please set weight_transfer_config to enable weight transfer."
)
NO_ACCELERATOR = "Cannot access accelerator device when none is available."
GLOO = "rl_launch_gloo"
NCCL_INIT_INFO = "NCCLWeightTransferInitInfo"
NCCL_INIT_REQUIRED = ("rank_offset", "world_size")
NCCL_INIT_OPTIONAL = (
    "master_address", "master_port", "nccl_unique_id_b64", "packed", "packed_buffer_size_bytes",
    "packed_num_buffers",
)  # fmt: skip
NCCL_UPDATE_FIELDS = ("names", "dtype_names", "shapes")
RELOAD_PARAMS = ("weights_iterator", "weights_path", "is_checkpoint_format")


class WorkerError(Exception):
    """A worker method raised: ``str`` is the exception's message, as vLLM reports it."""


def _names(names: Sequence[str]) -> str:
    """Python's "missing N required arguments" list: 'a', 'a' and 'b', 'a', 'b', and 'c'."""
    q = [f"'{n}'" for n in names]
    return q[0] if len(q) == 1 else (" and ".join(q) if len(q) == 2 else ", ".join(q[:-1]) + ", and " + q[-1])


def _missing(names: Sequence[str], kind: str) -> str:
    s = "" if len(names) == 1 else "s"
    return f"missing {len(names)} required {kind} argument{s}: {_names(names)}"


class SimWorker:
    """The one worker of a simulated engine (its TP x PP ranks act as one). ``rpc_<name>`` are the
    methods ``collective_rpc`` can call by name (arguments as the HTTP body gave them)."""

    def __init__(self, config: SimConfig, initial_digest: str | None = None) -> None:
        self.config = config
        self.transfer = config.transfer_config()
        self.initial_source = config.model_path or config.model_name
        self.initial_digest = initial_digest
        self.digest = initial_digest
        self.model_path = self.initial_source
        """What a ``reload_weights`` without ``weights_path`` reads: vLLM sets it to every path asked."""
        self.detached = False
        self.update_active = False
        self.transfer_group: dict[str, Any] | None = None
        """What ``init_weight_transfer_engine`` gave (``rl_launch_gloo``), None before."""
        self._received: str | None = None

    # -- what the engine shows of its weights ------------------------------------------------------
    def checksums(self) -> dict[str, str]:
        """Per-parameter checksums; raises ``WorkerError`` while detached, as vLLM's do."""
        if self.detached:
            raise WorkerError(META_TENSOR)
        base = f"{self.config.model_name}/{self.config.weights_tag}" if self.digest is None else self.digest
        return {p: hashlib.sha256(f"{base}/{p}".encode()).hexdigest()[:16] for p in SIM_PARAMETERS}

    @property
    def output_salt(self) -> int | None:
        """Mixed into the token choice once the weights come from a checkpoint, so output changes with
        the weights; ``None`` (the default output) for the built-in weights."""
        return None if self.digest is None else int(self.digest[:16], 16)

    @property
    def _nccl(self) -> bool:
        """The backend takes NCCL's init and update fields (``rl_launch_gloo`` takes the same)."""
        return self.transfer is not None and self.transfer["backend"] in ("nccl", GLOO)

    @property
    def _gloo(self) -> bool:
        return self.transfer is not None and self.transfer["backend"] == GLOO

    @property
    def _engine_class(self) -> str:
        return "NCCLWeightTransferEngine" if self._nccl else "WeightTransferEngine"

    # -- collective_rpc ----------------------------------------------------------------------------
    async def call(self, method: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """Run one worker method by name, as ``collective_rpc`` does; raises ``WorkerError``."""
        if not isinstance(method, str):
            raise WorkerError("the first argument must be callable")
        handler = getattr(self, "rpc_" + method, None)
        if handler is None:
            raise WorkerError(f"'{WORKER_CLASS}' object has no attribute '{method}'")
        return await handler(list(args), dict(kwargs))

    async def rpc_check_health(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        return None

    async def rpc_compute_weight_checksums(self, args: list[Any], kwargs: dict[str, Any]) -> dict[str, str]:
        return self.checksums()

    async def rpc_rl_launch_weight_checksums(self, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The launcher's worker extension (``launcher.engines.vllm.worker_ext``), which every vLLM engine
        the launcher starts has: the same table as ``/weight_checker`` here, whose weights are one digest
        with no CPU kernel holding a copy of its own (``kernels``: 0)."""
        return {"checksums": self.checksums(), "kernels": 0}

    async def rpc_reload_weights(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        where = "GPUModelRunner.reload_weights()"
        if len(args) > len(RELOAD_PARAMS):
            raise WorkerError(
                f"{where} takes from 1 to {len(RELOAD_PARAMS) + 1} positional arguments "
                f"but {len(args) + 1} were given"
            )
        params = dict(zip(RELOAD_PARAMS, args, strict=False))
        for key, value in kwargs.items():
            if key not in RELOAD_PARAMS:
                raise WorkerError(f"{where} got an unexpected keyword argument '{key}'")
            if key in params:
                raise WorkerError(f"{where} got multiple values for argument '{key}'")
            params[key] = value
        path = params.get("weights_path")
        await self.reload_weights(None if path is None else str(path), params.get("weights_iterator"))

    async def reload_weights(self, weights_path: str | None = None, weights_iterator: Any = None) -> None:
        """vLLM's in-place reload: detach, read the checkpoint (then the load delay), re-attach."""
        source = self.model_path if weights_path is None else weights_path
        self.model_path = source  # vLLM sets model_config.model before it reads anything
        self.detached = True
        if weights_iterator is not None:
            raise WorkerError("the simulator loads weights from a weights_path, not from a weights_iterator")
        if source == self.initial_source and self.initial_digest is None:
            digest = None  # the engine's built-in weights (its model is no directory)
        else:
            try:
                digest = await asyncio.to_thread(read_checkpoint, source)
            except (CheckpointError, OSError) as e:
                raise WorkerError(str(e)) from None
        if self.config.reload_delay_s > 0:
            await asyncio.sleep(self.config.scaled(self.config.reload_delay_s))
        self.digest = digest
        self.detached = False

    # -- the weight-transfer engine (vLLM's NCCL backend on a CPU build) ---------------------------
    def _check_transfer(self) -> None:
        if self.transfer is None:
            raise WorkerError(NOT_CONFIGURED)

    async def rpc_init_weight_transfer_engine(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        init_info = kwargs.get("init_info", args[0] if args else None)
        self._check_transfer()
        if self._nccl and isinstance(init_info, dict):
            self._parse_nccl_init(init_info)
        if self._gloo and isinstance(init_info, dict):
            self.transfer_group = dict(init_info)
            return
        raise WorkerError(NO_ACCELERATOR)

    def _parse_nccl_init(self, info: dict[str, Any]) -> None:
        prefix = f"Invalid init_info for {self._engine_class}: {NCCL_INIT_INFO}.__init__() "
        for key in info:
            if key not in NCCL_INIT_REQUIRED + NCCL_INIT_OPTIONAL:
                raise WorkerError(f"{prefix}got an unexpected keyword argument '{key}'")
        missing = [k for k in NCCL_INIT_REQUIRED if k not in info]
        if missing:
            raise WorkerError(prefix + _missing(missing, "keyword-only"))
        uid = bool(info.get("nccl_unique_id_b64"))
        addr, port = info.get("master_address"), info.get("master_port")
        if uid and (addr is not None or port is not None):
            raise WorkerError(
                f"{NCCL_INIT_INFO}: pass nccl_unique_id_b64 OR master_address/master_port, not both"
            )
        if not uid and (addr is None or port is None):
            raise WorkerError(
                f"{NCCL_INIT_INFO}: need nccl_unique_id_b64, or both master_address and master_port "
                f"(got master_address={addr!r}, master_port={port!r})"
            )

    async def rpc_shutdown_weight_transfer_engine(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        if self.update_active:
            raise WorkerError("Cannot release a trainer connection during a weight update")

    async def rpc_start_weight_update(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        await self._start(draft=False)

    async def rpc_start_draft_weight_update(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        await self._start(draft=True)

    async def _start(self, draft: bool) -> None:
        self._check_transfer()
        if self.update_active:
            raise WorkerError(
                "start_weight_update called while a weight update is already active. "
                "Call finish_weight_update first."
            )
        if draft:
            raise WorkerError("Draft model weight update requested, but no draft model is configured.")
        self.detached = True  # initialize_layerwise_reload: every layer onto the meta device
        self.update_active = True

    async def rpc_update_weights(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        update_info = kwargs.get("update_info", args[0] if args else None)
        self._check_transfer()
        if not self.update_active:
            raise WorkerError("start_weight_update must be called before update_weights.")
        self.update_active = False  # any failure below ends the update; the model stays detached
        if isinstance(update_info, list):
            if not update_info:
                raise WorkerError("list index out of range")
            update_info = update_info[0]  # this engine's rank: data_parallel_index 0, rank 0
        if not isinstance(update_info, dict):
            raise WorkerError(f"Invalid update_info for {self._engine_class}: argument must be a mapping")
        if not self._nccl:
            raise WorkerError(NO_ACCELERATOR)
        self._parse_nccl_update(update_info)
        if self._gloo and self.transfer_group is not None:
            round_ = json.dumps(update_info, sort_keys=True).encode()
            self._received = hashlib.sha256(b"streamed/" + round_).hexdigest()
            self.update_active = True  # the round arrived: finish_weight_update ends the update
            return
        raise WorkerError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")

    def _parse_nccl_update(self, info: dict[str, Any]) -> None:
        prefix = f"Invalid update_info for {self._engine_class}: NCCLWeightTransferUpdateInfo.__init__() "
        for key in info:
            if key not in NCCL_UPDATE_FIELDS:
                raise WorkerError(f"{prefix}got an unexpected keyword argument '{key}'")
        missing = [k for k in NCCL_UPDATE_FIELDS if k not in info]
        if missing:
            raise WorkerError(prefix + _missing(missing, "positional"))
        n = len(info["names"])
        for field in ("dtype_names", "shapes"):
            if len(info[field]) != n:
                raise WorkerError(
                    f"`{field}` should be of the same size as `names`: got {len(info[field])} and {n}"
                )

    async def rpc_finish_weight_update(self, args: list[Any], kwargs: dict[str, Any]) -> None:
        self._check_transfer()
        if not self.update_active:
            raise WorkerError("finish_weight_update called without a matching start_weight_update.")
        # finalize_layerwise_reload: with no round received (none can arrive over NCCL on a CPU engine)
        # every layer gets its old tensors back: the weights are unchanged; a round received
        # (rl_launch_gloo) is the weights now.
        self.update_active = False
        self.detached = False
        if self._received is not None:
            self.digest, self._received = self._received, None
