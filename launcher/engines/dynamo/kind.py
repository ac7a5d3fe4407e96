"""``generation.engine: dynamo-vllm`` (``python -m dynamo.vllm``, GPUs) and ``dynamo-mocker``
(``python -m dynamo.mocker``, CPU): their rules, labels and command lines (``worker.DynamoWorker``).

Their workers serve no HTTP API of their own (``api``): they register with the job's Dynamo runtime and
take requests from a Dynamo frontend, so only a front that routes over Dynamo's planes can reach them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from launcher.engines.kind import (
    EngineKind,
    GenerationFields,
    Placement,
    ResolvedGenerationFields,
)
from launcher.engines.vllm.kind import VllmSettings, parallel_label
from launcher.spec.errors import Issue

if TYPE_CHECKING:
    from launcher.engines.base import Engine
    from launcher.engines.host_config import EngineHostConfig

DYNAMO_API = "dynamo"
"""Workers registered in Dynamo's discovery, reached over its request plane (``FrontKind.engine_api``)."""
DYNAMO_PYTHON_ENV = "RL_LAUNCH_DYNAMO_PYTHON"


class DynamoWorkerKind(EngineKind):
    """What both Dynamo worker kinds share: how they are reached, their interpreter, the cache reset."""

    name: Literal["dynamo-vllm", "dynamo-mocker"]
    api = DYNAMO_API
    reached_by = "a Dynamo frontend"
    model_needed: str
    """What ``generation.model`` must be for this worker (the spec's error says it)."""

    def rules(self, gen: GenerationFields, place: Placement) -> list[Issue]:
        if not gen.model:
            what = f"required when generation.engine is {self.name!r}: {self.model_needed}"
            return [Issue("generation.model", what)]
        return []

    def host_fields(self, gen: ResolvedGenerationFields, env: Mapping[str, str]) -> dict[str, Any]:
        return {"dynamo_python": env.get(DYNAMO_PYTHON_ENV)}

    def build(self, cfg: EngineHostConfig, gpus: list[str], api_key: str | None, log_path: str) -> Engine:
        """One worker (one TP x PP group, on this node's GPUs) registering with the job's runtime."""
        from launcher.engines.base import EngineSpec
        from launcher.engines.dynamo.worker import DynamoPlanes, DynamoWorker, dynamo_python

        env = dict(cfg.env)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        spec = EngineSpec(
            model=cfg.model,
            served_name=cfg.served_name,
            host=cfg.host,
            api_key=api_key,
            tensor_parallel_size=cfg.tensor_parallel_size,
            extra_args=list(cfg.extra_args) if VllmSettings in self.settings else [],
            env=env,
            log_path=log_path,
            startup_timeout_s=cfg.startup_timeout_s,
        )
        return DynamoWorker(
            spec,
            self.name,
            DynamoPlanes(**cfg.dynamo),
            python=dynamo_python(cfg.dynamo_python),
            tensor_parallel_size=cfg.tensor_parallel_size,
            pipeline_parallel_size=cfg.pipeline_parallel_size,
            worker_args=cfg.dynamo_worker_args,
        )

    def cache_reset(self) -> tuple[str, bool]:
        """The worker's system server's ``/engine/flush_cache`` (Dynamo checks no key there)."""
        from router.fleet.engine import DYNAMO_RESET_PATH

        return DYNAMO_RESET_PATH, False


class DynamoVllmKind(DynamoWorkerKind):
    name = "dynamo-vllm"
    settings = (VllmSettings,)
    model_needed = "the Hugging Face id or local path of the model to serve"

    def rules(self, gen: GenerationFields, place: Placement) -> list[Issue]:
        issues = super().rules(gen, place)
        if place.cluster == "slurm" and place.gpus_per_node == 0:
            issues.append(
                Issue(
                    place.gpus_field,
                    "is 0 but generation.engine is 'dynamo-vllm', whose vLLM is the CUDA build: set the GPUs "
                    "per node, or use engine: dynamo-mocker for simulated Dynamo workers on CPUs",
                )
            )
        return issues

    def label(self, gen: ResolvedGenerationFields) -> str:
        return f"{gen.num_engines} dynamo-vllm workers of {gen.model} {parallel_label(gen)}"

    def host_fields(self, gen: ResolvedGenerationFields, env: Mapping[str, str]) -> dict[str, Any]:
        return {**super().host_fields(gen, env), "extra_args": list(VllmSettings.of(gen).vllm_args)}


class DynamoMockerKind(DynamoWorkerKind):
    name = "dynamo-mocker"
    refusals = {"vllm_args": "not used by the mocker; put mocker flags in router.dynamo.worker_args"}
    runs_on = "CPU"
    uses_gpus = False
    model_needed = "a local Hugging Face directory with a tokenizer (the mocker downloads nothing)"

    def label(self, gen: ResolvedGenerationFields) -> str:
        return f"{gen.num_engines} dynamo-mocker workers of {gen.model}"


DYNAMO_VLLM = DynamoVllmKind()
DYNAMO_MOCKER = DynamoMockerKind()
