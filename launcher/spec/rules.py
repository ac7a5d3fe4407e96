"""The spec's cross-field rules: each ``Issue`` names the field to change and says how.

The rules of one kind are that kind's (``FrontKind.rules``, ``EngineKind.rules``, and the settings one
engine kind owns are refused under another: ``EngineSettings.refused_elsewhere``); what is here holds for
every kind, or relates the front to the engines by what each declares (``engine_api``, ``api``), the roles
(a job, a standing fleet, a job attached to one), engines the trainer owns and the LoRA plan.
``JobSpec.check`` runs ``semantic_issues``; ``role_resources`` is shared with the resolution in
``launcher.spec.job``, which reads the same per-role Slurm resources.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from launcher.engines.kind import EngineKind, Placement
from launcher.engines.kinds import DEFAULT_ENGINE_KIND, ENGINE_KINDS, engine_kind, engine_settings
from launcher.gateways.front import FrontKind
from launcher.gateways.kinds import GATEWAY_KINDS, front_kind
from launcher.spec.errors import Issue
from launcher.spec.resolved import ResolvedResources
from launcher.spec.schema import GenerationSection, RoleSlurm
from router.adapters.plan import VLLM_LORA_RANKS

if TYPE_CHECKING:
    from launcher.spec.job import JobSpec


def role_resources(spec: JobSpec, override: RoleSlurm | None) -> ResolvedResources:
    """One role's Slurm resources: its own ``slurm:`` override over the spec's shared one (the GPU rules
    judge the generation nodes by what they will get, and the resolution allocates the same)."""
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
    gen_res = role_resources(spec, gen.slurm)
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
