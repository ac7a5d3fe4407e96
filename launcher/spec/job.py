"""``JobSpec``: the whole spec as written, its cross-field rules (each issue names the field to change) and
its resolution into ``ResolvedSpec``.

The rules of one kind are that kind's (``FrontKind.rules``, ``EngineKind.rules``, and the settings one
engine kind owns are refused under another: ``EngineSettings.refused_elsewhere``); what is left here holds
for every kind, or relates the front to the engines by what each declares (``engine_api``, ``api``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator

from launcher.engines.kind import EngineKind, Placement
from launcher.engines.kinds import DEFAULT_ENGINE_KIND, ENGINE_KINDS, engine_kind, engine_settings
from launcher.gateways.front import FrontKind
from launcher.gateways.kinds import DEFAULT_GATEWAY_KIND, GATEWAY_KINDS, front_kind
from launcher.slurm.time import format_time, parse_time, time_minutes
from launcher.spec.errors import Issue, SpecError
from launcher.spec.resolved import (
    ResolvedConsumer,
    ResolvedElastic,
    ResolvedFleet,
    ResolvedGeneration,
    ResolvedGym,
    ResolvedRecord,
    ResolvedResources,
    ResolvedSlurm,
    ResolvedSpec,
    ResolvedTraining,
)
from launcher.spec.schema import (
    DEFAULT_JOB_ROOT,
    FleetSection,
    GenerationSection,
    GymSection,
    RecordSection,
    RoleSlurm,
    RouterSection,
    SlurmSection,
    TrainingSection,
)
from launcher.spec.section import Section
from router.adapters.plan import VLLM_LORA_RANKS, LoraPlan

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

    def check(self) -> list[Issue]:
        """Cross-field rules that a single field cannot express."""
        return semantic_issues(self)

    def resolved(self) -> ResolvedSpec:
        """Every default filled and every rule checked; raises ``SpecError`` if the spec cannot run."""
        issues = self.check()
        if issues:
            raise SpecError(str(self._source) if self._source else "<spec>", issues)
        return resolve(self)


def _role_resources(spec: JobSpec, override: RoleSlurm | None) -> ResolvedResources:
    base, o = spec.slurm, override or RoleSlurm()
    return ResolvedResources(
        partition=o.partition if o.partition is not None else base.partition,
        qos=o.qos if o.qos is not None else base.qos,
        constraint=o.constraint if o.constraint is not None else base.constraint,
        gpus_per_node=o.gpus_per_node if o.gpus_per_node is not None else base.gpus_per_node,
        gpu_request=base.gpu_request,
        cpus_per_task=o.cpus_per_task if o.cpus_per_task is not None else base.cpus_per_task,
        mem=o.mem if o.mem is not None else base.mem,
        exclusive=o.exclusive if o.exclusive is not None else base.exclusive,
        extra_sbatch=tuple(base.extra_sbatch) + tuple(o.extra_sbatch),
    )


def _gpus_field(spec: JobSpec) -> str:
    g = spec.generation.slurm
    return "generation.slurm.gpus_per_node" if g and g.gpus_per_node is not None else "slurm.gpus_per_node"


def _pairing_issues(front: FrontKind[Any], engine: EngineKind, spec: JobSpec) -> list[Issue]:
    """A front reaches only engines of its ``engine_api``: the issue blames the side that chose the
    unusual one (a front that routes only to its own kind of workers, or workers only one front reaches)."""
    if engine.api == front.engine_api:
        return []
    gen, kind = spec.generation.engine, spec.router.kind
    if front.engine_api != ENGINE_KINDS[DEFAULT_ENGINE_KIND].api:
        fits = " or ".join(f"{n} ({k.runs_on})" for n, k in ENGINE_KINDS.items() if k.api == front.engine_api)
        return [
            Issue(
                "generation.engine",
                f"is {gen!r} but router.kind is {kind!r}, which routes only to {front.routes_to}: use "
                f"{fits}, or another router.kind",
            )
        ]
    fronts = " or ".join(n for n, f in GATEWAY_KINDS.items() if f.engine_api == engine.api)
    return [
        Issue(
            "router.kind",
            f"is {kind!r} but generation.engine is {gen!r}, whose workers only {engine.reached_by} can "
            f"reach: set router.kind: {fronts}",
        )
    ]


def _foreign_settings(gen: GenerationSection, engine: EngineKind) -> list[Issue]:
    """A field another engine kind owns, set (to anything but its default) under this one: refused in its
    owner's words, or this kind's own (``EngineKind.refusals``)."""
    own = {name for model in engine.settings for name in model.model_fields}
    issues = []
    for model in engine_settings():
        for name, message in model.refused_elsewhere.items():
            field = model.model_fields[name]
            if name in own or getattr(gen, name) == field.get_default(call_default_factory=True):
                continue
            issues.append(Issue(f"generation.{name}", engine.refusals.get(name, message)))
    return issues


# What a job attached to a standing fleet takes from the fleet: set here, it would be silently ignored.
_FLEET_OWNED = (
    "nodes", "engine", "model", "tensor_parallel_size", "pipeline_parallel_size", "engines_per_node",
    "restarts_per_engine", "restarts_per_run", "env", "slurm", "lora",
)  # fmt: skip


def _role_issues(spec: JobSpec) -> list[Issue]:
    """A job has a training command; a standing fleet (``fleet:``) has none; a job attached to a fleet
    (``generation.fleet``) starts no engines and no front of its own."""
    gen = spec.generation
    if spec.fleet is not None:
        issues = []
        if spec.training is not None:
            issues.append(
                Issue(
                    "training",
                    "a standing fleet (fleet:) runs no training: remove training, or remove fleet: to run "
                    "a job with its own fleet",
                )
            )
        if gen.fleet is not None:
            issues.append(Issue("generation.fleet", "a standing fleet cannot attach to another; remove it"))
        if not front_kind(spec.router.kind).serves_consumers:
            fits = " or ".join(n for n, f in GATEWAY_KINDS.items() if f.serves_consumers)
            issues.append(
                Issue(
                    "router.kind",
                    f"is {spec.router.kind!r}, which cannot serve a standing fleet: use router.kind: {fits} "
                    "(consumer keys, their revocation and the fair share live in rl-launch's router)",
                )
            )
        return issues
    if spec.training is None:
        return [
            Issue(
                "training",
                "required: the training command (a generation-only spec has a fleet: section and starts "
                "with `rl-launch fleet up`)",
            )
        ]
    if gen.fleet is None:
        return []
    issues = []
    own = sorted(n for model in engine_settings() for n in model.model_fields)
    why = f"the standing fleet {gen.fleet!r} sets it; remove it from this job"
    for name in (*_FLEET_OWNED, *own):
        field = type(gen).model_fields[name]
        if getattr(gen, name) != field.get_default(call_default_factory=True):
            issues.append(Issue(f"generation.{name}", why))
    if "router" in spec.model_fields_set:
        issues.append(Issue("router", f"the standing fleet {gen.fleet!r} has the front; remove router:"))
    return issues


def _trainer_owned_issues(spec: JobSpec) -> list[Issue]:
    """``generation.owner: trainer``: the trainer registers its engines with rl-launch's router, which
    alone serves the registration URL; nothing of rl-launch's runs engines, so nothing may grow them."""
    gen = spec.generation
    if gen.owner != "trainer":
        return []
    issues = []
    if not front_kind(spec.router.kind).serves_registrations:
        issues.append(
            Issue(
                "router.kind",
                f"is {spec.router.kind!r}; engines the trainer owns register with rl-launch's router "
                "(its registration URL): use router.kind: builtin, or generation.owner: launcher",
            )
        )
    if spec.fleet is not None:
        issues.append(
            Issue("generation.owner", "a standing fleet starts its own engines: remove owner: trainer")
        )
    if gen.elastic is not None:
        issues.append(
            Issue(
                "generation.elastic",
                "rl-launch cannot grow or shrink engines the trainer owns: remove elastic, or use "
                "owner: launcher",
            )
        )
    return issues


