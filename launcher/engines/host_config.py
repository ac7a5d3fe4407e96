"""``EngineHostConfig``: what the driver tells one node's engine host (``launcher.engines.host``), as JSON
in the job directory. One module owns the shape: the driver writes it, the host and Ray Serve's replicas
(``launcher.gateways.ray_serve``) read it, and each engine kind's ``build`` reads its own fields.

Kept apart from the host (which reads the job directory, and with it the spec) so that the engine kinds,
which the spec is built from, can take it without a cycle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.jobdir.atomic import write_json_atomic
from router.adapters.plan import RUNTIME_LORA_ENV, LoraPlan


@dataclass
class EngineHostConfig:
    kind: str
    """The engine kind (``launcher.engines.kinds.ENGINE_KINDS``)."""
    count: int
    host: str
    model: str
    served_name: str | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpus: list[str] | None = None  # None: take CUDA_VISIBLE_DEVICES of the step (may be empty)
    extra_args: list[str] = field(default_factory=list)
    """The engine's own command-line arguments (``generation.vllm_args``)."""
    sim_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_timeout_s: float = 900.0
    log_dir: str = "."
    job_dir: str = "."
    api_key_file: str | None = None
    vllm_python: str | None = None
    node_index: int = 0
    dynamo: dict[str, Any] = field(default_factory=dict)
    """Dynamo workers: ``DynamoPlanes`` as a dict (discovery, request plane, runtime env)."""
    dynamo_python: str | None = None
    dynamo_worker_args: list[str] = field(default_factory=list)
    lora: dict[str, Any] | None = None
    """``generation.lora`` (``LoraPlan`` as a dict: the file is JSON), a field of every engine kind's
    generation like the parallel sizes; a kind that serves adapters reads it through ``lora_command``."""
    options: dict[str, Any] = field(default_factory=dict)
    """Values of an engine kind that no field above carries (JSON-able; its ``host_fields`` puts them
    here and its ``build`` reads them): a new kind adds nothing to this class."""

    def lora_command(self) -> tuple[list[str], dict[str, str]]:
        """The engine flags and environment of the LoRA plan (none without one): its flags go before the
        user's own arguments, and the environment mounts vLLM's runtime adapter routes."""
        if self.lora is None:
            return [], {}
        return LoraPlan.model_validate(self.lora).engine_flags(), dict(RUNTIME_LORA_ENV)

    @classmethod
    def load(cls, path: str | Path) -> EngineHostConfig:
        return cls(**json.loads(Path(path).read_text()))

    def dump(self, path: str | Path) -> None:
        write_json_atomic(Path(path), self.__dict__)
