"""The login-node half of ``rl-launch check``: what Slurm, the partitions and this node say, before any job.

``sinfo`` once (``-N``: a row per node and partition) answers whether Slurm is reachable, whether each
partition the spec asks for exists, and whether it has enough usable nodes with the GPUs per node asked;
``sacctmgr`` whether the account is the user's; ``srun --help`` whether pyxis gives ``--container-image``.
The parsers are pure, so the unit tests feed them the text real Slurm prints.

Why from ``sinfo`` and not from a failed submission: sbatch refuses a missing partition with one line, but
GPUs the nodes lack may queue a job forever (``PENDING (ReqNodeNotAvail)``, or Resources on a cluster
whose nodes are merely busy), which is the failure a check before the first allocation exists for.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from launcher.check.outcome import Check, fail, ok, skip
from launcher.slurm.nodes import natural_key
from launcher.slurm.time import format_time, parse_time

SINFO_FORMAT = "%P|%N|%G|%T|%l"
_TIMEOUT_S = 15.0
_UNUSABLE = ("down", "drain", "fail", "inval", "unk", "maint")


@dataclass(frozen=True)
class NodeRow:
    """One node of one partition, as ``sinfo -N -o SINFO_FORMAT`` prints it."""

    partition: str
    default: bool
    """The partition is the default one (sinfo's ``*``)."""
    node: str
    gpus: int
    state: str
    time_limit: str = ""
    """The partition's MaxTime as sinfo prints it (``infinite``, ``4:00:00``, ``1-00:00:00``)."""

    @property
    def usable(self) -> bool:
        """Able to take a job: not down, drained, failing or not responding (``*``)."""
        state = self.state.lower()
        return not state.endswith("*") and not state.startswith(_UNUSABLE)


def gres_gpus(gres: str) -> int:
    """GPUs in a node's ``%G``: ``gpu:2``, ``gpu:a100:8(S:0-1)``, ``gpu:a100:4,gpu:v100:2`` (summed);
    ``(null)`` or no gpu entry is 0."""
    total = 0
    for entry in re.split(r",(?![^()]*\))", gres):
        fields = re.sub(r"\(.*?\)", "", entry.strip()).split(":")
        if fields[0] != "gpu" or len(fields) < 2:
            continue
        count = fields[-1].strip()
        if count.isdigit():
            total += int(count)
        elif len(fields) == 2:  # "gpu:tesla" with no count is one device
            total += 1
    return total


def parse_sinfo(text: str) -> list[NodeRow]:
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0]:
            continue
        partition, node, gres, state = parts[:4]
        limit = parts[4].strip() if len(parts) > 4 else ""
        rows.append(
            NodeRow(partition.rstrip("*"), partition.endswith("*"), node, gres_gpus(gres), state, limit)
        )
    return rows


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str] | str:
    """The finished command, or why it could not be run (one line)."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"`{' '.join(argv)}` did not answer within {_TIMEOUT_S:g} s"
    except OSError as exc:
        return f"`{argv[0]}` could not be run: {exc.strerror or exc}"


def read_sinfo() -> tuple[list[NodeRow] | None, Check]:
    """The cluster's nodes, and the ``slurm`` verdict (reachable or not, and the fix)."""
    if shutil.which("sinfo") is None:
        return None, fail(
            "slurm",
            "`sinfo` is not on PATH",
            "run check on a Slurm login node (or add Slurm's bin directory to PATH)",
        )
    proc = _run(["sinfo", "-h", "-N", "-o", SINFO_FORMAT])
    if isinstance(proc, str) or proc.returncode != 0:
        why = proc if isinstance(proc, str) else (proc.stderr.strip() or f"exit {proc.returncode}")
        return None, fail(
            "slurm",
            f"sinfo failed: {why.splitlines()[0]}",
            "check that slurmctld is up and reachable from here",
        )
    rows = parse_sinfo(proc.stdout)
    if not rows:
        return None, fail("slurm", "sinfo lists no nodes", "check the Slurm configuration with your site")
    parts = sorted({(r.partition + ("*" if r.default else "")) for r in rows})
    nodes = {r.node for r in rows}
    return rows, ok("slurm", f"sinfo answered: {len(nodes)} node(s), partition(s) {', '.join(parts)}")


def compress(nodes: Sequence[str]) -> str:
    """``node1, node2, node3`` as a short list for a line (at most 4 names, then a count)."""
    names = sorted(set(nodes), key=natural_key)
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


@dataclass(frozen=True)
class Need:
    """What one part of the allocation asks for: ``who`` (the job, training or generation), on which
    partition (None: the default), how many nodes with how many GPUs each, and the spec fields to name."""

    who: str
    partition: str | None
    nodes: int
    gpus: int
    fields: str
    """``slurm`` or ``generation.slurm``: where the partition and gpus_per_node are set."""


def check_partition(rows: Sequence[NodeRow], need: Need) -> tuple[list[NodeRow], Check]:
    """The partition's rows (empty when it does not exist) and the verdict."""
    names = sorted({r.partition + ("*" if r.default else "") for r in rows})
    if need.partition is None:
        mine = [r for r in rows if r.default]
        if not mine:
            return [], fail(
                f"{need.who} partition",
                "the spec names no partition and this cluster has no default one",
                f"set {need.fields}.partition to one of: {', '.join(names)}",
            )
        label = f"{mine[0].partition} (the default)"
    else:
        mine = [r for r in rows if r.partition == need.partition]
        if not mine:
            return [], fail(
                f"{need.who} partition",
                f"partition {need.partition!r} does not exist (here: {', '.join(names)}; * = default)",
                f"set {need.fields}.partition to one of them",
            )
        label = need.partition
    usable = [r for r in mine if r.usable]
    limit = f", time limit {mine[0].time_limit}" if mine[0].time_limit else ""
    return mine, ok(f"{need.who} partition", f"{label}: {len(usable)} of {len(mine)} node(s) usable{limit}")


