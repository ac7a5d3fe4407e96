"""The engine side of ``rl_launch_gloo``: a vLLM ``WeightTransferEngine`` that receives streamed weights
over gloo, so a CPU engine can take ``/init_weight_transfer_engine`` ... ``/finish_weight_update``.

Why each part (the transport, the wire and why no shipped backend runs on a CPU: ``rl_launch_gloo``):

* The init and update infos have the fields of vLLM's ``nccl`` backend (``NCCLWeightTransferInitInfo``
  with a TCP rendezvous, ``NCCLWeightTransferUpdateInfo``), so the router's rank plan
  (``/fleet/weight_transfer/init``: ``rank_offset``, ``world_size``) and its per-round fan-out
  (``/fleet/refit/update``) drive it as they drive ``nccl``. This engine's rank is computed as
  ``nccl_common.worker_init_process_group`` computes it (data-parallel index x TP x PP + the worker's
  rank + ``rank_offset``), so a TP x PP engine's workers take consecutive ranks.
* ``start_weight_update`` / ``finish_weight_update`` are the layerwise reload the ``nccl`` and ``ipc``
  engines and vLLM's own ``reload_weights`` use: the weights arrive in checkpoint format and the CPU
  build repacks each linear layer for its kernel when its layer is complete.
* ``update_weights`` is the base class's without its unconditional ``torch.accelerator.synchronize()``
  (vLLM 0.32 ``weight_transfer/base.py:502``), which raises "Cannot access accelerator device when none is
  available." on a CPU machine: gloo's broadcast has finished when ``wait()`` returns. On a device it
  still synchronizes.

Imported only inside an engine, by vLLM's factory, by name (``rl_launch_gloo.register``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

try:  # the engine's interpreter: this directory is on its PYTHONPATH
    from rl_launch_gloo import DEFAULT_TIMEOUT_S, join_group, round_sizes, unpack
except ImportError:  # imported as launcher.engines.vllm.worker_ext.rl_launch_gloo_engine
    from .rl_launch_gloo import DEFAULT_TIMEOUT_S, join_group, round_sizes, unpack


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """``nccl``'s TCP rendezvous fields: the trainer (rank 0) hosts the store at
    ``master_address:master_port``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S
    group_key: str = field(default="", repr=False)
    """The trainer's ``GlooSender.group_key``: the rendezvous keys live under it (empty: none)."""
    packed: bool = True
    """``nccl``'s wire parameters, taken so a trainer written for ``nccl`` inits unchanged (TRL 1.16 sends
    ``"packed": true``); gloo always sends a round as one packed buffer, so they change nothing."""
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be a port number, got {self.master_port!r}")
        if self.rank_offset < 1 or self.world_size <= self.rank_offset:
            raise ValueError(
                f"rank_offset {self.rank_offset} and world_size {self.world_size}: the trainer is rank 0, "
                "so an engine's offset is at least 1 and below the world size"
            )


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One round: ``nccl``'s per-round metadata; the bytes arrive as one packed buffer in ``names`` order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must be as long as each other: got {len(self.names)}, "
                f"{len(self.dtype_names)} and {len(self.shapes)}"
            )


class GlooWeightTransferEngine(
    WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]
):
    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        self._store: Any = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        if rank >= init_info.world_size:
            raise ValueError(
                f"this worker's rank {rank} is outside the group's world_size {init_info.world_size}"
            )
        self.shutdown()
        self.group, self._store = join_group(
            init_info.master_address,
            init_info.master_port,
            rank,
            init_info.world_size,
            init_info.timeout_s,
            init_info.group_key,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(
                "rl_launch_gloo weight transfer not initialized. Call init_weight_transfer_engine first."
            )
        info = {
            "names": update_info.names,
            "dtype_names": update_info.dtype_names,
            "shapes": update_info.shapes,
        }
        buffer = torch.empty(sum(round_sizes(info)), dtype=torch.uint8)
        self.group.broadcast(buffer, 0).wait()
        weights = [(name, t.to(self.device)) for name, t in unpack(buffer, info)]
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        self.group, self._store = None, None