def _lora_issues(spec: JobSpec) -> list[Issue]:
    """``generation.lora`` and the adapters a standing fleet reserves. The adapter table (which adapter is
    loaded where, whose it is) lives in the memory of the builtin router's one process; engines whose
    runtime adapter routes rl-launch does not start or cannot reach would serve adapters it does not know
    of; and vLLM refuses at start a plan it cannot take, which costs a queue wait to learn."""
    gen, issues = spec.generation, []
    consumers = spec.fleet.consumers if spec.fleet is not None else {}
    owner_of: dict[str, str] = {}
    for name, consumer in consumers.items():
        field = f"fleet.consumers.{name}.adapters"
        if consumer.adapters and gen.lora is None:
            issues.append(
                Issue(field, "needs generation.lora (the fleet's LoRA plan): set it, or remove the adapters")
            )
        for adapter in consumer.adapters:
            if adapter in owner_of:
                other = owner_of[adapter]
                issues.append(Issue(field, f"{adapter!r} is already reserved for {other!r}; keep it in one"))
            owner_of.setdefault(adapter, name)
    plan = gen.lora
    if plan is None:
        return issues
    if not engine_kind(gen.engine).serves_adapters:
        fits = " or ".join(n for n, k in ENGINE_KINDS.items() if k.serves_adapters)
        issues.append(
            Issue(
                "generation.lora",
                f"needs generation.engine {fits} (got {gen.engine!r}): only their engines load adapters at "
                "run time; remove lora, or change the engine",
            )
        )
    if gen.owner == "trainer":
        issues.append(
            Issue(
                "generation.lora",
                "rl-launch loads adapters into the engines it starts, and with owner: trainer it starts "
                "none: remove lora, or use owner: launcher",
            )
        )
    if not front_kind(spec.router.kind).serves_adapters:
        fits = " or ".join(n for n, f in GATEWAY_KINDS.items() if f.serves_adapters)
        issues.append(
            Issue(
                "router.kind",
                f"is {spec.router.kind!r} but generation.lora is set: the adapter table lives in rl-launch's "
                f"router; use router.kind: {fits}, or remove lora",
            )
        )
    elif getattr(spec.router, "workers", 1) != 1:
        issues.append(
            Issue(
                "router.workers",
                f"must be 1 with generation.lora (got {spec.router.workers}): the adapter table lives in the "
                "router process, which another worker would not see; remove workers, or remove lora",
            )
        )
    if plan.max_lora_rank not in VLLM_LORA_RANKS:
        issues.append(
            Issue(
                "generation.lora.max_lora_rank",
                f"must be one of vLLM's {', '.join(map(str, VLLM_LORA_RANKS))} (got {plan.max_lora_rank}): "
                "vLLM refuses another --max-lora-rank at start",
            )
        )
    if plan.batch_loras > plan.cpu_loras:
        issues.append(
            Issue(
                "generation.lora.max_loras",
                f"must be at most 2 x max_adapters = {plan.cpu_loras} (got {plan.batch_loras}): vLLM refuses "
                "--max-loras above --max-cpu-loras at start",
            )
        )
    return issues


