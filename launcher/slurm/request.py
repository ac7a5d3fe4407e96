"""Turn a resolved job spec into the Slurm request: ``#SBATCH`` directives and submitit parameters.

Layout: one allocation, split by node index (the default)
    The job asks for ``training.nodes + generation.nodes`` identical nodes in ONE allocation. Inside it,
    the node list is expanded and sorted (natural order, as Slurm prints it: ``gpu2`` before ``gpu10``);
    the first ``training.nodes`` nodes are the training nodes, the rest the generation nodes
    (``split_nodes``). Why this is the default:

    * submitit, which submits our jobs, has no heterogeneous-job support: it writes one component;
    * most GPU clusters are homogeneous (one partition of identical 8-GPU nodes), so both roles need the
      same resources anyway, and one allocation is scheduled as one unit (no component starving while
      the other holds nodes), which is what a co-scheduled RL job needs;
    * the split is deterministic from the node list alone, so every process that reads
      ``SLURM_JOB_NODELIST`` agrees on who is who without talking to anyone.

Layout: heterogeneous job (when Slurm forces it)
    When the roles need *different* Slurm resources (per-role overrides ``training.slurm`` /
    ``generation.slurm`` that differ from ``slurm``: another partition, constraint, GPU count, memory),
    one allocation cannot express it, so the request becomes a heterogeneous job: component 0 is
    training, component 1 generation, separated by ``#SBATCH hetjob``. Each component then has its own
    node list (``SLURM_JOB_NODELIST_HET_GROUP_0`` / ``_1``). submitit cannot submit it, so
    ``SlurmRequest.submitit_parameters`` is ``None`` and the rendered sbatch script (``launcher.render``)
    is the way to submit. Job-wide options (name, log file) go in component 0; options a component
    must not inherit by accident (time, account, QOS, partition, resources) are written into every
    component explicitly rather than relying on Slurm's option propagation rules.

Containers (pyxis/enroot): the container does not wrap the batch script (the driver runs on the host of
the first node, where ``srun`` exists); it wraps the steps the driver starts with ``srun``.
``SlurmRequest.srun_args`` holds those ``--container-*`` arguments; under submitit they are the
``slurm_srun_args``.

Time strings follow sbatch's ``--time``: ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M``, ``D-H:M:S``, or
an integer number of minutes (``parse_time``). Unlimited times are refused: submitit needs a number,
and a job with no end is a job that never releases its GPUs.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from launcher.spec import ResolvedResources, ResolvedSpec

Layout = Literal["single", "hetjob"]

_TIME_FORMS = "M, M:S, H:M:S, D-H, D-H:M or D-H:M:S (e.g. 04:00:00 or 1-12:00:00)"

# sbatch options the spec sets itself: giving them again in extra_sbatch would silently fight the spec
# (or the driver's node split), so they are refused with a pointer to the spec field to use instead.
MANAGED_SBATCH_OPTIONS: dict[str, str] = {
    "nodes": "set training.nodes / generation.nodes instead",
    "ntasks": "the launcher runs one task per node; remove it",
    "ntasks-per-node": "the launcher runs one task per node; remove it",
    "cpus-per-task": "set slurm.cpus_per_task instead",
    "gpus-per-node": "set slurm.gpus_per_node instead",
    "gpus": "set slurm.gpus_per_node instead",
    "gpus-per-task": "set slurm.gpus_per_node instead",
    "partition": "set slurm.partition instead",
    "account": "set slurm.account instead",
    "qos": "set slurm.qos instead",
    "time": "set slurm.time instead",
    "constraint": "set slurm.constraint instead",
    "exclusive": "set slurm.exclusive instead",
    "mem": "set slurm.mem instead",
    "job-name": "set name instead",
    "output": "set job_root instead (the batch log goes there)",
    "error": "set job_root instead (the batch log goes there)",
    "hetjob": "set training.slurm / generation.slurm; the launcher decides when a hetjob is needed",
    "packjob": "set training.slurm / generation.slurm; the launcher decides when a hetjob is needed",
}


# --------------------------------------------------------------------------------------------------
# Time strings
# --------------------------------------------------------------------------------------------------


def parse_time(value: str | int) -> int:
    """Seconds in a Slurm ``--time`` value; ``ValueError`` saying which forms are accepted otherwise.

    An ``int`` is minutes, as sbatch reads a bare number. Fields after the first must stay below their
    unit (``1:75:00`` is refused) because an out-of-range field is far more often a typo than intent.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"must be a Slurm time string ({_TIME_FORMS}), got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"must be > 0 minutes, got {value}")
        return value * 60
    text = value.strip()
    if text.lower() in {"unlimited", "infinite", "-1"}:
        raise ValueError(f"must be a finite time ({_TIME_FORMS}); an unlimited job never frees its GPUs")
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not m:
        raise ValueError(f"{value!r} is not a Slurm time; use {_TIME_FORMS}")
    days_s, a, b, c = m.groups()
    nums = [int(x) for x in (a, b, c) if x is not None]
    if days_s is not None:
        # D-H, D-H:M, D-H:M:S
        days = int(days_s)
        hours, minutes, seconds = [*nums, 0, 0][:3]
        if hours >= 24:
            raise ValueError(f"{value!r}: hours must be < 24 after 'D-' (got {hours})")
    elif len(nums) == 1:  # M
        days, hours, minutes, seconds = 0, 0, nums[0], 0
    elif len(nums) == 2:  # M:S
        days, hours, (minutes, seconds) = 0, 0, nums
    else:  # H:M:S
        days, (hours, minutes, seconds) = 0, nums
    if len(nums) >= 2 and (minutes >= 60 and (days_s is not None or len(nums) == 3)):
        raise ValueError(f"{value!r}: minutes must be < 60 (got {minutes})")
    if len(nums) >= 2 and seconds >= 60:
        raise ValueError(f"{value!r}: seconds must be < 60 (got {seconds})")
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise ValueError(f"{value!r} is zero; give the job some time, e.g. 04:00:00")
    return total


