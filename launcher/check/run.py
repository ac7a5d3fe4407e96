"""``rl-launch check SPEC``: the checks in order, login node first, then one probe step per group.

Order and what stops what: without Slurm nothing else can be asked; a part of the allocation that cannot
exist or would wait for ever (no such partition, GPUs its nodes lack, a time over the partition's limit, an
account that is not the user's) gets no probe step, since Slurm would only refuse or park it again (one line
per defect, not two); a missing container runtime still lets the probes run, on the host, so the other
checks are not hidden behind it. ``cluster: local`` runs the probe here, without Slurm.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from launcher.check.outcome import Check, skip
from launcher.check.probe import launcher_identity, run_probe
from launcher.check.probe_job import (
    MODEL_ENGINES,
    PROBE_TIME_S,
    Group,
    ProbeRun,
    judge_nodes,
    judge_result,
    judge_step,
    launcher_argv,
    run_steps,
)
from launcher.check.site import (
    Need,
    NodeRow,
    check_account,
    check_container_runtime,
    check_gpus,
    check_partition,
    check_time,
    prepare_share,
    read_sinfo,
)
from launcher.engines.kinds import engine_kind
from launcher.engines.vllm.kind import VllmSettings

if TYPE_CHECKING:
    from launcher.spec import ResolvedSpec

DEFAULT_TIMEOUT_S = 240.0


def groups_of(resolved: ResolvedSpec) -> list[Group]:
    """The groups with nodes (a standing fleet has no training, a job attached to one no generation)."""
    out: list[Group] = []
    if resolved.training.nodes:
        out.append("training")
    if resolved.generation.nodes:
        out.append("generation")
    return out


def needs_of(resolved: ResolvedSpec) -> dict[str, Need]:
    """What the allocation asks Slurm for: the whole job (single layout) or each hetjob component."""
    slurm = resolved.slurm
    assert slurm is not None
    if slurm.layout == "single":
        res = resolved.generation.resources
        assert res is not None
        return {"job": Need("job", res.partition, resolved.total_nodes, res.gpus_per_node, "slurm")}
    needs = {}
    for group in groups_of(resolved):
        role = resolved.training if group == "training" else resolved.generation
        assert role.resources is not None
        r = role.resources
        needs[group] = Need(group, r.partition, role.nodes, r.gpus_per_node, f"{group}.slurm")
    return needs


def probe_config(resolved: ResolvedSpec, group: Group, share: Path | None, token: str) -> dict[str, Any]:
    """What the probe on a ``group`` node looks at (``launcher.check.probe.run_probe``)."""
    gen = resolved.generation
    config: dict[str, Any] = {"group": group, "job_root": resolved.job_root, "gpus": 0}
    if share is not None:
        config.update(share_dir=str(share), login_token=token)
    role = resolved.training if group == "training" else gen
    if role.resources is not None:
        config["gpus"] = role.resources.gpus_per_node
    if group == "generation" and not gen.trainer_owned:
        config["engine_env"] = dict(gen.env)
        config["vllm"] = VllmSettings in engine_kind(gen.engine).settings
        if gen.model and gen.engine in MODEL_ENGINES:
            config["model"] = gen.model
    driver_group: Group = "training" if resolved.training.nodes else "generation"
    # the router runs in the driver's step, on the first node of this group (a standing fleet's serves an
    # attached job)
    if group == driver_group and resolved.role != "attached":
        config["port_range"] = list(resolved.router.port_range)
    return config


def check_local(resolved: ResolvedSpec) -> list[Check]:
    """``cluster: local``: the same looks, on this machine, without Slurm; the job root only needs to be
    writable (nothing else has to see it)."""
    share, _, writable = prepare_share(resolved.job_root)
    if share is not None:
        shutil.rmtree(share, ignore_errors=True)
    config: dict[str, Any] = {"group": "local", "gpus": 0}
    if resolved.generation.nodes:  # a job attached to a standing fleet starts no engines of its own
        config = probe_config(resolved, "generation", None, "")
    config.pop("port_range", None)
    if resolved.role != "attached":  # the standing fleet's router serves an attached job
        config["port_range"] = list(resolved.router.port_range)
    config["bind_host"] = "127.0.0.1"
    return [writable, *judge_result("local", config, run_probe(config))]


def allocation_checks(resolved: ResolvedSpec, rows: list[NodeRow]) -> tuple[list[Check], set[str]]:
    """Whether the allocation can exist, from ``sinfo``'s rows: per part of it (``needs_of``) the partition,
    the nodes with their GPUs and the time limit; and the parts that cannot (``job``, ``training``,
    ``generation``), which get no probe step.

    A hetjob whose components share a partition needs their nodes at once: each component fitting alone
    is not enough, so the sum is checked too (with the smaller GPU count: a necessary condition)."""
    assert resolved.slurm is not None
    checks: list[Check] = []
    blocked: set[str] = set()
    needs = needs_of(resolved)
    for who, need in needs.items():
        mine, verdict = check_partition(rows, need)
        checks.append(verdict)
        if not verdict.failed:
            checks.append(check_gpus(mine, need))
            over = check_time(mine, need, resolved.slurm.time)
            if over is not None and not checks[-1].failed:
                checks.append(over)
        if checks[-1].failed:
            blocked.add(who)
    parts = {n.partition for n in needs.values()}
    if len(needs) > 1 and len(parts) == 1 and not blocked:
        first = next(iter(needs.values()))
        total = Need(
            "job",
            first.partition,
            sum(n.nodes for n in needs.values()),
            min(n.gpus for n in needs.values()),
            "slurm",
        )
        together = check_gpus(check_partition(rows, total)[0], total)
        if together.failed:  # only then: each component's own line already said ok
            checks.append(together)
            blocked.add("job")
    return checks, blocked


def check_spec(
    resolved: ResolvedSpec, *, timeout_s: float = DEFAULT_TIMEOUT_S, say: Callable[[str], None] = print
) -> list[Check]:
    """Every check for ``resolved``, in the order printed."""
    if resolved.slurm is None:
        return check_local(resolved)
    rows, reachable = read_sinfo()
    checks = [reachable]
    if rows is None:
        return checks
    allocation, blocked = allocation_checks(resolved, rows)
    checks += allocation
    if resolved.slurm.account:
        checks.append(check_account(resolved.slurm.account))
        if checks[-1].failed:
            blocked.add("job")
    container = resolved.slurm.container
    pyxis = True
    if container is not None:
        checks.append(check_container_runtime(container.image))
        pyxis = not checks[-1].failed
    share, token, verdict = prepare_share(resolved.job_root)
    checks.append(verdict)
    try:
        checks += _probe_groups(resolved, blocked, share, token, pyxis, timeout_s, say)
    finally:
        if share is not None:
            shutil.rmtree(share, ignore_errors=True)
    return checks


def _probe_groups(
    resolved: ResolvedSpec,
    blocked: set[str],
    share: Path | None,
    token: str,
    pyxis: bool,
    timeout_s: float,
    say: Callable[[str], None],
) -> list[Check]:
    from launcher.slurm.request import probe_command

    steps: dict[str, Check] = {}
    runs: list[ProbeRun] = []
    configs: dict[str, dict[str, Any]] = {}
    for group in groups_of(resolved):
        if "job" in blocked or group in blocked:
            steps[group] = skip(f"{group} probe", "not started: the allocation it needs cannot exist (above)")
            continue
        name = f"rl-launch-check-{group}-{os.urandom(3).hex()}"
        argv = probe_command(
            resolved, group, job_name=name, time_s=PROBE_TIME_S, argv=launcher_argv(), container=pyxis
        )
        configs[group] = probe_config(resolved, group, share, token)
        runs.append(ProbeRun(group=group, job_name=name, argv=argv))
    if runs:
        say(f"probing {' and '.join(r.group for r in runs)} nodes (srun, at most {timeout_s:g} s)...")
        run_steps(runs, configs, timeout_s)
    on_host = not pyxis  # a container is named, and there is no pyxis to run it
    steps.update({run.group: judge_step(run, timeout_s, on_host) for run in runs})
    checks = [steps[group] for group in groups_of(resolved)]
    results = [run.result for run in runs if run.result is not None]
    checks += judge_nodes(results, resolved.job_root, launcher_identity())
    for run in runs:
        if run.result is not None:
            checks += judge_result(run.group, configs[run.group], run.result)
    return checks