def check_time(rows: Sequence[NodeRow], need: Need, time: str) -> Check | None:
    """A failure when ``slurm.time`` is over the partition's limit (``rows``: the partition's), else None.

    Why: unless the site enforces partition limits at submission, sbatch accepts such a job and it waits
    in the queue for ever, ``PENDING (PartitionTimeLimit)``."""
    text = rows[0].time_limit if rows else ""
    try:
        limit = parse_time(text)
    except ValueError:  # infinite, UNLIMITED, or nothing printed: no limit to be over
        return None
    if parse_time(time) <= limit:
        return None
    return fail(
        f"{need.who} time",
        f"slurm.time {time} is over partition {rows[0].partition}'s time limit {text}: the job would wait "
        "in the queue for ever (PartitionTimeLimit)",
        f"set slurm.time to at most {format_time(limit)}, or use a partition with a longer limit",
    )


def check_gpus(rows: Sequence[NodeRow], need: Need) -> Check:
    """Enough usable nodes of the partition with ``need.gpus`` GPUs each (``rows``: the partition's)."""
    name = f"{need.who} nodes"
    usable = [r for r in rows if r.usable]
    fitting = [r for r in usable if r.gpus >= need.gpus]
    asked = f"{need.nodes} node(s) with {need.gpus} GPU(s) each" if need.gpus else f"{need.nodes} node(s)"
    partition = rows[0].partition if rows else "?"
    if need.gpus and not fitting:
        most = max((r.gpus for r in usable), default=0)
        where = f" ({compress([r.node for r in usable if r.gpus == most])})" if most else ""
        return fail(
            name,
            f"{asked} asked, but the usable nodes of partition {partition} have at most {most} GPU(s){where}",
            f"set {need.fields}.gpus_per_node to at most {most} (and the engines' TP x PP to fit), "
            f"or use a partition with bigger nodes",
        )
    if len(fitting) < need.nodes:
        return fail(
            name,
            f"{asked} asked, but partition {partition} has {len(fitting)} such usable node(s)",
            "lower training.nodes / generation.nodes, or use a bigger partition",
        )
    return ok(
        name,
        f"{asked}: {len(fitting)} such usable node(s) in {partition} ({compress([r.node for r in fitting])})",
    )


def user_name() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def parse_accounts(text: str) -> set[str]:
    """``sacctmgr -n -P show assoc user=U format=account``: one account a line (repeated per partition)."""
    return {line.strip().lower() for line in text.splitlines() if line.strip()}


def check_account(account: str) -> Check:
    """The account is one of the user's associations (skipped where accounting cannot be asked)."""
    if shutil.which("sacctmgr") is None:
        return skip(
            "account", f"{account}: sacctmgr is not on PATH, cannot look it up (the probe job tries it)"
        )
    user = user_name()
    proc = _run(["sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "format=account"])
    if isinstance(proc, str) or proc.returncode != 0:
        return skip("account", f"{account}: sacctmgr did not answer (the probe job tries it)")
    mine = parse_accounts(proc.stdout)
    if account.lower() not in mine:
        return fail(
            "account",
            f"{account!r} is not an account of user {user} (theirs: {', '.join(sorted(mine)) or 'none'})",
            "set slurm.account to one of them (sacctmgr show assoc user=$USER)",
        )
    return ok("account", f"{account} is one of {user}'s accounts")


def srun_has_pyxis(help_text: str) -> bool:
    """pyxis adds ``--container-image`` to ``srun --help`` (Slurm's own ``--container`` is OCI bundles)."""
    return "--container-image" in help_text


def check_container_runtime(image: str) -> Check:
    """The spec's container runs through pyxis (``launcher.slurm.srun.container_args``): srun must know it."""
    proc = _run(["srun", "--help"])
    text = "" if isinstance(proc, str) else proc.stdout + proc.stderr
    if not srun_has_pyxis(text):
        return fail(
            "container runtime",
            f"slurm.container names {image}, but srun here has no --container-image "
            "(pyxis/enroot not installed)",
            "ask your site for pyxis + enroot, or remove slurm.container and install the job's software on "
            "shared storage",
        )
    return ok("container runtime", f"srun has pyxis's --container-image (image {image})")


def prepare_share(job_root: str) -> tuple[Path | None, str, Check]:
    """The job root, usable here, with a fresh directory holding a token for the probes to read back:
    ``(that directory, the token, the verdict)``."""
    from launcher.jobdir.ownership import Untrusted, ensure_job_root

    try:
        root = ensure_job_root(job_root)
        share = root / f"check-{os.urandom(4).hex()}"
        share.mkdir(mode=0o700)
        token = os.urandom(8).hex()
        (share / "login.token").write_text(token)
    except Untrusted as exc:
        return None, "", fail("job root", str(exc), "set job_root to a directory of yours on shared storage")
    except OSError as exc:
        return (
            None,
            "",
            fail(
                "job root",
                f"cannot write in {job_root}: {exc.strerror or exc}",
                "set job_root to a directory of yours on shared storage",
            ),
        )
    return share, token, ok("job root", f"{root} is writable here")
