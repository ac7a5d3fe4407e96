"""The local multi-node Slurm cluster (``slurm/cluster.sh``) behaves like a real one.

These tests talk to a real slurmctld/slurmdbd and one slurmd per node; they run on the cluster's login
node and are skipped anywhere else::

    slurm/cluster.sh start
    slurm/cluster.sh exec .venv/bin/python -m pytest -m slurm tests/slurm/test_slurm_cluster.py

What is checked: multi-node ``sbatch --wait`` (each node its own hostname and address), heterogeneous
jobs, submitit, accounting through ``sacct``, and a 2-node Ray cluster inside one job that leaves no Ray
process behind on any node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.slurm import _slurm_unreachable, node_namespace_processes

pytestmark = pytest.mark.slurm

VENV_BIN = Path(sys.executable).parent
# Jobs finished by the tests below, for the sacct check: (job id, what it was).
FINISHED_JOBS: list[tuple[str, str]] = []


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> None:
    reason = _slurm_unreachable()
    if reason:
        pytest.skip(
            f"no Slurm cluster reachable: {reason}. Run `slurm/cluster.sh start`, then the tests on its "
            "login node: `slurm/cluster.sh exec .venv/bin/python -m pytest -m slurm`"
        )


def run(*cmd: str, timeout: float = 60) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def sbatch_wait(
    script: str, tmp_path: Path, what: str, timeout: float = 60, poll: bool = False
) -> tuple[str, str]:
    """Submit ``script`` and wait for the job to end; return (job id, the job's output).

    ``sbatch --wait`` is what a user types, but Slurm 22.05 re-checks the job after 2, 10, 42, 74... s,
    so a 16 s job returns after 42 s. ``poll=True`` asks squeue every 0.5 s instead (for longer jobs).
    """
    path = tmp_path / "job.sh"
    out = tmp_path / "job.out"
    path.write_text(textwrap.dedent(script).lstrip())
    cmd = ["sbatch", "--parsable", f"--output={out}", f"--chdir={tmp_path}", str(path)]
    if not poll:
        cmd.insert(1, "--wait")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    job_id = proc.stdout.strip().split(";")[0]
    if poll and proc.returncode == 0:
        deadline = time.monotonic() + timeout
        while True:
            states = set(run("squeue", "-h", "-t", "all", "-j", job_id, "-o", "%T").split())
            if states and states <= TERMINAL_STATES:
                break
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], check=False)
                pytest.fail(f"{what}: job {job_id} still {states} after {timeout} s")
            time.sleep(0.5)
        if states != {"COMPLETED"}:
            proc.returncode = 1
            proc.stderr = f"job {job_id} ended {states}"
    output = out.read_text() if out.exists() else "(no output file)"
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}, {proc.stderr}\n--- output:\n{output}"
    FINISHED_JOBS.append((job_id, what))
    return job_id, output


def sinfo_nodes() -> list[str]:
    return sorted(set(run("sinfo", "-h", "-N", "-o", "%N").split()))


def hostnames(nodelist: str) -> list[str]:
    return run("scontrol", "show", "hostnames", nodelist).split()


# ------------------------------------------------------------------------------------------------- (a)


def test_multinode_sbatch_runs_on_distinct_hosts(tmp_path: Path) -> None:
    assert len(sinfo_nodes()) >= 3, "these tests need a cluster of at least 3 nodes"
    _, output = sbatch_wait(
        """
        #!/bin/bash
        #SBATCH --nodes=3
        #SBATCH --ntasks-per-node=1
        #SBATCH --time=2
        srun bash -c 'echo "task $SLURM_PROCID $(hostname) $(hostname -i) $SLURMD_NODENAME"'
        """,
        tmp_path,
        "3-node sbatch",
    )
    tasks = [line.split()[1:] for line in output.splitlines() if line.startswith("task ")]
    assert len(tasks) == 3, output
    ranks = {t[0] for t in tasks}
    hosts = {t[1] for t in tasks}
    ips = {t[2] for t in tasks}
    assert ranks == {"0", "1", "2"}
    assert len(hosts) == 3 and len(ips) == 3, f"steps did not run on 3 different nodes:\n{output}"
    for _, host, ip, slurm_name in tasks:
        assert host == slurm_name, "a node's hostname must equal its Slurm node name"
        assert not ip.startswith("127."), f"{host} resolves to loopback ({ip})"


def test_fake_gpus_set_cuda_visible_devices(tmp_path: Path) -> None:
    gres = run("sinfo", "-h", "-N", "-o", "%G")
    per_node = [int(m.group(1)) for m in re.finditer(r"gpu:(\d+)", gres)]
    if not per_node or min(per_node) < 1:
        pytest.skip("the cluster has no fake GPUs (RL_SLURM_GPUS=0)")
    gpus = min(per_node)
    out = run(
        "srun",
        "--nodes=2",
        "--ntasks-per-node=1",
        f"--gpus-per-node={gpus}",
        "--time=1",
        "bash",
        "-c",
        'echo "$(hostname) $CUDA_VISIBLE_DEVICES"',
    )
    seen = dict(line.split() for line in out.splitlines())
    assert len(seen) == 2, out
    assert set(seen.values()) == {",".join(str(i) for i in range(gpus))}, out


# ------------------------------------------------------------------------------------------------- (b)


def test_hetjob_generation_group_runs_on_its_own_nodes(tmp_path: Path) -> None:
    _, output = sbatch_wait(
        """
        #!/bin/bash
        #SBATCH --job-name=het-train
        #SBATCH --nodes=1 --ntasks-per-node=1 --time=2
        #SBATCH hetjob
        #SBATCH --job-name=het-gen
        #SBATCH --nodes=2 --ntasks-per-node=1
        echo "group0 $SLURM_JOB_NODELIST_HET_GROUP_0"
        echo "group1 $SLURM_JOB_NODELIST_HET_GROUP_1"
        srun --het-group=1 bash -c 'echo "gen $(hostname)"'
        """,
        tmp_path,
        "hetjob 1+2",
    )
    groups = dict(line.split(maxsplit=1) for line in output.splitlines() if line.startswith("group"))
    train_nodes = hostnames(groups["group0"])
    gen_nodes = hostnames(groups["group1"])
    assert len(train_nodes) == 1 and len(gen_nodes) == 2, output
    assert not set(train_nodes) & set(gen_nodes), output
    ran_on = sorted(line.split()[1] for line in output.splitlines() if line.startswith("gen "))
    assert ran_on == sorted(gen_nodes), f"--het-group=1 must run on the generation nodes only:\n{output}"


# ------------------------------------------------------------------------------------------------- (c)


def _report_task() -> dict:
    """Runs on the nodes through submitit (pickled by value: the nodes cannot import this test module)."""
    import socket

    import submitit

    env = submitit.JobEnvironment()
    return {
        "hostname": env.hostname,
        "uname": socket.gethostname(),
        "global_rank": env.global_rank,
        "num_tasks": env.num_tasks,
        "num_nodes": env.num_nodes,
        "node": env.node,
        "hostnames": env.hostnames,
    }


def test_submitit_multitask_job(tmp_path: Path) -> None:
    import cloudpickle
    import submitit

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        executor = submitit.AutoExecutor(folder=tmp_path / "submitit" / "%j")
        assert executor.cluster == "slurm"
        executor.update_parameters(
            nodes=3,
            tasks_per_node=1,
            cpus_per_task=1,
            timeout_min=5,
            slurm_partition="debug",
            name="submitit-3tasks",
        )
        job = executor.submit(_report_task)
        results = job.results()  # one per task; job.result() asserts a single task
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    FINISHED_JOBS.append((job.job_id, "submitit 3 tasks"))
    assert sorted(r["global_rank"] for r in results) == [0, 1, 2]
    assert {r["num_tasks"] for r in results} == {3}
    assert {r["num_nodes"] for r in results} == {3}
    names = {r["hostname"] for r in results}
    assert len(names) == 3, results
    assert all(r["hostname"] == r["uname"] for r in results)
    assert sorted(results[0]["hostnames"]) == sorted(names)
    # submitit reads the state through sacct (accounting); allow the record a moment to arrive.
    deadline = time.monotonic() + 20
    while job.state != "COMPLETED" and time.monotonic() < deadline:
        time.sleep(1)
    assert job.state == "COMPLETED"


# ------------------------------------------------------------------------------------------------- (e)

RAY_JOB = """\
#!/bin/bash
#SBATCH --job-name=ray-2nodes
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --time=3
# A Ray cluster inside one allocation, the way rl-launch starts one: the head on the first node, a worker
# on every other node, each binding its own node's address; the driver runs on the head node.
set -euo pipefail
# Ray >= 2.5x turns token authentication on by itself once ~/.ray/auth_token exists (any earlier local
# ray.init() writes it), and workers joining with `ray start --address` then fail with InvalidAuthToken.
# The traffic stays inside the cluster's private network: pin the mode so the test does not depend on $HOME.
export RAY_AUTH_MODE={auth_mode} RAY_USAGE_STATS_ENABLED=0 RAY_DEDUP_LOGS=0
RAY={ray}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=${{NODES[0]}}
HEAD_IP=$(getent hosts "$HEAD" | awk '{{print $1}}')
PORT=6379
COMMON="--block --num-cpus=1 --num-gpus=0 --object-store-memory=100000000 --disable-usage-stats"

stop_ray() {{  # on every node of the job: leave nothing behind, whatever happened
  srun --overlap --nodes=$SLURM_JOB_NUM_NODES --ntasks-per-node=1 $RAY stop --force >/dev/null 2>&1 || true
  wait || true
}}
trap stop_ray EXIT

srun --overlap --nodes=1 --ntasks=1 -w "$HEAD" bash -c \\
  "exec $RAY start --head --node-ip-address=\\$(hostname -i) --port=$PORT --include-dashboard=false $COMMON" &
for _ in $(seq 1 120); do (exec 3<>"/dev/tcp/$HEAD_IP/$PORT") 2>/dev/null && break; sleep 0.5; done
for worker in "${{NODES[@]:1}}"; do
  srun --overlap --nodes=1 --ntasks=1 -w "$worker" bash -c \\
    "exec $RAY start --address=$HEAD_IP:$PORT --node-ip-address=\\$(hostname -i) $COMMON" &
done
echo "head $HEAD $HEAD_IP"
{python} {driver} "$HEAD_IP:$PORT" "$SLURM_JOB_NUM_NODES" {result}
"""

RAY_DRIVER = """\
import json, sys, time
import ray

address, want, result = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ray.init(address=address, logging_level="WARNING")
deadline = time.monotonic() + 90
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want or time.monotonic() > deadline:
        break
    time.sleep(0.5)

@ray.remote(num_cpus=1)
def where():
    import socket
    return socket.gethostname()

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

pinned = [
    where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)) for n in alive
]
hosts = sorted(ray.get([task.remote() for task in pinned]))
addresses = sorted(n["NodeManagerAddress"] for n in alive)
with open(result, "w") as f:
    json.dump({"alive": len(alive), "addresses": addresses, "task_hosts": hosts}, f)
