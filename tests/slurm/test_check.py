"""``rl-launch check SPEC`` on the local Slurm cluster, as a user runs it on a login node.

A correct spec passes every check, the vLLM import on a generation node included. Each defect planted in
an otherwise correct spec (a missing partition, GPUs the nodes lack, an engine python that cannot import
vLLM, a model directory only the login node has, a job root that is not shared, a container without a
container runtime) gives exactly one FAIL line, naming the check and its fix, and exit status 1. A probe
that cannot start within ``--timeout`` is reported pending and cancelled, leaving nothing queued.

Node-private paths: the cluster's nodes each mount their own tmpfs on ``/dev/shm`` (slurm/cluster.sh),
while the login node sees the machine's, so a directory made there by the test exists on the login node
only, like a login node's local disk on a real site. Those directories are the only thing these tests
write outside pytest's tmp dirs, and the fixture removes them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.support.cli import RL_LAUNCH
from tests.support.slurm import slurm_cluster  # noqa: F401 (autouse: skips the module without a cluster)

pytestmark = pytest.mark.slurm

SLURM = {"partition": "debug", "time": "00:20:00", "cpus_per_task": 1, "gpus_per_node": 2}


@pytest.fixture
def login_only() -> Iterator[Path]:
    """A directory the login node has and the compute nodes do not (their /dev/shm is their own)."""
    path = Path("/dev/shm") / f"rl-launch-check-test-{os.getpid()}-{os.urandom(3).hex()}"
    path.mkdir(mode=0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def model_dir(parent: Path) -> Path:
    """What the check looks for on the nodes: the model's directory (it loads nothing)."""
    path = parent / "model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return path


