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
    ``SlurmRequest.submitit_parameters`` is ``None`` and the rendered sbatch script
    (``launcher.submit.render``) is the way to submit. Job-wide options (name, log file) go in
    component 0; options a component must not inherit by accident (time, account, QOS, partition,
    resources) are written into every component explicitly rather than relying on Slurm's option
    propagation rules.

Containers (pyxis/enroot) and the time-limit warning: ``launcher.slurm.srun`` (the batch shell ``exec``s
the driver, in a container step when the spec has one; every step carries the ``--container-*``
arguments; ``--signal=B:USR2@N`` warns the driver alone). Both submit paths use the same launch line:
the rendered script writes it, and under submitit it is the ``slurm_setup`` line (``submitit_setup``),
which ``exec``s before submitit's own command line is reached.

Time strings: ``launcher.slurm.time``; ``extra_sbatch`` syntax: ``launcher.slurm.options``; the node
split: ``launcher.slurm.nodes``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from launcher.slurm.options import parse_sbatch_option
from launcher.slurm.srun import container_args, driver_launch_line, signal_option
from launcher.slurm.time import format_time, parse_time

if TYPE_CHECKING:
    from launcher.spec import ResolvedResources, ResolvedSpec

Layout = Literal["single", "hetjob"]

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
    """pyxis ``--container-*`` arguments of every ``srun`` step, the driver's included (empty: no
    container)."""
    signal: str = ""
    """``--signal`` value (``B:USR2@N``): the time-limit warning, to the batch shell (the driver) only."""

    def driver_line(self, command: str) -> str:
        """The batch script's command line: ``exec`` of ``command`` (shell text), in a container step
        when there is a container (``launcher.slurm.srun.driver_launch_line``)."""
        return driver_launch_line(self.srun_args, command)

    def submitit_setup(self, submitit_command: str) -> list[str]:
        """``slurm_setup`` lines for submitit: the driver line around submitit's own command, so that the
        batch shell becomes the driver (or its ``srun``) and receives the ``B:`` warning signal."""
        # submitit exports this just before its own command line, which the exec never reaches
        return ["export SUBMITIT_EXECUTOR=slurm", self.driver_line(submitit_command)]

    def submitit_setup_for(self, executor: Any) -> list[str]:
        """``submitit_setup`` for a ``submitit.AutoExecutor`` on Slurm. submitit has no public name for
        the command line it writes last (``python -u -m submitit.core._submit FOLDER``), so it is read
        from its Slurm executor; ``tests/unit/test_spec.py`` checks the submission file it then writes."""
        return self.submitit_setup(executor._executor._submitit_command_str)

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


def resource_directives(res: ResolvedResources, nodes: int) -> list[str]:
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
    """pyxis arguments for every ``srun`` step of the job (``launcher.slurm.srun.container_args``)."""
    return container_args(resolved.slurm.container) if resolved.slurm is not None else ()


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
    signal = signal_option(parse_time(slurm.time))
    job_wide.append(f"--signal={signal}")

    if slurm.layout == "single":
        nodes = resolved.training.nodes + resolved.generation.nodes
        options = job_wide + shared + resource_directives(gen_res, nodes) + list(gen_res.extra_sbatch)
        component = SlurmComponent("all", nodes, _sbatch(options))
        return SlurmRequest(
            layout="single",
            components=(component,),
            submitit_parameters=submitit_parameters(resolved, nodes, gen_res, signal),
            srun_args=srun_args,
            signal=signal,
            log_pattern=log,
        )

    training = SlurmComponent(
        "training",
        resolved.training.nodes,
        _sbatch(
            job_wide
            + shared
            + resource_directives(train_res, resolved.training.nodes)
            + list(train_res.extra_sbatch)
        ),
    )
    generation = SlurmComponent(
        "generation",
        resolved.generation.nodes,
        _sbatch(
            shared + resource_directives(gen_res, resolved.generation.nodes) + list(gen_res.extra_sbatch)
        ),
    )
    return SlurmRequest(
        layout="hetjob",
        components=(training, generation),
        submitit_parameters=None,
        srun_args=srun_args,
        signal=signal,
        log_pattern=log,
    )


def submitit_parameters(
    resolved: ResolvedSpec, nodes: int, res: ResolvedResources, signal: str
) -> dict[str, Any]:
    """``submitit.AutoExecutor.update_parameters`` keywords for the single allocation.

    Generic names where submitit has them (``nodes``, ``timeout_min``...), ``slurm_``-prefixed ones
    otherwise; extras become ``slurm_additional_parameters`` (submitit writes each as ``--key=value``).
    ``signal`` replaces submitit's own ``--signal=USR2@90`` (sent to every step: engines and Ray workers
    died of it 90 s before the limit): submitit applies additional parameters after its own.
    ``slurm_use_srun`` is off: the driver runs once, and starts every other process itself. The caller
    adds ``slurm_setup`` (``SlurmRequest.submitit_setup``), which needs submitit's command line.
    The job name and output paths are left to the caller: submitit owns its folder layout.
    """
    slurm = resolved.slurm
    assert slurm is not None
    params: dict[str, Any] = {
        "name": resolved.name,
        "nodes": nodes,
        "tasks_per_node": 1,
        "timeout_min": slurm.time_min,
        "slurm_use_srun": False,
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
    additional: dict[str, Any] = dict(parse_sbatch_option(opt) for opt in res.extra_sbatch)
    additional["signal"] = signal
    params["slurm_additional_parameters"] = additional
    return params


PROBE_EXTRA_OPTIONS = frozenset(
    {"reservation", "nodelist", "exclude", "clusters", "licenses", "gres", "wckey", "mem-per-cpu", "tmp"}
)
"""``extra_sbatch`` options a probe step carries too (``probe_command``): those that decide which nodes a
job may get and that ``srun`` also takes. The others (mail, requeue, dependencies...) concern the batch
job, and some are sbatch-only: ``srun`` would refuse the probe over them."""


def probe_command(
    resolved: ResolvedSpec,
    role: Literal["training", "generation"],
    *,
    job_name: str,
    time_s: int,
    argv: Sequence[str],
    container: bool = True,
) -> list[str]:
    """``srun`` argv of a one-node, one-task step on a node like the job's ``role`` nodes
    (``rl-launch check``): the same resources, partition, account and container as the job asks for
    that role (the single allocation's for both roles in the single layout), a short time limit, and
    the caller's environment (``--export=ALL``, as the job's steps). ``container=False`` leaves the
    container out (no pyxis here: the probe then looks at the host)."""
    slurm = resolved.slurm
    if slurm is None:
        raise ValueError("cluster is 'local': there is no Slurm step to probe with")
    role_res = resolved.training.resources if role == "training" else resolved.generation.resources
    res = resolved.generation.resources if slurm.layout == "single" else role_res
    assert res is not None  # set whenever slurm is
    extra = [o for o in res.extra_sbatch if parse_sbatch_option(o)[0] in PROBE_EXTRA_OPTIONS]
    return [
        "srun",
        *resource_directives(res, 1),
        "--ntasks=1",
        f"--time={format_time(max(60, min(time_s, parse_time(slurm.time))))}",
        *([f"--account={slurm.account}"] if slurm.account else []),
        f"--job-name={job_name}",
        "--export=ALL",
        *extra,
        *(container_args(slurm.container) if container else ()),
        *argv,
    ]