def format_time(seconds: int) -> str:
    """``HH:MM:SS`` or ``D-HH:MM:SS``: one unambiguous spelling for directives and dry-run output."""
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    hms = f"{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{days}-{hms}" if days else hms


def time_minutes(seconds: int) -> int:
    """Whole minutes for submitit's ``timeout_min``, rounded up so the job never gets less than asked."""
    return max(1, math.ceil(seconds / 60))


# --------------------------------------------------------------------------------------------------
# Extra sbatch options
# --------------------------------------------------------------------------------------------------


def parse_sbatch_option(option: str) -> tuple[str, str | bool]:
    """Split one ``extra_sbatch`` entry into (long name, value or ``True`` for a bare flag).

    Accepted: ``--name``, ``--name=value``, ``--name value``. Short options are refused because the
    submitit path needs the long name (``slurm_additional_parameters`` is keyed by it), and both paths
    (script and submitit) must ask Slurm for the same thing.
    """
    if not isinstance(option, str):
        raise ValueError(f"must be a string like '--mail-type=END', got {option!r}")
    text = option.strip()
    if "\n" in text or "\r" in text:
        raise ValueError(f"{option!r} spans lines; give one option per list entry")
    if text.startswith("#SBATCH"):
        raise ValueError(f"{option!r}: give the option only, without '#SBATCH' (e.g. '--mail-type=END')")
    m = re.fullmatch(r"--([A-Za-z][A-Za-z0-9_-]*)(?:(?:=|\s+)(\S.*))?", text)
    if not m:
        raise ValueError(
            f"{option!r} is not a long sbatch option; use '--name=value' or '--name' "
            "(short forms like '-C x' are not accepted)"
        )
    name, value = m.group(1).replace("_", "-"), m.group(2)
    return name, (value.strip() if value is not None else True)


def check_sbatch_option(option: str) -> str:
    """Validate an ``extra_sbatch`` entry (form, and not an option the spec manages); return it."""
    name, value = parse_sbatch_option(option)
    if name in MANAGED_SBATCH_OPTIONS:
        raise ValueError(f"'--{name}' is set by the launcher: {MANAGED_SBATCH_OPTIONS[name]}")
    if name == "gres" and isinstance(value, str) and value.startswith("gpu"):
        raise ValueError(
            "'--gres=gpu...' is set by the launcher; use slurm.gpus_per_node with slurm.gpu_request: gres"
        )
    return option.strip()


# --------------------------------------------------------------------------------------------------
# The request
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlurmComponent:
    """One job component: ``role`` ``"all"`` for the single allocation, else ``"training"`` or
    ``"generation"`` (hetjob components 0 and 1)."""

    role: Literal["all", "training", "generation"]
    nodes: int
    directives: tuple[str, ...]
    """Complete ``#SBATCH ...`` lines, in the order written to the script."""