def spec_file(tmp_path: Path, *, engine: str = "sim", model: Path | None = None, **changes: object) -> Path:
    generation: dict[str, object] = {"nodes": 1, "engine": "sim", "engines_per_node": 1}
    if engine == "vllm":
        generation = {
            "nodes": 1,
            "engine": "vllm",
            "model": str(model),
            "tensor_parallel_size": 2,
            "env": {"VLLM_SERVER_DEV_MODE": "1"},
        }
    spec: dict[str, object] = {
        "name": "chk",
        "cluster": "slurm",
        "job_root": str(tmp_path / "jobs"),
        "slurm": dict(SLURM),
        "training": {"nodes": 1, "command": "true"},
        "generation": generation,
    }
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            spec[section] = {**spec[section], field: value}  # type: ignore[dict-item]
        else:
            spec[section] = value
    path = tmp_path / "chk.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def check(
    spec: Path, *args: str, vllm_python: str | None = None, timeout_s: float = 420
) -> tuple[int, list[str]]:
    """``rl-launch check``'s exit status and its check lines (stdout, indented)."""
    env = {k: v for k, v in os.environ.items() if k != "RL_LAUNCH_VLLM_PYTHON"}
    if vllm_python:
        env["RL_LAUNCH_VLLM_PYTHON"] = vllm_python
    proc = subprocess.run(
        [RL_LAUNCH, "check", str(spec), "--timeout", "300", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    print(proc.stdout, proc.stderr, sep="\n")  # shown when the test fails: the whole output
    lines = [x.strip() for x in proc.stdout.splitlines() if x.startswith("  ")]
    return proc.returncode, lines


def no_probe_left(job_root: Path | None = None) -> None:
    """No probe job in the queue, and (when the job root is here) no token directory left in it."""
    deadline = time.monotonic() + 30
    while True:
        queue = subprocess.run(
            ["squeue", "-h", "-o", "%j"], capture_output=True, text=True, timeout=10
        ).stdout
        probes = [x for x in queue.split() if x.startswith("rl-launch-check-")]
        if not probes:
            break
        assert time.monotonic() < deadline, f"probe jobs left in the queue: {probes}"
        time.sleep(0.5)
    if job_root is not None and job_root.is_dir():
        assert not list(job_root.glob("check-*")), list(job_root.iterdir())


def status_of(lines: list[str]) -> dict[str, str]:
    """``{check name: status}`` from the printed lines."""
    out = {}
    for line in lines:
        status, _, rest = line.partition(" ")
        out[rest.strip().split(":", 1)[0]] = status
    return out


@pytest.mark.vllm
def test_a_correct_spec_passes_every_check(tmp_path: Path, vllm_python: str) -> None:
    spec = spec_file(tmp_path, engine="vllm", model=model_dir(tmp_path))
    code, lines = check(spec, vllm_python=vllm_python)
    assert code == 0, lines
    seen = status_of(lines)
    assert seen == {
        "slurm": "ok",
        "job partition": "ok",
        "job nodes": "ok",
        "job root": "ok",
        "training probe": "ok",
        "generation probe": "ok",
        "launcher": "ok",
        "job root shared": "ok",
        "training GPUs": "ok",
        "training router port": "ok",
        "generation GPUs": "ok",
        "generation engine python": "ok",
        "generation model": "ok",
    }, lines
    engine = next(x for x in lines if x.startswith("ok    generation engine python:"))
    assert "vLLM 0." in engine and vllm_python in engine
    assert any("CUDA_VISIBLE_DEVICES=0,1" in x for x in lines)
    no_probe_left(tmp_path / "jobs")


def test_a_correct_sim_spec_passes_without_vllm(tmp_path: Path) -> None:
    code, lines = check(spec_file(tmp_path))
    assert code == 0 and all(x.startswith("ok ") for x in lines), lines
    assert "generation engine python" not in status_of(lines)  # sim engines: no vLLM to look for
    no_probe_left(tmp_path / "jobs")


def one_failure(lines: list[str]) -> str:
    failed = [x for x in lines if x.startswith("FAIL")]
    assert len(failed) == 1, lines
    return failed[0]


@pytest.mark.parametrize(
    ("defect", "name", "fix"),
    [
        ("missing partition", "job partition", "set slurm.partition to one of them"),
        ("GPUs the nodes lack", "job nodes", "set slurm.gpus_per_node to at most 2"),
        ("missing container runtime", "container runtime", "ask your site for pyxis + enroot"),
        ("an account that is not the user's", "account", "set slurm.account to one of them"),
    ],
)
def test_a_spec_slurm_cannot_run_fails_on_the_login_node(
    tmp_path: Path, defect: str, name: str, fix: str
) -> None:
    changes: dict[str, object] = {
        "missing partition": {"slurm__partition": "gpu-a100"},
        "GPUs the nodes lack": {"slurm__gpus_per_node": 8},
        "an account that is not the user's": {"slurm__account": "not-an-account"},
        "missing container runtime": {
            "slurm__container": {
                "image": "nvcr.io/nvidia/nemo-rl:v0.4.0",
                "mounts": ["/work:/work", "/tmp:/tmp"],
            }
        },
    }[defect]
    code, lines = check(spec_file(tmp_path, **changes))
    assert code == 1, lines
    line = one_failure(lines)
    assert line.startswith(f"FAIL  {name}: ") and f"; fix: {fix}" in line, line
    if defect != "missing container runtime":  # Slurm would only refuse it again: no probe is started
        assert status_of(lines)["generation probe"] == "skip", lines
    else:  # the other checks still ran, on the host
        assert "without the container" in next(x for x in lines if x.startswith("ok    generation probe:"))
    no_probe_left(tmp_path / "jobs")


def test_an_engine_python_without_vllm_fails(tmp_path: Path) -> None:
    python = sys.executable  # the launcher's venv: no vLLM in it
    assert subprocess.run([python, "-c", "import vllm"], capture_output=True).returncode != 0
    spec = spec_file(tmp_path, engine="vllm", model=model_dir(tmp_path))
    code, lines = check(spec, vllm_python=python)
    assert code == 1, lines
    line = one_failure(lines)
    assert line.startswith("FAIL  generation engine python: ") and "No module named 'vllm'" in line, line
    assert "; fix: install it: export RL_LAUNCH_VLLM_PYTHON=" in line, line
    assert "export RL_LAUNCH_VLLM_PYTHON=" in line, line
    no_probe_left(tmp_path / "jobs")


@pytest.mark.vllm
def test_a_model_only_the_login_node_has_fails(tmp_path: Path, login_only: Path, vllm_python: str) -> None:
    model = model_dir(login_only)
    code, lines = check(spec_file(tmp_path, engine="vllm", model=model), vllm_python=vllm_python)
    assert code == 1, lines
    line = one_failure(lines)
    assert line.startswith(f"FAIL  generation model: generation.model {model} does not exist on node"), line
    assert "; fix: put the model on storage every node mounts" in line, line
    no_probe_left(tmp_path / "jobs")


def test_a_job_root_the_nodes_do_not_share_fails(tmp_path: Path, login_only: Path) -> None:
    root = login_only / "jobs"
    code, lines = check(spec_file(tmp_path, job_root=str(root)))
    assert code == 1, lines
    line = one_failure(lines)
    assert line.startswith(f"FAIL  job root shared: {root} is not shared with node"), line
    assert "; fix: set job_root to a directory on storage every node mounts" in line, line
    no_probe_left(root)


@pytest.fixture
def all_nodes_held(tmp_path: Path) -> Iterator[str]:
    """Another job holding every node of the cluster (running) for the test's duration: its id."""
    hold = ["-N3", "--exclusive", "-p", "debug", "-t", "5", "-J", "hold-all", "--wrap", "sleep 300"]
    blocker = subprocess.run(
        [
            "sbatch",
            "--parsable",
            f"--output={tmp_path / 'hold-all.out'}",
            *hold,
        ],  # not slurm-%j.out in the cwd
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert blocker.returncode == 0, blocker.stderr
    job = blocker.stdout.strip().split(";")[0]

    def state() -> str:
        return subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout

    try:
        deadline = time.monotonic() + 30
        while "RUNNING" not in state():
            assert time.monotonic() < deadline, "the blocking job did not start"
            time.sleep(0.5)
        yield job
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
        deadline = time.monotonic() + 60
        while state().strip():
            assert time.monotonic() < deadline, f"the blocking job {job} is still queued"
            time.sleep(0.5)


def test_a_probe_that_cannot_start_is_reported_pending_and_cancelled(
    tmp_path: Path, all_nodes_held: str
) -> None:
    """Every node held by another job: the probe pends, and is cancelled at the deadline."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [RL_LAUNCH, "check", str(spec_file(tmp_path)), "--timeout", "10"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - t0
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 1
    failed = [x.strip() for x in proc.stdout.splitlines() if x.startswith("  FAIL")]
    assert len(failed) == 2 and all(
        "still PENDING (" in x and "after 10 s; cancelled" in x for x in failed
    ), failed
    assert took < 60, took
    no_probe_left(tmp_path / "jobs")


@pytest.mark.parametrize("how", ["Ctrl-C", "SIGINT", "SIGTERM"])
def test_stopping_check_while_a_probe_pends_leaves_nothing_queued(
    tmp_path: Path, all_nodes_held: str, how: str
) -> None:
    """Ctrl-C reaches the whole foreground process group (check and its sruns), as in a terminal; a
    signal sent to check alone (kill, a timeout around it) reaches only check, whose sruns would wait on
    in the queue."""
    proc = subprocess.Popen(
        [RL_LAUNCH, "check", str(spec_file(tmp_path)), "--timeout", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    queue = ""
    while queue.count("rl-launch-check-") < 2:  # both probes are queued
        assert time.monotonic() < deadline and proc.poll() is None, "the probes were never queued"
        time.sleep(0.3)
        queue = subprocess.run(
            ["squeue", "-h", "-o", "%j"], capture_output=True, text=True, timeout=10
        ).stdout
    if how == "Ctrl-C":
        os.killpg(proc.pid, signal.SIGINT)
    else:
        os.kill(proc.pid, signal.SIGINT if how == "SIGINT" else signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    print(out, err)
    assert proc.returncode != 0
    no_probe_left(tmp_path / "jobs")


PYXIS_STANDIN = """\
#!/bin/bash
# pyxis stand-in: srun --help lists pyxis's option; a step records its --container-* flags, then runs the
# real srun without them (tests/slurm/test_containers.py has the same stand-in for whole jobs)
if [ "$1" = "--help" ]; then
  REAL_SRUN --help; echo "      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH"; exit 0
fi
name=""; flags=(); args=()
for a in "$@"; do
  case "$a" in
    --container-*) flags+=("$a") ;;
    --job-name=*) name="${a#--job-name=}"; args+=("$a") ;;
    *) args+=("$a") ;;
  esac
