"""Containers (pyxis/enroot) end to end: the spec's ``slurm.container`` reaches every step.

The unit tests pin the exact ``srun`` command lines (the driver's step in the batch script, each step the
driver starts) and that ``submit --dry-run`` prints the lines that run. The cluster test runs a real job on
the local Slurm cluster with a stand-in for pyxis: a wrapper named ``srun`` first on the job's ``PATH``
that records the ``--container-*`` flags each step received, then runs the real ``srun`` without them
(``--container-workdir`` becomes ``--chdir``, and the step sees ``PYXIS_STANDIN_IMAGE``, as a process in
the image would see the image). So the flags are proven to reach the driver, every Ray worker and every
engine host, and the training command is proven to run inside the driver's container.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.slurm import build_request
from launcher.slurm.srun import driver_launch_line, signal_option, step_command
from launcher.spec import load_resolved
from launcher.steps.processes import SrunSteps
from launcher.submit.render import render_sbatch
from tests.support.cli import RL_LAUNCH

IMAGE = "nvcr.io/nvidia/nemo-rl:v0.4"
CONTAINER_FLAGS = [
    f"--container-image={IMAGE}",
    "--container-mounts=/lustre:/lustre,/a:/b:ro",
    "--container-workdir=/workspace",
]


def spec_file(tmp_path: Path, **changes: object) -> Path:
    spec: dict[str, object] = {
        "name": "c",
        "job_root": str(tmp_path / "jobs"),
        "slurm": {
            "partition": "debug",
            "time": "01:00:00",
            "gpus_per_node": 0,
            "container": {"image": IMAGE, "mounts": ["/lustre:/lustre", "/a:/b:ro"], "workdir": "/workspace"},
        },
        "training": {"nodes": 1, "command": "python train.py"},
        "generation": {"nodes": 2, "engine": "sim"},
    }
    spec.update(changes)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_step_command_line_is_exact() -> None:
    cmd = step_command(
        node="node2",
        name="engines-node2",
        log="/j/logs/e.log",
        argv=["python", "-m", "launcher.engines.host"],
        container=CONTAINER_FLAGS,
        gpus=4,
        het_group=1,
    )
    assert cmd == [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        "--nodelist=node2",
        "--overlap",
        "--kill-on-bad-exit=0",
        "--export=ALL",
        "--job-name=engines-node2",
        "--output=/j/logs/e.log",
        "--het-group=1",
        "--gpus-per-node=4",
        *CONTAINER_FLAGS,
        "python",
        "-m",
        "launcher.engines.host",
    ]


def test_driver_launch_line_is_exact() -> None:
    assert driver_launch_line((), "rl-launch submit s.yaml") == "exec rl-launch submit s.yaml"
    assert driver_launch_line(CONTAINER_FLAGS, "rl-launch submit s.yaml") == (
        'exec srun --nodes=1 --ntasks=1 --nodelist="$SLURMD_NODENAME" --overlap --kill-on-bad-exit=1 '
        "--export=ALL --job-name=driver --container-image=nvcr.io/nvidia/nemo-rl:v0.4 "
        "--container-mounts=/lustre:/lustre,/a:/b:ro --container-workdir=/workspace rl-launch submit s.yaml"
    )


def test_srun_steps_start_with_the_container_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's step runner really executes the line (a recording ``srun`` on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    fake = bin_dir / "srun"
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    step = SrunSteps(CONTAINER_FLAGS).start(
        "node3", "ray-worker-node3", ["ray", "start"], env, tmp_path / "w.log"
    )
    step.proc.wait(10)
    assert (
        json.loads(record.read_text())
        == step_command(
            node="node3",
            name="ray-worker-node3",
            log=tmp_path / "w.log",
            argv=["ray", "start"],
            container=CONTAINER_FLAGS,
        )[1:]
    )


def test_rendered_script_runs_the_driver_in_the_container(tmp_path: Path) -> None:
    resolved = load_resolved(spec_file(tmp_path))
    text = render_sbatch(resolved, rl_launch=["/venv/bin/rl-launch"])
    lines = text.splitlines()
    assert "#SBATCH --signal=B:USR2@90" in lines
    assert lines[-1] == (
        'exec srun --nodes=1 --ntasks=1 --nodelist="$SLURMD_NODENAME" --overlap --kill-on-bad-exit=1 '
        f"--export=ALL --job-name=driver {' '.join(CONTAINER_FLAGS)} /venv/bin/rl-launch submit "
        f'{resolved.spec_path} --in-allocation --job-dir "$job_dir"'
    )
    # without a container the batch shell is the driver itself
    plain = load_resolved(spec_file(tmp_path, slurm={"partition": "debug", "time": "01:00:00"}))
    assert render_sbatch(plain, rl_launch=["rl-launch"]).splitlines()[-1] == (
        f'exec rl-launch submit {plain.spec_path} --in-allocation --job-dir "$job_dir"'
    )


def test_hetjob_request_and_submitit_request_carry_the_container(tmp_path: Path) -> None:
    single = build_request(load_resolved(spec_file(tmp_path)))
    assert list(single.srun_args) == CONTAINER_FLAGS
    assert single.submitit_setup("python -u -m submitit.core._submit /f") == [
        "export SUBMITIT_EXECUTOR=slurm",
        driver_launch_line(CONTAINER_FLAGS, "python -u -m submitit.core._submit /f"),
    ]
    het = build_request(
        load_resolved(
            spec_file(tmp_path, generation={"nodes": 1, "engine": "sim", "slurm": {"partition": "g"}})
        )
    )
    assert het.layout == "hetjob" and list(het.srun_args) == CONTAINER_FLAGS


def test_dry_run_prints_the_lines_that_run(tmp_path: Path) -> None:
    path = spec_file(tmp_path)
    out = CliRunner().invoke(main, ["submit", str(path), "--dry-run"]).output
    request = build_request(load_resolved(path))
    folder = tmp_path / "jobs" / "submitit" / "%j"
    assert request.driver_line(f"{sys.executable} -u -m submitit.core._submit {folder}") in out.splitlines()
    worker = [line for line in out.splitlines() if "--job-name=ray-worker-<node>" in line]
    assert len(worker) == 1 and worker[0].endswith(
        f"{' '.join(CONTAINER_FLAGS)} <ray start --address=<head> --block>"
    )
    assert sum(" ".join(CONTAINER_FLAGS) in line for line in out.splitlines()) == 3  # driver, worker, host
    assert f"--signal={signal_option(3600)}" in out


# --------------------------------------------------------------------------------------------------
# On the local Slurm cluster, with a pyxis stand-in
# --------------------------------------------------------------------------------------------------

STANDIN = """\
#!/bin/bash
# pyxis stand-in: record the --container-* flags this step received, then run the real srun without them
# (--container-workdir becomes --chdir; the step sees the image name as PYXIS_STANDIN_IMAGE).
name=""; image=""; flags=(); args=()
for a in "$@"; do
  case "$a" in
    --container-image=*) flags+=("$a"); image="${a#--container-image=}" ;;
    --container-workdir=*) flags+=("$a"); args+=("--chdir=${a#--container-workdir=}") ;;
    --container-*) flags+=("$a") ;;
    --job-name=*) name="${a#--job-name=}"; args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done
