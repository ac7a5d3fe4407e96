"""Local jobs for the tests that run one (``rl-launch submit`` of a ``cluster: local`` spec).

``TRAINER`` is the fault trainer of the local fleet's checks (kill, wedge, kill_router, kill_all, and the
shared job's ``serve`` agent); ``run_job`` submits a job of 3 simulated engines running it (or another
trainer's text) and waits for its end; ``start_job`` submits a ``sleep 600`` job and returns once it
trains. Their specs come from ``tests/support/specs.py``; what one running job shares between checks is
``tests/support/running_job.py``.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.cli import RL_LAUNCH
from tests.support.specs import local_spec, run_spec, sim, trainer_command, write_spec

TRAINER = textwrap.dedent(
    """\
    import json, os, subprocess, sys, time, urllib.request
    mode = sys.argv[1]
    job = os.environ["RL_JOB_DIR"]
    import glob
    # The engines take the job's own engine key (no client key opens them); the job's user can read it.
    engine_key = open(os.path.join(job, "secrets", "engine_key")).read().strip()
    def engines():
        # the controller's current view (a restarted engine has a new port), node 0's engines first
        fleet = json.load(open(os.path.join(job, "state.json"))).get("fleet", {}).get("engines")
        if fleet:
            return sorted(({"id": e["id"], "url": e["url"]} for e in fleet), key=lambda e: e["id"])
        return [e for f in sorted(glob.glob(os.path.join(job, "engines", "node-*.urls.json")))
                for e in json.load(open(f))["engines"]]
    def fault(url, what):
        req = urllib.request.Request(url + "/sim/fault", data=json.dumps({"mode": what}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": "Bearer " + engine_key})
        urllib.request.urlopen(req, timeout=5).read()
    def scenario(mode, out):
        os.makedirs(out, exist_ok=True)
        if mode == "kill_all":
            for e in engines():
                fault(e["url"], "kill")
            victim = {"victim": engines()[0]["url"], "t": time.time()}
            json.dump(victim, open(os.path.join(out, "victim.json"), "w"))
            time.sleep(300)  # the driver must end this
            return 0
        # Gym retries a refused connection forever; 20 x 0.5 s stays bounded and covers a router restart
        attempts = "20" if mode == "kill_router" else "3"
        replay = subprocess.Popen(["rl-launch", "bench", "replay", "--url", os.environ["RL_POLICY_BASE_URL"],
                                   "--workload", "longtail", "--scale", "0.05", "--seed", "3",
                                   "--retry-attempts", attempts, "--json", os.path.join(out, "replay.json")])
        time.sleep(3)
        if mode == "kill_router":
            import ray
            if not ray.is_initialized():
                ray.init(address=os.environ["RAY_ADDRESS"], namespace="rl-launch", log_to_driver=False)
            t = time.time()
            ray.kill(ray.get_actor("router"), no_restart=False)
            url = os.environ["RL_ROUTER_URL"]
            time.sleep(0.2)
            while True:
                try:
                    urllib.request.urlopen(url + "/health", timeout=1).read()
                    break
                except OSError:
                    time.sleep(0.05)
            back = {"down_s": time.time() - t, "t": t}
            json.dump(back, open(os.path.join(out, "router_back.json"), "w"))
            return replay.wait()
        victim = engines()[0]["url"]
        fault(victim, mode)
        json.dump({"victim": victim, "t": time.time()}, open(os.path.join(out, "victim.json"), "w"))
        code = replay.wait()
        status_url = json.load(open(os.path.join(job, "state.json")))["status_url"]
        key = {"Authorization": "Bearer " + os.environ["RL_POLICY_API_KEY"]}  # the endpoint is never open
        live = json.load(urllib.request.urlopen(urllib.request.Request(status_url + "/status", headers=key),
                                                timeout=5))
        json.dump(live, open(os.path.join(out, "status_endpoint.json"), "w"))
        def members(action):
            # a front the controller registers engines with (vllm-router) logs each one it adds or removes
            events = [json.loads(x) for x in open(os.path.join(job, "events.jsonl")).read().splitlines()]
            return {e["url"] for e in events if e["phase"] == "gateway_member" and e["action"] == action}
        # Stay up until the restarted engine is readmitted and, where the front has members, registered
        # there (vllm-router adds it a tick after HEALTHY, once its own health check passed): a job that
        # ended at HEALTHY undid the registration (bounded).
        deadline = time.time() + 90
        while time.time() < deadline:
            fleet = json.load(open(os.path.join(job, "state.json"))).get("fleet", {})
            engine = next((e for e in fleet.get("engines", []) if e["id"] == "node0-0"), {})
            if engine.get("state") == "HEALTHY" and victim in engine.get("previous_urls", []):
                if not members("deregistered") or engine["url"].rstrip("/") in members("registered"):
                    break
            time.sleep(0.5)
        return code
    if mode != "serve":
        sys.exit(scenario(mode, job))
    # serve: the shared job's agent runs each requests/<n>.json inside the job (its keys, RAY_ADDRESS),
    # until the job is cancelled or a deadline passes; training never ends the job by itself before that
    deadline, done = time.time() + float(sys.argv[2]), set()
    requests = os.path.join(job, "requests")
    while time.time() < deadline:
        for name in sorted(glob.glob(os.path.join(requests, "[0-9]*.json"))):
            if name in done:
                continue
            done.add(name)
            request = json.load(open(name))
            code = scenario(request["mode"], request["out"])
            json.dump({"exit_code": code}, open(os.path.join(request["out"], "done.json"), "w"))
        time.sleep(0.2)
    """
)


@pytest.fixture(scope="module")
def fault_trainer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``TRAINER`` written once per module, for the job a module's recoverable checks share (its ``serve``
    agent runs each fault inside that job)."""
    trainer = tmp_path_factory.mktemp("trainer") / "trainer.py"
    trainer.write_text(TRAINER)
    return trainer


def run_job(
    tmp_path: Path,
    mode: str,
    *,
    trainer_text: str = TRAINER,
    router: dict[str, object] | None = None,
    name: str = "fleet",
    **generation: object,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A local job of 3 sim engines whose training command is ``trainer_text`` run with ``mode``
    (``router``: the spec's router section, default the builtin router with a 5 s backend timeout)."""
    spec = local_spec(
        f"{name}-{mode.replace('_', '-')}",
        root=tmp_path / "jobs",
        command=trainer_command(tmp_path, trainer_text, mode),
        generation={**sim(3, speed=3), **generation},
        router=router if router is not None else {"backend_timeout_s": 5},
    )
    return run_spec(tmp_path / "spec.yaml", spec, timeout=400)


def start_job(tmp_path: Path, name: str) -> tuple[subprocess.Popen[str], Path]:
    spec = local_spec(name, root=tmp_path / "jobs", command="sleep 600", generation=sim(2))
    path = write_spec(tmp_path / "spec.yaml", spec)
    proc = subprocess.Popen(
        [RL_LAUNCH, "submit", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    t0 = time.monotonic()
    first = proc.stderr.readline()  # printed at once, before Ray starts
    assert first.split("] ", 1)[1].startswith("job directory: "), first
    assert time.monotonic() - t0 < 10
    job = Path(first.split("job directory: ", 1)[1].strip())
    deadline = time.monotonic() + 120
    while True:
        state = json.loads((job / "state.json").read_text()) if (job / "state.json").exists() else {}
        if state.get("phase") == "training" and state.get("fleet"):
            return proc, job
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"job never reached training: {state}"
        time.sleep(0.2)