@dataclass(frozen=True)
class SlurmRequest:
    """What to ask Slurm for. ``directive_lines`` is the script header; ``submitit_parameters`` the
    ``AutoExecutor.update_parameters(**...)`` equivalent (single allocation only, ``None`` for a hetjob)."""

    layout: Layout
    components: tuple[SlurmComponent, ...]
    submitit_parameters: dict[str, Any] | None
    srun_args: tuple[str, ...] = ()
    """pyxis ``--container-*`` arguments for every ``srun`` step the driver starts (empty: no container)."""
    log_pattern: str = ""
    """Where Slurm writes the batch script's output (``%j`` = job id); its directory must exist."""

    @property
    def directive_lines(self) -> list[str]:
        """Every ``#SBATCH`` line, components separated by ``#SBATCH hetjob``."""
        lines: list[str] = []
        for i, component in enumerate(self.components):
            if i:
                lines.append("#SBATCH hetjob")
            lines.extend(component.directives)
        return lines

    @property
    def total_nodes(self) -> int:
        return sum(c.nodes for c in self.components)


def _resource_directives(res: ResolvedResources, nodes: int) -> list[str]:
    """Directives for one component's resources (everything that may differ between roles)."""
    out = [f"--nodes={nodes}", "--ntasks-per-node=1"]
    if res.cpus_per_task is not None:
        out.append(f"--cpus-per-task={res.cpus_per_task}")
    if res.gpus_per_node:
        if res.gpu_request == "gres":
            out.append(f"--gres=gpu:{res.gpus_per_node}")
        else:
            out.append(f"--gpus-per-node={res.gpus_per_node}")
    if res.mem is not None:
        out.append(f"--mem={res.mem}")
    if res.partition:
        out.append(f"--partition={res.partition}")
    if res.qos:
        out.append(f"--qos={res.qos}")
    if res.constraint:
        out.append(f"--constraint={res.constraint}")
    if res.exclusive:
        out.append("--exclusive")
    return out


def _sbatch(options: Iterable[str]) -> tuple[str, ...]:
    return tuple(f"#SBATCH {opt}" for opt in options)


def log_pattern(resolved: ResolvedSpec) -> str:
    """The batch output file: next to the job directories, since ``--output``'s directory must exist
    when the job starts and the job directory is only created by the script itself."""
    return f"{resolved.job_root}/{resolved.name}-%j.out"


def container_srun_args(resolved: ResolvedSpec) -> tuple[str, ...]:
    """pyxis arguments for the driver's ``srun`` steps (see the module docstring)."""
    slurm = resolved.slurm
    if slurm is None or slurm.container is None:
        return ()
    c = slurm.container
    args = [f"--container-image={c.image}"]
    if c.mounts:
        args.append(f"--container-mounts={','.join(c.mounts)}")
    if c.workdir:
        args.append(f"--container-workdir={c.workdir}")
    return tuple(args)


def build_request(resolved: ResolvedSpec) -> SlurmRequest:
    """The Slurm request of a resolved ``cluster: slurm`` spec (``ValueError`` for ``cluster: local``)."""
    slurm = resolved.slurm
    if slurm is None:
        raise ValueError("cluster is 'local': there is no Slurm request (the driver runs on this machine)")
    train_res = resolved.training.resources
    gen_res = resolved.generation.resources
    assert train_res is not None and gen_res is not None  # set whenever slurm is
    log = log_pattern(resolved)
    job_wide = [f"--job-name={resolved.name}", f"--output={log}", "--open-mode=append"]
    shared = [f"--time={slurm.time}"] + ([f"--account={slurm.account}"] if slurm.account else [])
    srun_args = container_srun_args(resolved)

    if slurm.layout == "single":
        nodes = resolved.training.nodes + resolved.generation.nodes
        options = job_wide + shared + _resource_directives(gen_res, nodes) + list(gen_res.extra_sbatch)
        component = SlurmComponent("all", nodes, _sbatch(options))
        return SlurmRequest(
            layout="single",
            components=(component,),
            submitit_parameters=submitit_parameters(resolved, nodes, gen_res, srun_args),
            srun_args=srun_args,
            log_pattern=log,
        )

    training = SlurmComponent(
        "training",
        resolved.training.nodes,
        _sbatch(
            job_wide
            + shared
            + _resource_directives(train_res, resolved.training.nodes)
            + list(train_res.extra_sbatch)
        ),
    )
    generation = SlurmComponent(
        "generation",
        resolved.generation.nodes,
        _sbatch(
            shared + _resource_directives(gen_res, resolved.generation.nodes) + list(gen_res.extra_sbatch)
        ),
    )
    return SlurmRequest(
        layout="hetjob",
        components=(training, generation),
        submitit_parameters=None,
        srun_args=srun_args,
        log_pattern=log,
    )


