"""``JobSpec``: the whole spec as written, and its resolution into ``ResolvedSpec``.

Its cross-field rules (each issue names the field to change) are ``launcher.spec.rules``; ``JobSpec.check``
runs them and ``resolved`` refuses a spec they find issues in before resolving it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator

from launcher.engines.kinds import engine_kind, engine_settings
from launcher.gateways.kinds import DEFAULT_GATEWAY_KIND, GATEWAY_KINDS
from launcher.slurm.time import format_time, parse_time, time_minutes
from launcher.spec.errors import Issue, SpecError
from launcher.spec.resolved import (
    ResolvedConsumer,
    ResolvedElastic,
    ResolvedFleet,
    ResolvedGeneration,
    ResolvedGym,
    ResolvedRecord,
    ResolvedSlurm,
    ResolvedSpec,
    ResolvedTraining,
)
from launcher.spec.rules import role_resources, semantic_issues
from launcher.spec.schema import (
    DEFAULT_JOB_ROOT,
    FleetSection,
    GenerationSection,
    GymSection,
    RecordSection,
    RouterSection,
    SlurmSection,
    TrainingSection,
)
from launcher.spec.section import Section
from router.adapters.plan import LoraPlan

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class JobSpec(Section):
    """The job spec as written (defaults not yet derived). Use ``resolved()`` for a runnable view."""

    name: str = Field(description="job name, e.g. grpo-qwen3-8b ([A-Za-z0-9._-], at most 64 characters)")
    cluster: Literal["slurm", "local"] = "slurm"
    job_root: str = DEFAULT_JOB_ROOT
    slurm: SlurmSection = Field(default_factory=SlurmSection)
    training: TrainingSection | None = None
    generation: GenerationSection = Field(default_factory=GenerationSection)
    router: RouterSection = Field(default_factory=GATEWAY_KINDS[DEFAULT_GATEWAY_KIND].section)
    gym: GymSection = Field(default_factory=GymSection)
    fleet: FleetSection | None = Field(
        default=None, description="makes this a standing fleet (rl-launch fleet up): generation only"
    )
    record: RecordSection = Field(default_factory=RecordSection)

    _source: Path | None = PrivateAttr(default=None)
    _warnings: tuple[Issue, ...] = PrivateAttr(default=())

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError(
                f"{v!r} must be 1-64 characters of letters, digits, '.', '_' or '-', starting with a letter "
                "or digit (it names the Slurm job and the job directory)"
            )
        return v

    @field_validator("job_root")
    @classmethod
    def _job_root(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("is empty; give a directory (default ~/rl-launch/jobs)")
        if any(ch.isspace() for ch in v):
            raise ValueError(f"{v!r} contains whitespace, which Slurm's #SBATCH --output cannot take")
        return v

    @property
    def source(self) -> Path | None:
        """The file this spec was loaded from (absolute), if any."""
        return self._source

    @property
    def warnings(self) -> tuple[Issue, ...]:
        """What ``load_spec`` found that may be right where the job runs (``Issue.warning``)."""
        return self._warnings

    def check(self) -> list[Issue]:
        """Cross-field rules that a single field cannot express."""
        return semantic_issues(self)

    def resolved(self) -> ResolvedSpec:
        """Every default filled and every rule checked; raises ``SpecError`` if the spec cannot run."""
        issues = self.check()
        if issues:
            raise SpecError(str(self._source) if self._source else "<spec>", issues)
        return resolve(self)


def resolve(spec: JobSpec) -> ResolvedSpec:
    if spec.generation.fleet is not None:
        return _resolve_attached(spec)
    gen = spec.generation
    training = spec.training or TrainingSection.model_construct(nodes=0, command="", env={}, slurm=None)
    footprint = gen.tensor_parallel_size * gen.pipeline_parallel_size
    served = gen.served_model_name or gen.model or engine_kind(gen.engine).default_served_name
    job_root = os.path.abspath(os.path.expanduser(spec.job_root))
    slurm: ResolvedSlurm | None = None
    train_res = gen_res = None
    if spec.cluster == "slurm":
        train_res = role_resources(spec, training.slurm)
        gen_res = role_resources(spec, gen.slurm)
        assert spec.slurm.time is not None  # checked in semantic_issues
        seconds = parse_time(spec.slurm.time)
        slurm = ResolvedSlurm(
            account=spec.slurm.account,
            time=format_time(seconds),
            time_min=time_minutes(seconds),
            container=spec.slurm.container,
            layout="single" if train_res == gen_res or training.nodes == 0 else "hetjob",
        )
        gpus = gen_res.gpus_per_node
        if gen.engines_per_node is not None:
            per_node = gen.engines_per_node
        elif gpus > 0:
            per_node = gpus // footprint
        else:  # CPU nodes (sim, or vllm with allow_cpu): one engine unless told otherwise
            per_node = 1
        total_nodes = training.nodes + gen.nodes
    else:
        per_node = gen.engines_per_node or 1
        total_nodes = 1
        gpus = 0
    kind_settings = {name: getattr(gen, name) for model in engine_settings() for name in model.model_fields}
    return ResolvedSpec(
        name=spec.name,
        cluster=spec.cluster,
        spec_path=str(spec.source) if spec.source else None,
        job_root=job_root,
        total_nodes=total_nodes,
        slurm=slurm,
        training=ResolvedTraining(
            nodes=training.nodes, command=training.command, env=training.env, resources=train_res
        ),
        generation=ResolvedGeneration(
            nodes=gen.nodes,
            engine=gen.engine,
            model=gen.model,
            served_model_name=served,
            tensor_parallel_size=gen.tensor_parallel_size,
            pipeline_parallel_size=gen.pipeline_parallel_size,
            gpus_per_engine=footprint if gpus > 0 else 0,
            engines_per_node=per_node,
            num_engines=0 if gen.owner == "trainer" else per_node * gen.nodes,
            owner=gen.owner,
            startup_timeout_s=gen.startup_timeout_s,
            restarts_per_engine=gen.restarts_per_engine,
            restarts_per_run=gen.restarts_per_run,
            env=gen.env,
            resources=gen_res,
            fleet_wait_s=gen.fleet_wait_s,
            drain_timeout_s=gen.drain_timeout_s,
            elastic=_resolve_elastic(gen),
            lora=LoraPlan(**gen.lora.model_dump()) if gen.lora is not None else None,  # the router's type
            **kind_settings,
        ),
        router=spec.router,
        gym=ResolvedGym(overlay=spec.gym.overlay, model_name=spec.gym.model_name or served),
        fleet=_resolve_fleet(spec.fleet, per_node * gen.nodes, gen) if spec.fleet is not None else None,
        record=_resolve_record(spec.record),
    )


def _resolve_record(section: RecordSection) -> ResolvedRecord:
    return ResolvedRecord(
        enabled=section.enabled,
        max_bytes=int(section.max_mb * (1 << 20)),
        keep_files=section.keep_files,
        text=section.text,
    )


def _max_num_seqs(gen: GenerationSection) -> int:
    """What one engine of the spec runs at once (its kind reads ``max_num_seqs`` from its own settings)."""
    kind = engine_kind(gen.engine)
    return int(kind.max_num_seqs({"vllm_args": list(getattr(gen, "vllm_args", []) or []), "sim": gen.sim}))


def _resolve_elastic(gen: GenerationSection) -> ResolvedElastic | None:
    """The tail policy with its capacity per engine: the spec's, else the engine's batch
    (``max_num_seqs``), what one engine runs at once without queueing."""
    e = gen.elastic
    if e is None:
        return None
    per_engine = e.capacity_per_engine or _max_num_seqs(gen)
    return ResolvedElastic(
        floor_nodes=e.floor_nodes,
        shrink_below=e.shrink_below,
        for_s=e.for_s,
        grow_back=e.grow_back,
        grow_above=e.grow_above,
        capacity_per_engine=max(1, per_engine),
    )


def _resolve_fleet(section: FleetSection, engines: int, gen: GenerationSection) -> ResolvedFleet:
    """The fair share's capacity: the spec's, else every engine's batch (``max_num_seqs``) together,
    which is what the fleet can run at once without queueing inside the engines."""
    per_engine = _max_num_seqs(gen)
    return ResolvedFleet(
        capacity=section.capacity or max(1, engines * per_engine),
        default_weight=section.default_weight,
        consumers={
            name: ResolvedConsumer(weight=c.weight, admin=c.admin, adapters=tuple(c.adapters))
            for name, c in section.consumers.items()
        },
    )


def _resolve_attached(spec: JobSpec) -> ResolvedSpec:
    """A job on a standing fleet: only its training nodes are allocated; the generation fields say
    which fleet (the model name is checked against the fleet's when the job is submitted)."""
    assert spec.training is not None  # _role_issues
    gen = spec.generation
    job_root = os.path.abspath(os.path.expanduser(spec.job_root))
    served = gen.served_model_name or ""
    slurm: ResolvedSlurm | None = None
    train_res = None
    if spec.cluster == "slurm":
        train_res = role_resources(spec, spec.training.slurm)
        if spec.slurm.time is None:
            raise SpecError(
                str(spec.source) if spec.source else "<spec>",
                [Issue("slurm.time", "required with cluster: slurm (the wall time, e.g. '04:00:00')")],
            )
        seconds = parse_time(spec.slurm.time)
        slurm = ResolvedSlurm(
            account=spec.slurm.account,
            time=format_time(seconds),
            time_min=time_minutes(seconds),
            container=spec.slurm.container,
            layout="single",
        )
    kind_settings = {name: getattr(gen, name) for model in engine_settings() for name in model.model_fields}
    return ResolvedSpec(
        name=spec.name,
        cluster=spec.cluster,
        spec_path=str(spec.source) if spec.source else None,
        job_root=job_root,
        total_nodes=spec.training.nodes if spec.cluster == "slurm" else 1,
        slurm=slurm,
        training=ResolvedTraining(
            nodes=spec.training.nodes,
            command=spec.training.command,
            env=spec.training.env,
            resources=train_res,
        ),
        generation=ResolvedGeneration(
            nodes=0,
            engine=gen.engine,
            model=None,
            served_model_name=served,
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            gpus_per_engine=0,
            engines_per_node=0,
            num_engines=0,
            startup_timeout_s=gen.startup_timeout_s,
            restarts_per_engine=0,
            restarts_per_run=0,
            env={},
            resources=train_res,
            fleet=gen.fleet,
            fleet_wait_s=gen.fleet_wait_s,
            **kind_settings,
        ),
        router=spec.router,
        gym=ResolvedGym(overlay=spec.gym.overlay, model_name=spec.gym.model_name or served),
        record=_resolve_record(spec.record),
    )