def semantic_issues(spec: JobSpec) -> list[Issue]:
    """Rules across fields. Each issue names the field to change, so the fix is obvious."""
    gen = spec.generation
    role = _role_issues(spec)
    if role or gen.fleet is not None:
        return role
    front, engine = front_kind(spec.router.kind), engine_kind(gen.engine)
    footprint = gen.tensor_parallel_size * gen.pipeline_parallel_size
    gen_res = _role_resources(spec, gen.slurm)
    local = spec.cluster == "local"
    place = Placement(spec.cluster, 0 if local else gen_res.gpus_per_node, _gpus_field(spec))

    issues: list[Issue] = front.rules(spec.router, spec.cluster)
    issues += _trainer_owned_issues(spec)
    issues += _lora_issues(spec)
    issues += _pairing_issues(front, engine, spec)
    if gen.owner != "trainer":  # rl-launch starts none of the trainer's engines: their settings are its
        issues += _foreign_settings(gen, engine)
        issues += engine.rules(gen, place)

    if local:
        for role in ("training", "generation"):
            section = getattr(spec, role)
            nodes = section.nodes if section is not None else 1
            if nodes != 1:
                issues.append(
                    Issue(
                        f"{role}.nodes",
                        f"must be 1 with cluster: local (got {nodes}): everything runs on this machine; "
                        "use generation.engines_per_node for more engines",
                    )
                )
        return issues

    if spec.slurm.time is None:
        issues.append(
            Issue(
                "slurm.time",
                "required with cluster: slurm (the wall time, e.g. '04:00:00'); without it the partition "
                "default applies, and submitit's is 5 minutes",
            )
        )
    gpus, gpus_field = place.gpus_per_node, place.gpus_field
    if gpus > 0 and footprint > gpus:
        issues.append(
            Issue(
                "generation.tensor_parallel_size",
                f"tensor_parallel_size x pipeline_parallel_size = {gen.tensor_parallel_size} x "
                f"{gen.pipeline_parallel_size} = {footprint} GPUs per engine, more than the {gpus} GPUs of "
                f"one node ({gpus_field}); engines spanning nodes are not supported yet: lower TP/PP or "
                "use nodes with more GPUs",
            )
        )
    elif engine.uses_gpus and gpus > 0 and gen.engines_per_node is not None:
        need = gen.engines_per_node * footprint
        if need > gpus:
            issues.append(
                Issue(
                    "generation.engines_per_node",
                    f"{gen.engines_per_node} engines x {footprint} GPUs each = {need} GPUs, more than the "
                    f"{gpus} of one node ({gpus_field}); use at most {gpus // footprint} or leave it unset",
                )
            )
    return issues


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
        train_res = _role_resources(spec, training.slurm)
        gen_res = _role_resources(spec, gen.slurm)
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
        train_res = _role_resources(spec, spec.training.slurm)
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