ray.shutdown()
"""


# raylet, gcs_server, workers ("ray::IDLE"), the agents and monitors, the `ray` CLI (`ray start --block`)
RAY_PROCESS = re.compile(
    r"raylet|gcs_server|ray::|default_worker\.py|/ray/(_private|dashboard|autoscaler)/|bin/ray "
)


def _ray_processes_in_node_namespaces() -> list[str]:
    """Ray processes (raylet, gcs_server, workers...) running in any node namespace of the local cluster."""
    procs = node_namespace_processes()
    return [f"{p.pid}: {p.cmdline[:150]}" for p in procs if RAY_PROCESS.search(p.cmdline)]


def test_two_node_ray_cluster_inside_one_job(tmp_path: Path) -> None:
    if not os.environ.get("RL_SLURM_NODE_NETNS"):
        pytest.skip("RL_SLURM_NODE_NETNS not set: run the tests through `slurm/cluster.sh exec`")
    driver = tmp_path / "driver.py"
    driver.write_text(RAY_DRIVER)
    result = tmp_path / "ray.json"
    script = RAY_JOB.format(
        ray=VENV_BIN / "ray",
        python=sys.executable,
        driver=driver,
        result=result,
        auth_mode=os.environ.get("RL_TEST_RAY_AUTH_MODE", "disabled"),
    )
    _, output = sbatch_wait(script, tmp_path, "2-node Ray", timeout=150, poll=True)
    report = json.loads(result.read_text())
    assert report["alive"] == 2, f"{report}\n{output}"
    assert len(set(report["addresses"])) == 2 and not any(a.startswith("127.") for a in report["addresses"])
    assert len(set(report["task_hosts"])) == 2, report
    # Slurm has ended the job; nothing of Ray may survive on any node.
    deadline = time.monotonic() + 10
    while (left := _ray_processes_in_node_namespaces()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, "Ray processes left on the nodes after the job:\n" + "\n".join(left)


# ------------------------------------------------------------------------------------------------- (d)


def test_sacct_sees_finished_jobs(tmp_path: Path) -> None:
    """Runs last: every job the tests above finished must be COMPLETED in the accounting database."""
    if not FINISHED_JOBS:  # run on its own: make a job to look for
        sbatch_wait("#!/bin/bash\n#SBATCH --nodes=1 --time=1\nhostname\n", tmp_path, "1-node sbatch")
    wanted = {job_id: what for job_id, what in FINISHED_JOBS}
    deadline = time.monotonic() + 30
    while True:
        out = run("sacct", "-X", "-n", "-P", "-o", "JobID,JobName,State,NNodes", "-j", ",".join(wanted))
        states: dict[str, set[str]] = {}
        for line in out.splitlines():
            job_id, _name, state, _nnodes = line.split("|")
            # a heterogeneous job is listed per component: 12+0, 12+1
            states.setdefault(job_id.split("+")[0], set()).add(state.split()[0])
        if all(states.get(j) == {"COMPLETED"} for j in wanted) or time.monotonic() > deadline:
            break
        time.sleep(1)
    for job_id, what in wanted.items():
        got = states.get(job_id)
        assert got == {"COMPLETED"}, f"sacct for {what} (job {job_id}): {got}\n{out}"
