"""``rl-launch submit`` end to end on the real local Slurm cluster (1 training + 2 generation nodes).

Runs on the cluster's login node (``slurm/cluster.sh exec .venv/bin/python -m pytest -m slurm``); skipped
elsewhere, and failed instead of skipped in CI. Each test submits through the CLI exactly as a user
would, then checks the job directory, Slurm's view, and every node namespace for leftovers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from tests.support.cli import RL_LAUNCH
from tests.support.slurm import (
    FAULT_GENERATION,
    job_dir_of,
    job_id_of,
    leftovers,
    slurm_cluster,  # noqa: F401 (autouse: skips the module without a cluster)
    squeue_empty,
    submit,
    wait_no_leftovers,
    write_spec,
)

pytestmark = pytest.mark.slurm

# The "training command": reads the Gym overlay like a Gym config would, replays multi-turn sessions
# through policy_base_url, and writes what it saw into the job directory.
TRAINER = textwrap.dedent(
    """\
    import json, os, subprocess, sys, yaml
    overlay = yaml.safe_load(open(os.environ["RL_GYM_OVERLAY"]))
    out = os.path.join(os.environ["RL_JOB_DIR"], "trainer")
    os.makedirs(out, exist_ok=True)
    json.dump({"policy_base_url": overlay["policy_base_url"], "model": overlay["policy_model_name"],
               "env_url": os.environ["RL_POLICY_BASE_URL"]}, open(os.path.join(out, "seen.json"), "w"))
    files = [f"--{kind}={os.path.join(out, 'replay.' + kind)}" for kind in ("json", "csv", "png")]
    # the engines from the job directory: the router's GET /workers takes the admin token, which a
    # rollout worker does not hold
    from launcher.jobdir import JobDir
    engines = [x for e in JobDir(os.environ["RL_JOB_DIR"]).engine_entries() for x in ("--engine-url", e.url)]
    rc = subprocess.call(["rl-launch", "bench", "replay", "--url", overlay["policy_base_url"],
                          "--workload", "longtail", "--scale", "0.03", *engines, *files])
    sys.exit(rc)
    """
)


def test_sim_job_end_to_end(tmp_path: Path) -> None:
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER)
    spec = write_spec(tmp_path, "e2e-sim", f"{sys.executable} {trainer}")
    t_submit = time.time()
    proc = submit(spec, "--follow")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_dir_of(proc.stdout)
    result = json.loads((job / "result.json").read_text())
    assert result["exit_code"] == 0, result
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    phases = [e["phase"] for e in events]
    for phase in ("starting", "ray_up", "engines_ready", "router_serving", "training", "finished"):
        assert phase in phases, phases
    start = next(e for e in events if e["phase"] == "starting")
    training_nodes, generation_nodes = start["nodes"]["training"], start["nodes"]["generation"]
    assert len(training_nodes) == 1 and len(generation_nodes) == 2
    assert "3 Ray node(s) alive" in next(e for e in events if e["phase"] == "ray_up")["detail"]
    # engines ran on the generation nodes only
    engine_nodes = {
        e["node"]
        for f in (job / "engines").glob("node-*.urls.json")
        for e in json.loads(f.read_text())["engines"]
    }
    assert engine_nodes == set(generation_nodes)
    # the overlay (and the env) point at the router, and the trainer used them
    router_url = next(e for e in events if e["phase"] == "router_serving")["router_url"]
    seen = json.loads((job / "trainer" / "seen.json").read_text())
    assert seen["policy_base_url"] == seen["env_url"] == router_url + "/v1"
    assert seen["model"] == "sim-8b"
    replay = json.loads((job / "trainer" / "replay.json").read_text())["rows"][0]
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"] > 0
    assert sum(replay["engine_requests"]) > 0
    # the key is in the 0600 secret and overlay only: not in any log, not in the saved spec
    key = (job / "secrets" / "api_key").read_text().strip()
    assert oct((job / "secrets" / "api_key").stat().st_mode)[-3:] == "600"
    assert oct((job / "gym_overlay.yaml").stat().st_mode)[-3:] == "600"
    for f in job.rglob("*"):
        if f.is_file() and f.name not in ("api_key", "gym_overlay.yaml"):
            assert key not in f.read_text(errors="replace"), f"API key leaked into {f}"
    admin = job / "secrets" / "admin_token"  # the router's own token, separate from the client key
    assert oct(admin.stat().st_mode)[-3:] == "600" and admin.read_text().strip() != key
    for f in job.rglob("*"):
        if f.is_file() and f != admin:
            assert admin.read_text().strip() not in f.read_text(errors="replace"), f"admin token in {f}"
    for f in (tmp_path / "jobs").rglob("*"):  # the submitit/Slurm logs too
        if f.is_file() and f.suffix in (".out", ".err", ".log"):
            assert key not in f.read_text(errors="replace"), f"API key leaked into {f}"
    assert squeue_empty()
    assert wait_no_leftovers() == []
    # figures for the note: submit -> router serving, split by phase
    queued = start["t"] - t_submit
    ray_up = next(e for e in events if e["phase"] == "ray_up")["t"] - start["t"]
    serving = next(e for e in events if e["phase"] == "router_serving")["t"] - t_submit
    print(
        f"\nsubmit->router serving {serving:.1f}s: queue+driver start {queued:.1f}s, Ray {ray_up:.1f}s, "
        f"timings {result['timings']}"
    )


def test_sbatch_refusal_is_surfaced_and_nothing_submitted(tmp_path: Path) -> None:
    spec = write_spec(
        tmp_path, "bad-part", "true", slurm={"partition": "no-such-partition", "time": "00:05:00"}
    )
    proc = submit(spec)
    assert proc.returncode != 0
    assert "sbatch refused the job" in proc.stderr and "partition" in proc.stderr.lower(), proc.stderr
    assert squeue_empty()


def test_engine_that_never_starts_fails_the_job_with_its_log(tmp_path: Path) -> None:
    # a killed simulator listens nowhere: the engine host misses the startup deadline
    spec = write_spec(
        tmp_path,
        "dead-engine",
        "true",
        generation={
            "nodes": 2,
            "engine": "sim",
            "engines_per_node": 1,
            "startup_timeout_s": 15,
            "sim": {"fault": "kill"},
        },
    )
    t0 = time.monotonic()
    proc = submit(spec, "--follow")
    took = time.monotonic() - t0
    assert proc.returncode != 0
    job = job_dir_of(proc.stdout)
    result = json.loads((job / "result.json").read_text())
    assert "engines on node" in result["reason"] and "deadline" in result["reason"], result["reason"]
    assert "log tail" in result["reason"] and "SIM_URL" in result["reason"]  # the engine's own log
    assert took < 15 + 120, f"took {took:.0f} s"
    assert squeue_empty()
    assert wait_no_leftovers() == []


def test_training_exit_code_propagates_and_teardown_runs(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "train-fails", "echo training breaks; exit 7")
    proc = submit(spec, "--follow")
    assert proc.returncode == 7, proc.stdout + proc.stderr
    job = job_dir_of(proc.stdout)
    result = json.loads((job / "result.json").read_text())
    assert result["exit_code"] == 7 and "teardown_s" in result["timings"]
    state = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "State", "-j", job.name.rsplit("-", 1)[1]],
        capture_output=True,
        text=True,
    ).stdout
    assert "FAILED" in state
    assert squeue_empty()
    assert wait_no_leftovers() == []


def wait_training(job: Path, timeout_s: float = 120) -> dict[str, object]:
    """The job state once the training command runs and the fleet controller has judged the engines."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = json.loads((job / "state.json").read_text()) if (job / "state.json").exists() else {}
        if state.get("phase") == "training" and state.get("fleet"):
            return state
        assert time.monotonic() < deadline, f"job never reached training: {state}"
        time.sleep(0.3)