done
echo "$name ${flags[*]}" >> RECORD
exec REAL_SRUN "${args[@]}"
"""


def test_with_pyxis_each_probe_runs_in_the_spec_container(tmp_path: Path) -> None:
    real = shutil.which("srun")
    assert real is not None
    bin_dir, record = tmp_path / "bin", tmp_path / "steps.txt"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(PYXIS_STANDIN.replace("REAL_SRUN", real).replace("RECORD", str(record)))
    (bin_dir / "srun").chmod(0o755)
    image = "nvcr.io/nvidia/nemo-rl:v0.4.0"
    container = {"image": image, "mounts": ["/work:/work", "/tmp:/tmp"]}
    spec = spec_file(tmp_path, slurm__container=container)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [RL_LAUNCH, "check", str(spec), "--timeout", "300"],
        capture_output=True,
        text=True,
        timeout=420,
        env=env,
    )
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stdout
    assert f"ok    container runtime: srun has pyxis's --container-image (image {image})" in proc.stdout
    assert "without the container" not in proc.stdout
    steps = sorted(line.split() for line in record.read_text().splitlines())
    assert [s[0].rsplit("-", 1)[0] for s in steps] == [
        "rl-launch-check-generation",
        "rl-launch-check-training",
    ]
    assert all(
        s[1:] == [f"--container-image={image}", "--container-mounts=/work:/work,/tmp:/tmp"] for s in steps
    )
    no_probe_left(tmp_path / "jobs")