def submitit_parameters(
    resolved: ResolvedSpec, nodes: int, res: ResolvedResources, srun_args: Sequence[str]
) -> dict[str, Any]:
    """``submitit.AutoExecutor.update_parameters`` keywords for the single allocation.

    Generic names where submitit has them (``nodes``, ``timeout_min``...), ``slurm_``-prefixed ones
    otherwise; extras become ``slurm_additional_parameters`` (submitit writes each as ``--key=value``).
    The job name and output paths are left to the caller: submitit owns its folder layout.
    """
    slurm = resolved.slurm
    assert slurm is not None
    params: dict[str, Any] = {
        "name": resolved.name,
        "nodes": nodes,
        "tasks_per_node": 1,
        "timeout_min": slurm.time_min,
    }
    if res.cpus_per_task is not None:
        params["cpus_per_task"] = res.cpus_per_task
    if res.gpus_per_node:
        if res.gpu_request == "gres":
            params["slurm_gres"] = f"gpu:{res.gpus_per_node}"
        else:
            params["gpus_per_node"] = res.gpus_per_node
    for key, value in (
        ("slurm_partition", res.partition),
        ("slurm_account", slurm.account),
        ("slurm_qos", res.qos),
        ("slurm_constraint", res.constraint),
        ("slurm_mem", res.mem),
    ):
        if value is not None:
            params[key] = value
    if res.exclusive:
        params["slurm_exclusive"] = True
    additional = dict(parse_sbatch_option(opt) for opt in res.extra_sbatch)
    if additional:
        params["slurm_additional_parameters"] = additional
    if srun_args:
        params["slurm_srun_args"] = list(srun_args)
    return params


# --------------------------------------------------------------------------------------------------
# Splitting the allocation
# --------------------------------------------------------------------------------------------------


def natural_key(host: str) -> tuple[tuple[int, int, str], ...]:
    """Sort key that orders ``gpu2`` before ``gpu10``, as Slurm's node lists do."""
    return tuple(
        (1, int(part), "") if part.isdigit() else (0, 0, part) for part in re.split(r"(\d+)", host) if part
    )


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {text!r}")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_one(pattern: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", pattern)
    if not m:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end() :]
    values: list[str] = []
    for item in m.group(1).split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r} in host list pattern {pattern!r}")
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in host list pattern {pattern!r}")
        values.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return [h for v in values for h in _expand_one(head + v + tail)]


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a Slurm host list (``gpu[01-03,07],cpu5``) without calling ``scontrol``.

    Pure Python so the split is testable anywhere and costs no process per node; zero padding follows
    the range's lower bound, as Slurm's does.
    """
    return [host for part in _split_top_level(nodelist) for host in _expand_one(part)]


@dataclass(frozen=True)
class NodeSplit:
    """Which hosts are training and which generation, in natural order."""

    training: tuple[str, ...]
    generation: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return self.training + self.generation


def split_nodes(resolved: ResolvedSpec, env: Mapping[str, str] | None = None) -> NodeSplit:
    """Split the running allocation into training and generation hosts.

    Single allocation: the first ``training.nodes`` of the sorted ``SLURM_JOB_NODELIST`` are training,
    the rest generation. Hetjob: component 0 (``SLURM_JOB_NODELIST_HET_GROUP_0``) is training,
    component 1 generation. ``cluster: local``: both roles are ``localhost``. A node count that does not
    match the spec raises ``ValueError`` (a resized or mismatched allocation must not be half-used).
    """
    if resolved.slurm is None:
        return NodeSplit(("localhost",), ("localhost",))
    env = os.environ if env is None else env
    want_t, want_g = resolved.training.nodes, resolved.generation.nodes

    def hosts(var: str) -> list[str]:
        value = env.get(var)
        if not value:
            raise ValueError(f"${var} is not set: split_nodes must run inside the job's allocation")
        return sorted(expand_hostlist(value), key=natural_key)

    if resolved.slurm.layout == "single":
        nodes = hosts("SLURM_JOB_NODELIST")
        if len(nodes) != want_t + want_g:
            raise ValueError(
                f"the allocation has {len(nodes)} nodes but the spec asks for {want_t} training + "
                f"{want_g} generation = {want_t + want_g}"
            )
        return NodeSplit(tuple(nodes[:want_t]), tuple(nodes[want_t:]))
    training, generation = hosts("SLURM_JOB_NODELIST_HET_GROUP_0"), hosts("SLURM_JOB_NODELIST_HET_GROUP_1")
    if len(training) != want_t or len(generation) != want_g:
        raise ValueError(
            f"hetjob components have {len(training)} + {len(generation)} nodes but the spec asks for "
            f"{want_t} training + {want_g} generation"
        )
    return NodeSplit(tuple(training), tuple(generation))