def read_events(job: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if x.strip()]


def test_cancel_mid_run_tears_down(tmp_path: Path) -> None:
    """``rl-launch cancel`` is scancel: every node cleared, the result recorded as cancelled by SIGTERM
    (not a Ray stack dump), the state final. Prints the figures the README quotes."""
    spec = write_spec(tmp_path, "to-cancel", "sleep 600")
    proc = submit(spec)
    assert proc.returncode == 0, proc.stderr
    job = job_dir_of(proc.stdout)
    wait_training(job)
    root = str(tmp_path / "jobs")
    t0 = time.monotonic()
    cancel = subprocess.run(
        [RL_LAUNCH, "cancel", job.name, "--root", root, "--no-wait"], capture_output=True, text=True
    )
    assert cancel.returncode == 0, cancel.stderr
    recorded = None
    deadline = time.monotonic() + 60
    while not squeue_empty() or leftovers():
        if recorded is None and (job / "result.json").exists():
            recorded = time.monotonic() - t0
        assert time.monotonic() < deadline, f"still running 60 s after cancel: {leftovers()}"
        time.sleep(0.1)
    clear = time.monotonic() - t0
    result = json.loads((job / "result.json").read_text())
    recorded = recorded if recorded is not None else clear
    assert (result["outcome"], result["signal"], result["exit_code"]) == ("cancelled", "SIGTERM", 143), result
    state = json.loads((job / "state.json").read_text())
    assert state["phase"] == "cancelled" and state["torn_down"] is True, state
    assert {e["state"] for e in state["fleet"]["engines"]} == {"STOPPED"}
    assert result["torn_down"] is True  # within Slurm's KillWait (5 s on this cluster)
    listing = subprocess.run([RL_LAUNCH, "list", "--json", "--root", root], capture_output=True, text=True)
    row = next(r for r in json.loads(listing.stdout) if r["job"] == job.name)
    assert row["phase"] == "cancelled" and row["slurm"].startswith("CANCELLED"), row
    print(
        f"\nslurm scancel: result recorded {recorded:.2f} s, nothing running on any node {clear:.2f} s, "
        f"final: {result['torn_down']} (teardown {result['timings'].get('teardown_s')} s)"
    )


