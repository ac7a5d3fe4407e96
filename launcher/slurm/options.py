"""Extra ``#SBATCH`` options from the spec (``extra_sbatch``): their syntax, and the ones the spec owns.

Pure (no spec import), so the schema validates with it and the request builder writes with it: one
parser for both.
"""

from __future__ import annotations

import re

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
    "signal": "the launcher warns the driver before the time limit (B:USR2); remove it",
    "hetjob": "set training.slurm / generation.slurm; the launcher decides when a hetjob is needed",
    "packjob": "set training.slurm / generation.slurm; the launcher decides when a hetjob is needed",
}


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
