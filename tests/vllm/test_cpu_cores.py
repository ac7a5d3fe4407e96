"""Local vLLM CPU engines each compute on cores of their own, also after a restart (real vLLM, a real job).

Before: vLLM's "auto" OpenMP binding made every engine of a node log "core ids=[0] reserved_cpus=[1]"
and ``taskset`` showed both workers on core 0 (the other core idle); the same requests took twice as
long on one engine as on the other, and a restarted engine's worker got no CPU for minutes. The engine
host now gives each CPU engine a disjoint share of its cores (``launcher.engines.cores``) and binds its
OpenMP threads there (``launcher.engines.vllm.cpu``). Measured with ``bench/cpu_engines.py``.

Cost: one local job of 2 engines (~70-90 s to start on 2 cores) and one engine restart (~40-60 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from launcher.jobdir import JobDir
from tests.support.cli import RL_LAUNCH
from tests.support.engine_cores import Proc, group_processes, log_binding, server_pgid, workers
from tests.support.running_job import job_leftovers, wait_for

ROOT = Path(__file__).resolve().parents[2]


def _engines(job: JobDir) -> list[tuple[str, int, Path, int]]:
    """(id, port, log, generation) of every listed, healthy engine."""
    return [
        (e.id, int(e.url.rsplit(":", 1)[1]), Path(e.log), e.generation)
        for listing in job.listings()
        for e in listing.engines
        if e.url and not e.error
    ]


def _seen(port: int, log: Path) -> tuple[set[int], list[Proc]] | None:
    """The cores vLLM's log says it bound (all ranks) and the engine's processes, once its worker runs."""
    binding = log_binding(log)
    pgid = server_pgid(port)
    procs = group_processes(pgid) if pgid else []
    if binding is None or not workers(procs):
        return None
    return {c for cores in binding.rank_cores.values() for c in cores}, procs


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.timeout(600)
def test_each_cpu_engine_computes_on_cores_of_its_own(
    tmp_path: Path, vllm_python: str, tiny_model_dir: Path
) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"one core here ({cores}): two engines cannot have cores of their own")
    done = tmp_path / "done"
    spec = {
        "name": "cores",
        "cluster": "local",
        "job_root": str(tmp_path / "jobs"),
        "training": {"command": f"timeout 480 sh -c 'while [ ! -e {done} ]; do sleep 0.5; done'"},
        "generation": {
            "engine": "vllm",
            "model": str(tiny_model_dir),
            "served_model_name": "tiny",
            "engines_per_node": 2,
            "startup_timeout_s": 300,
            "vllm_args": ["--max-model-len=512", "--enforce-eager"],
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        },
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = dict(os.environ, RL_LAUNCH_VLLM_PYTHON=vllm_python)
    proc = subprocess.Popen(
        [RL_LAUNCH, "submit", str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    failure: AssertionError | None = None
    try:
        job_path = wait_for(
            lambda: next((tmp_path / "jobs").glob("*/engines"), None), 60, "the job dir"
        ).parent
        job = JobDir(job_path)
        wait_for(lambda: len(_engines(job)) == 2, 400, "two healthy engines")
        seen, report = {}, []
        for eid, port, log, _ in _engines(job):
            seen[eid] = wait_for(lambda p=port, lg=log: _seen(p, lg), 60, f"{eid}'s worker")
            report.append(f"{eid}: log {log_binding(log).line()}")  # type: ignore[union-attr]
            report += [f"  pid {p.pid} {p.title[:30]} affinity {p.affinity}" for p in seen[eid][1]]
        shown = "\n".join(report)
        print("\n" + shown)
        (_, (bound_a, procs_a)), (b, (bound_b, procs_b)) = sorted(seen.items())
        # vLLM's own log: each engine bound its OpenMP threads to cores the other did not.
        assert bound_a and bound_b and not bound_a & bound_b, shown
        # The kernel's view (taskset): every thread of each engine's processes runs within its share, and
        # the two shares do not meet; each worker's main thread (OpenMP's first) is where the log says.
        share_a = {c for p in procs_a for c in p.affinity}
        share_b = {c for p in procs_b for c in p.affinity}
        assert not share_a & share_b and share_a | share_b <= set(cores), shown
        for bound, procs in ((bound_a, procs_a), (bound_b, procs_b)):
            for w in workers(procs):
                assert set(w.threads[w.pid]) <= bound, shown

        # A restarted engine starts on its own share again (before, on the core the other engine's
        # worker was computing on). SIGKILL its whole group: the fleet controller restarts it.
        port_b = next(port for i, port, _, _ in _engines(job) if i == b)
        pgid_b = server_pgid(port_b)
        assert pgid_b is not None
        os.killpg(pgid_b, signal.SIGKILL)
        t0 = time.monotonic()
        wait_for(lambda: any(i == b and g >= 1 for i, _, _, g in _engines(job)), 300, f"{b} restarted")
        _, port_b2, log_b, _ = next(e for e in _engines(job) if e[0] == b)
        bound_b2, procs_b2 = wait_for(lambda: _seen(port_b2, log_b), 60, f"restarted {b}'s worker")
        print(f"{b} restarted in {time.monotonic() - t0:.0f} s: log {log_binding(log_b).line()}")  # type: ignore[union-attr]
        assert bound_b2 == bound_b and {c for p in procs_b2 for c in p.affinity} == share_b
    except AssertionError as exc:
        failure = exc
    finally:
        done.touch()
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    if failure is not None:
        raise AssertionError(f"{failure}\n--- rl-launch submit ---\n{out[-3000:]}") from failure
    assert proc.returncode == 0, out[-3000:]
    assert wait_for(lambda: job_leftovers(job_path) == [], 30, "the job's processes to end")