def test_time_limit_is_recorded_and_the_fleet_lives_until_it(tmp_path: Path) -> None:
    """A two-minute job: the engines and Ray must not die of the time-limit warning (submitit signals
    every step 90 s before the limit, i.e. at once here), and at the limit the driver records it. Two
    minutes, not one: the driver is warned 30 s ahead, and under CI's load a one-minute job (warned at
    45 s) was once warned before its fleet was up (Ray's start alone took 16 s)."""
    spec = write_spec(
        tmp_path,
        "short-limit",
        "sleep 600",
        slurm={"partition": "debug", "time": "00:02:00", "cpus_per_task": 2, "gpus_per_node": 0},
    )
    proc = submit(spec)
    assert proc.returncode == 0, proc.stderr
    job = job_dir_of(proc.stdout)
    wait_training(job)
    deadline = time.monotonic() + 180
    while not squeue_empty():
        assert time.monotonic() < deadline, "the two-minute job outlived its limit by two minutes"
        time.sleep(1)
    assert wait_no_leftovers() == []
    result = json.loads((job / "result.json").read_text())
    # Stopped in order before the limit: by Slurm's warning to the batch shell (--signal=B:USR2 a quarter
    # of a short limit ahead: 30 s here), or, were that signal lost, by the driver's own deadline
    # (stop_margin_s: 12 s ahead, exit 124). Either is the time limit, recorded and torn down.
    assert (result["outcome"], result["torn_down"]) == ("time limit", True), result
    assert (result["exit_code"], result["signal"]) in ((140, "SIGUSR2"), (124, None)), result
    state = json.loads((job / "state.json").read_text())
    assert state["phase"] == "cancelled" and {e["state"] for e in state["fleet"]["engines"]} == {"STOPPED"}
    events = read_events(job)
    assert not [e for e in events if e["phase"] == "engine_host_died"], events
    assert not [e for e in events if e["phase"] == "fleet" and e.get("to_state") == "DEAD"], events
    print(f"\nslurm time limit: {result['reason']}; teardown {result['timings']['teardown_s']} s")