( IFS=$'\\t'; echo "$name"$'\\t'"${flags[*]}" ) >> RECORD
[ -n "$image" ] && export PYXIS_STANDIN_IMAGE="$image"
exec REAL_SRUN "${args[@]}"
"""


@pytest.mark.slurm
@pytest.mark.parametrize("layout", ["single", "hetjob"])
def test_container_flags_reach_every_step_on_the_cluster(tmp_path: Path, layout: str) -> None:
    """``single``: submitted through submitit (its setup line); ``hetjob``: the rendered sbatch script."""
    from tests.support.slurm import _slurm_unreachable

    reason = _slurm_unreachable()
    if reason:
        pytest.skip(
            f"no Slurm cluster reachable: {reason} (slurm/cluster.sh start, then run on its login node)"
        )
    real_srun = shutil.which("srun")
    assert real_srun is not None
    bin_dir, workdir, record = tmp_path / "bin", tmp_path / "workdir", tmp_path / "container-flags.tsv"
    bin_dir.mkdir()
    workdir.mkdir()
    wrapper = bin_dir / "srun"
    wrapper.write_text(STANDIN.replace("RECORD", str(record)).replace("REAL_SRUN", real_srun))
    wrapper.chmod(0o755)
    image = "docker://stand-in/rl:1"
    container = {"image": image, "mounts": [f"{tmp_path}:{tmp_path}"], "workdir": str(workdir)}
    path = spec_file(
        tmp_path,
        slurm={"partition": "debug", "time": "00:10:00", "cpus_per_task": 1, "container": container},
        training={
            "nodes": 1,
            "command": 'echo "$PYXIS_STANDIN_IMAGE $(pwd)" > "$RL_JOB_DIR/training-saw.txt"',
        },
        generation={
            "nodes": 2,
            "engine": "sim",
            "engines_per_node": 1,
            "startup_timeout_s": 90,
            "sim": {"speed": 20},
            **({"slurm": {"cpus_per_task": 2}} if layout == "hetjob" else {}),
        },
    )
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [RL_LAUNCH, "submit", str(path), "--follow"], capture_output=True, text=True, timeout=300, env=env
    )
    job_line = next((x for x in proc.stdout.splitlines() if x.startswith("job directory:")), None)
    assert job_line is not None, proc.stdout + proc.stderr
    job = Path(job_line.split(":", 1)[1].strip())
    job_id = job.name.rsplit("-", 1)[1]
    try:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        expected = "\t".join(
            [
                f"--container-image={image}",
                f"--container-mounts={tmp_path}:{tmp_path}",
                f"--container-workdir={workdir}",
            ]
        )
        rows = [line.split("\t", 1) for line in record.read_text().splitlines()]
        steps = {name: flags for name, flags in rows}
        events = [json.loads(line) for line in (job / "events.jsonl").read_text().splitlines()]
        nodes = next(e for e in events if e.get("phase") == "starting")["nodes"]
        others = [n for n in [*nodes["training"], *nodes["generation"]] if n != nodes["training"][0]]
        want = {
            "driver",
            *(f"ray-worker-{n}" for n in others),
            *(f"engines-{n}" for n in nodes["generation"]),
        }
        assert set(steps) == want, rows
        assert all(flags == expected for flags in steps.values()), rows
        # the training command ran inside the driver's container, in its workdir
        assert (job / "training-saw.txt").read_text().split() == [image, str(workdir)]
        # the batch script: our warning signal (batch shell only), and the line that execs the driver step
        if layout == "single":
            submission = next((tmp_path / "jobs" / "submitit" / job_id).glob("*_submission.sh")).read_text()
        else:
            submission = (tmp_path / "jobs" / "c.sbatch").read_text()
        assert [x for x in submission.splitlines() if "--signal" in x] == ["#SBATCH --signal=B:USR2@90"]
        assert any(x.startswith("exec srun ") and "--job-name=driver" in x for x in submission.splitlines())
    finally:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() < deadline, f"job {job_id} still queued a minute after it ended"
        time.sleep(1)