def test_warning_signal_spares_the_steps_and_stops_the_driver(tmp_path: Path) -> None:
    """SIGUSR2 to every step (what submitit's --signal=USR2@90 does) leaves Ray and the engines up;
    SIGUSR2 to the driver is its cue: time limit, torn down in order. (``scancel --full`` signals the
    batch shell's children too; the batch shell itself dies of it, so Slurm ends the job meanwhile.)"""
    spec = write_spec(tmp_path, "usr2", "sleep 600")
    proc = submit(spec)
    assert proc.returncode == 0, proc.stderr
    job = job_dir_of(proc.stdout)
    wait_training(job)
    job_id = job_id_of(job)
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=10)
    time.sleep(5)
    state = json.loads((job / "state.json").read_text())
    assert state["phase"] == "training"
    assert {e["state"] for e in state["fleet"]["engines"]} == {"HEALTHY"}, state["fleet"]["engines"]
    assert not [e for e in read_events(job) if e["phase"] in ("engine_host_died", "failed")]
    t0 = time.monotonic()
    subprocess.run(["scancel", "--signal=USR2", "--full", job_id], check=True, timeout=10)
    deadline = time.monotonic() + 60
    while not squeue_empty() or leftovers():
        assert time.monotonic() < deadline, f"still running 60 s after the warning: {leftovers()}"
        time.sleep(0.2)
    clear = time.monotonic() - t0
    result = json.loads((job / "result.json").read_text())
    assert (result["outcome"], result["signal"], result["exit_code"]) == ("time limit", "SIGUSR2", 140), (
        result
    )
    state = json.loads((job / "state.json").read_text())
    assert state["phase"] == "cancelled" and {e["state"] for e in state["fleet"]["engines"]} == {"STOPPED"}
    print(f"\nslurm SIGUSR2 to the driver: nothing running after {clear:.2f} s, final {result['torn_down']}")


# Waits for the driver to report a dead engine host and readmit its engines; exits 0 when it has.
HOST_WATCHER = textwrap.dedent(
    """\
    import os, sys, time
    from launcher.jobdir import JobDir  # its readers skip a line being appended (a raw json.loads did not)
    job = JobDir(os.environ["RL_JOB_DIR"])
    deadline = time.time() + 240
    while time.time() < deadline:
        died = [e for e in job.read_events() if e["phase"] == "engine_host_died"]
        fleet = job.read_state().get("fleet", {})
        engines = fleet.get("engines", [])
        if died and engines and all(e["state"] == "HEALTHY" for e in engines) and all(
                e["previous_urls"] for e in engines if e["id"].startswith("node%d-" % died[0]["node_index"])):
            sys.exit(0)
        time.sleep(0.5)
    sys.exit(1)
    """
)


def test_killed_engine_host_step_is_reported_and_restarted(tmp_path: Path) -> None:
    watcher = tmp_path / "watcher.py"
    watcher.write_text(HOST_WATCHER)
    spec = write_spec(tmp_path, "host-kill", f"{sys.executable} {watcher}")
    proc = submit(spec)
    assert proc.returncode == 0, proc.stderr
    job = job_dir_of(proc.stdout)
    state = wait_training(job)
    job_id = job_id_of(job)
    victim_node = state["nodes"]["generation"][0]  # type: ignore[index]
    steps = subprocess.run(
        ["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    step = next(line.split()[0] for line in steps if line.strip().endswith(f"engines-{victim_node}"))
    t0 = time.time()
    subprocess.run(["scancel", step], check=True, timeout=10)
    result = wait_result(job, timeout_s=300)
    assert result["exit_code"] == 0 and result["outcome"] == "finished", result
    events = read_events(job)
    died = next(e for e in events if e["phase"] == "engine_host_died")
    assert died["node_index"] == 0 and died["engines"] == ["node0-0", "node0-1"]
    restart = next(e for e in events if e["phase"] == "engine_host_restart")
    back = [
        e for e in events if e["phase"] == "engine_restarted" and str(e["engine_id"]).startswith("node0-")
    ]
    assert len(back) == 2
    healthy = [
        e
        for e in events
        if e["phase"] == "fleet"
        and e.get("to_state") == "HEALTHY"
        and str(e["engine_id"]).startswith("node0-")
    ]
    assert len(healthy) >= 2
    assert "exited with" in (job / "driver.log").read_text()
    assert squeue_empty()
    assert wait_no_leftovers() == []
    print(
        f"\nslurm engine-host step killed: reported {died['t'] - t0:.1f} s, host restarted "
        f"{restart['t'] - t0:.1f} s, engines readmitted {max(e['t'] for e in healthy) - t0:.1f} s"
    )


@pytest.mark.vllm
@pytest.mark.timeout(720)  # above the submit's own 600 s, so that a slow job still shows its logs
def test_one_real_vllm_cpu_engine(tmp_path: Path, vllm_python: str, tiny_model_dir: Path) -> None:
    trainer = tmp_path / "trainer.py"
    trainer.write_text(
        textwrap.dedent(
            """\
            import json, os, urllib.request
            base, key = os.environ["RL_POLICY_BASE_URL"], os.environ["RL_POLICY_API_KEY"]
            messages = [{"role": "system", "content": "You are terse. " * 40}]
            for turn in range(3):
                messages.append({"role": "user", "content": f"turn {turn}: " + "tell me more. " * 30})
                body = {"model": os.environ["RL_POLICY_MODEL_NAME"], "messages": messages, "max_tokens": 4,
                        "ignore_eos": True}
                req = urllib.request.Request(base + "/chat/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json",
                                                      "Authorization": "Bearer " + key})
                reply = json.load(urllib.request.urlopen(req, timeout=120))
                messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
            json.dump({"turns": 3}, open(os.path.join(os.environ["RL_JOB_DIR"], "vllm-ok.json"), "w"))
            """
        )
    )
    env_generation = {
        "nodes": 1,
        "engine": "vllm",
        "model": str(tiny_model_dir),
        "served_model_name": "tiny",
        "engines_per_node": 1,
        "allow_cpu": True,
        "startup_timeout_s": 400,
        "vllm_args": ["--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager"],  # as on CPU
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"},
    }
    spec = write_spec(tmp_path, "e2e-vllm", f"{sys.executable} {trainer}", generation=env_generation)
    env = dict(os.environ, RL_LAUNCH_VLLM_PYTHON=vllm_python)
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [RL_LAUNCH, "submit", str(spec), "--follow"], capture_output=True, text=True, timeout=600, env=env
        )
    except subprocess.TimeoutExpired as exc:
        files = sorted((tmp_path / "jobs").rglob("*.log"))
        logs = "".join(f"\n== {f}\n{f.read_text(errors='replace')[-4000:]}" for f in files)
        raise AssertionError(f"submit --follow still running after {exc.timeout} s:{logs}") from exc
    print(f"\nslurm job with one real vLLM CPU engine: {time.monotonic() - t0:.0f} s")
    job = job_dir_of(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr + (job / "driver.log").read_text(errors="replace")
    assert (job / "vllm-ok.json").exists()
    assert squeue_empty()
    assert wait_no_leftovers() == []


def wait_result(job: Path, timeout_s: float = 240) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while not (job / "result.json").exists():
        assert time.monotonic() < deadline, f"no result.json in {job} after {timeout_s:g} s"
        time.sleep(0.5)
    deadline = time.monotonic() + 60
    while not squeue_empty():
        assert time.monotonic() < deadline, "job still in squeue a minute after its driver finished"
        time.sleep(0.5)
    return json.loads((job / "result.json").read_text())


def test_rendered_script_submitted_by_hand_behaves_like_submit(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "by-hand", 'test -s "$RL_GYM_OVERLAY" && test -n "$RL_POLICY_API_KEY"')
    script = tmp_path / "job.sbatch"
    render = subprocess.run(
        [RL_LAUNCH, "render", str(spec), "-o", str(script)], capture_output=True, text=True
    )
    assert render.returncode == 0, render.stderr
    sbatch = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=30)
    assert sbatch.returncode == 0, sbatch.stderr
    job_id = sbatch.stdout.strip().split(";")[0]
    result = wait_result(tmp_path / "jobs" / f"by-hand-{job_id}")
    assert result["exit_code"] == 0, result
    assert wait_no_leftovers() == []


def test_heterogeneous_job_when_roles_need_different_resources(tmp_path: Path) -> None:
    # a per-role override (here: CPUs) makes the job heterogeneous: submitted as the rendered script,
    # split by het group, engine steps on het group 1
    spec = write_spec(
        tmp_path,
        "het",
        "true",
        training={"nodes": 1, "command": "true", "slurm": {"cpus_per_task": 1}},
    )
    proc = submit(spec, "--follow")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = job_dir_of(proc.stdout)
    assert "hetjob" in (job / "spec.resolved.yaml").read_text()
    start = next(json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if '"starting"' in x)
    assert (
        len(start["nodes"]["generation"]) == 2
        and start["nodes"]["training"][0] not in start["nodes"]["generation"]
    )
    assert squeue_empty()
    assert wait_no_leftovers() == []


def _fault_job(
    tmp_path: Path, mode: str, **generation: object
) -> tuple[subprocess.CompletedProcess[str], Path]:
    from tests.support.jobs import TRAINER as FAULT_TRAINER

    trainer = tmp_path / "fault_trainer.py"
    trainer.write_text(FAULT_TRAINER)
    gen = {**FAULT_GENERATION, **generation}
    spec = write_spec(
        tmp_path,
        f"fault-{mode.replace('_', '-')}",
        f"{sys.executable} {trainer} {mode}",
        generation=gen,
        router={"policy": "cache_aware", "backend_timeout_s": 5},
    )
    proc = submit(spec, "--follow")
    return proc, job_dir_of(proc.stdout)


def test_all_engines_dead_with_budget_spent_fails_the_job(tmp_path: Path) -> None:
    proc, job = _fault_job(tmp_path, "kill_all", restarts_per_engine=0)
    assert proc.returncode != 0
    result = json.loads((job / "result.json").read_text())
    assert "no engine can serve" in result["reason"], result
    victim = json.loads((job / "victim.json").read_text())
    failed = next(json.loads(x) for x in (job / "events.jsonl").read_text().splitlines() if '"failed"' in x)
    print(f"\nslurm all dead: job failed {failed['t'] - victim['t']:.1f}s after the kill")
    assert failed["t"] - victim["t"] < 30
    assert squeue_empty()
    assert wait_no_leftovers() == []


def test_queued_job_is_known_from_submit_and_cancellable(tmp_path: Path) -> None:
    """From the moment submit returns: list/status/logs know the job, show PENDING with Slurm's reason,
    and cancel (by Slurm id) takes it out of the queue. The snapshot it would run is in its directory."""
    spec = write_spec(
        tmp_path,
        "queued",
        "true",
        slurm={
            "partition": "debug",
            "time": "00:20:00",
            "cpus_per_task": 2,
            "gpus_per_node": 0,
            "extra_sbatch": ["--begin=now+3600"],
        },
    )
    proc = submit(spec, "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    job, job_id = Path(record["job_dir"]), record["job_id"]
    assert (job / "spec.resolved.yaml").exists() and (job / "submitted.json").exists()
    spec.write_text("name: edited-after-submit\n")  # the queued job runs the snapshot, not this file
    root = str(tmp_path / "jobs")
    # Released from its hold, the job shows another pending reason until the scheduler has looked at it.
    deadline = time.monotonic() + 30
    while True:
        list_cmd = [RL_LAUNCH, "list", "--json", "--root", root]
        (row,) = json.loads(subprocess.run(list_cmd, capture_output=True, text=True).stdout)
        assert (row["job_id"], row["phase"]) == (job_id, "queued")
        if row["slurm"] == "PENDING (BeginTime)" or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert row["slurm"] == "PENDING (BeginTime)", row
    status = subprocess.run([RL_LAUNCH, "status", "--json", "--root", root], capture_output=True, text=True)
    snap = json.loads(status.stdout)
    assert snap["condition"] == "queued" and snap["job"]["name"] == job.name, snap
    assert "PENDING (BeginTime)" in snap["message"]
    logs = subprocess.run([RL_LAUNCH, "logs", job_id, "--root", root], capture_output=True, text=True)
    assert logs.returncode != 0 and "PENDING (BeginTime)" in logs.stderr
    cancel = subprocess.run([RL_LAUNCH, "cancel", job_id, "--root", root], capture_output=True, text=True)
    assert cancel.returncode == 0, cancel.stderr
    assert squeue_empty()
    listing = subprocess.run([RL_LAUNCH, "list", "--json", "--root", root], capture_output=True, text=True)
    (row,) = json.loads(listing.stdout)
    assert row["slurm"].startswith("CANCELLED"), row


def test_job_runs_the_submitted_snapshot_not_the_edited_file(tmp_path: Path) -> None:
    spec = write_spec(tmp_path, "snapshot", 'echo submitted > "$RL_JOB_DIR/ran"')
    proc = submit(spec, "--json")
    assert proc.returncode == 0, proc.stderr
    job = Path(json.loads(proc.stdout)["job_dir"])
    edited = yaml.safe_load(spec.read_text())
    edited["training"]["command"] = 'echo edited > "$RL_JOB_DIR/ran"'
    spec.write_text(yaml.safe_dump(edited, sort_keys=False))
    result = wait_result(job)
    assert result["exit_code"] == 0, result
    assert (job / "ran").read_text().strip() == "submitted"
    assert "echo submitted" in (job / "spec.resolved.yaml").read_text()
    assert wait_no_leftovers() == []
