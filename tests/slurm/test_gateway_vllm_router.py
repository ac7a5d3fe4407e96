"""``router.kind: vllm-router`` against the real ``vllm-router`` 0.1.17 (PyPI; CI installs the
``vllm-router`` extra): the spec's rules, the command line, the registrar converging the router's
worker set, the external gateway's whole life, the supervised process killed and back on the same URL,
and the whole job with faults (local with Ray, and on the real local Slurm cluster).

Engines are the simulator, in this process (fast) or the job's own; every router and engine listens on
127.0.0.1 with OS-chosen ports (the Slurm tests: inside the cluster's node namespaces).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from launcher.gateways import GatewayContext, GatewayError, make_gateway
from launcher.gateways.vllm_router.admin import Registrar, VllmRouterAdmin
from launcher.gateways.vllm_router.command import router_command, vllm_router_executable
from launcher.gateways.vllm_router.process import VllmRouterProcess
from launcher.jobdir import JobDir
from launcher.spec import SpecError, load_resolved, load_snapshot
from router.ports import free_port
from tests.support.cli import RL_LAUNCH


@pytest.fixture(scope="module")
def vllm_router_bin() -> str:
    """The real vllm-router; a missing install fails in CI (RL_LAUNCH_REQUIRE_ALL=1) instead of skipping."""
    try:
        return vllm_router_executable()
    except FileNotFoundError as exc:
        if os.environ.get("RL_LAUNCH_REQUIRE_ALL") == "1":
            pytest.fail(f"vllm-router must be installed in CI: {exc}")
        pytest.skip(str(exc))


@pytest.fixture
def slurm() -> None:
    from tests.support.slurm import _slurm_unreachable

    reason = _slurm_unreachable()
    if reason:
        pytest.skip(f"no Slurm cluster reachable: {reason} (run on its login node: slurm/cluster.sh exec)")


def _until(check: Callable[[], bool], timeout_s: float = 15.0, what: str = "") -> float:
    """Poll ``check`` (bounded); return how long it took."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)
    return time.monotonic() - t0


@pytest.fixture
def engines() -> Iterator[list[str]]:
    from launcher.engines.sim.local import sim_fleet

    with sim_fleet(3, {"speed": 20}) as urls:
        yield urls


@pytest.fixture
def router(vllm_router_bin: str, tmp_path: Path) -> Iterator[VllmRouterProcess]:
    port = free_port()
    cmd = router_command(
        host="127.0.0.1",
        port=port,
        metrics_port=free_port(),
        policy="round_robin",
        executable=vllm_router_bin,
    )
    proc = VllmRouterProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "vllm-router.log").start()
    try:
        yield proc
    finally:
        proc.stop()


# -- the spec --------------------------------------------------------------------------------------------
def _spec(tmp_path: Path, router: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(
        "name: t\ncluster: local\ntraining: {command: 'true'}\ngeneration: {engine: sim}\nrouter:\n"
        + textwrap.indent(textwrap.dedent(router), "  ")
    )
    return path


@pytest.mark.parametrize(
    ("router", "error"),
    [
        ("kind: vllm-router\nmode: external\n", r"router\.url: required with router\.mode: external"),
        (
            "kind: vllm-router\nmode: external\nurl: http://h:1/v1\n",
            r"router\.url: 'http://h:1/v1' is not a base",
        ),
        ("url: http://h:1\n", r"router\.url: only for router\.kind: vllm-router"),
        ("kind: vllm-router\nurl: http://h:1\n", r"router\.url: only for router\.mode: external"),
        (
            "kind: vllm-router\npolicy: cache_aware\n",
            r"router\.policy: only for router\.kind: builtin or ray-serve, not vllm-router; remove it "
            r"\(set router\.vllm_router\.policy\)",
        ),
        ("kind: vllm-router\nvllm_router: {policy: cache-aware}\n", r"router\.vllm_router\.policy: unknown"),
        ("kind: vllm-router\nvllm_router: {options: {port: 1}}\n", r"options: 'port' is set by the launcher"),
        (
            "kind: vllm-router\nvllm_router: {options: {balance_abs_treshold: 3}}\n",
            r"router\.vllm_router\.options: vllm-router refuses them: unrecognized arguments",
        ),
        (
            "kind: vllm-router\nmode: external\nurl: http://h:1\nvllm_router: {policy: random}\n",
            r"router\.vllm_router: an external vllm-router's policy and options are its owner's",
        ),
    ],
)
def test_spec_errors_are_one_line_naming_the_field(
    tmp_path: Path, router: str, error: str, vllm_router_bin: str
) -> None:
    with pytest.raises(SpecError, match=error) as info:
        load_resolved(_spec(tmp_path, router))
    assert "\n" not in str(info.value)


def test_spec_resolves_and_survives_the_snapshot(tmp_path: Path, vllm_router_bin: str) -> None:
    managed = load_resolved(
        _spec(
            tmp_path,
            "kind: vllm-router\nvllm_router: {policy: consistent_hash, options: {cache_threshold: 0.5}}\n",
        )
    )
    assert (managed.router.kind, managed.router.mode, managed.router.url) == ("vllm-router", "managed", None)
    assert managed.router.vllm_router is not None and managed.router.vllm_router.policy == "consistent_hash"
    snapshot = tmp_path / "spec.resolved.yaml"
    snapshot.write_text(managed.to_yaml())
    assert load_snapshot(snapshot).router == managed.router
    external = load_resolved(_spec(tmp_path, "kind: vllm-router\nmode: external\nurl: http://h:30000\n"))
    assert (external.router.mode, external.router.url) == ("external", "http://h:30000")
    builtin = load_resolved(_spec(tmp_path, "policy: round_robin\n"))
    # the builtin router's section has no vllm-router fields at all (each kind owns its section)
    assert builtin.router.kind == "builtin"
    assert not hasattr(builtin.router, "mode") and not hasattr(builtin.router, "vllm_router")


def test_command_line_has_no_secret_and_a_short_startup_check() -> None:
    cmd = router_command(
        host="10.0.0.5",
        port=20001,
        metrics_port=20999,
        policy="consistent_hash",
        options={"balance_abs_threshold": 32, "disable_retries": True, "cors_allowed_origins": ["a", "b"]},
        executable="vllm-router",
    )
    joined = " ".join(cmd)
    assert "--host 10.0.0.5 --port 20001 --policy consistent_hash" in joined
    assert "--worker-startup-check-interval 1" in joined
    assert "--prometheus-host 127.0.0.1 --prometheus-port 20999" in joined
    assert joined.endswith("--balance-abs-threshold 32 --disable-retries --cors-allowed-origins a b")
    assert "--api-key" not in joined and "--worker-urls" not in joined


# -- the registrar and the supervised process, against the real router ----------------------------------
def test_registrar_converges_and_never_touches_foreign_workers(
    router: VllmRouterProcess, engines: list[str]
) -> None:
    admin = VllmRouterAdmin(router.url)
    notes: list[tuple[str, str]] = []
    reg = Registrar(admin, note=lambda action, url, why: notes.append((action, url)))
    reg.register_all([engines[0] + "/v1", engines[1]], timeout_s=30)  # with or without /v1
    assert admin.worker_urls() == {engines[0], engines[1]}
    admin.add(engines[0])  # a second POST of a registered URL ("already exists") counts as success
    admin.add(engines[2])  # another job's worker on a shared router
    reg.converge([engines[0]])  # engines[1] stops serving: out at once
    assert admin.worker_urls() == {engines[0], engines[2]}
    assert ("deregistered", engines[1]) in notes
    reg.converge([engines[0], engines[1]])  # back: registered in the background
    _until(lambda: engines[1] in admin.worker_urls(), what="re-registration")
    assert ("registered", engines[1]) in notes
    assert router.admin.ready()

    # the router killed: back on the same URL by its supervisor, empty, refilled by the next converge
    old = router.pid()
    assert old is not None
    os.kill(old, signal.SIGKILL)
    down = _until(lambda: router.pid() != old and admin.live(), what="vllm-router restarted")
    print(f"\nvllm-router process killed: back on {router.url} after {down:.2f} s")
    assert admin.worker_urls() == set()
    reg.converge([engines[0], engines[1]])
    _until(lambda: admin.worker_urls() == {engines[0], engines[1]}, what="refilled after a restart")
    admin.add(engines[2])
    assert reg.deregister_ours() == []
    assert admin.worker_urls() == {engines[2]}  # only this job's engines leave


def test_managed_registrar_removes_every_worker_the_job_did_not_register(
    router: VllmRouterProcess, engines: list[str]
) -> None:
    """vllm-router lets anyone POST /workers and passes the client's Authorization on: in a router the job
    owns, a stranger's worker (whatever its spelling) is removed on the next converge, with a note."""
    admin = VllmRouterAdmin(router.url)
    notes: list[tuple[str, str, str]] = []
    reg = Registrar(admin, note=lambda action, url, why: notes.append((action, url, why)), owns_router=True)
    reg.register_all([engines[0]], timeout_s=30)
    alias = engines[2].replace("127.0.0.1", "localhost")  # another spelling, same rules
    admin.add(engines[1])
    admin.add(alias)
    assert {w["url"] for w in admin.workers()} == {engines[0], engines[1], alias}
    reg.converge([engines[0]])
    assert {w["url"] for w in admin.workers()} == {engines[0]}
    removed = {(url, "POST /workers" in why) for action, url, why in notes if action == "removed"}
    assert removed == {(engines[1], True), (alias, True)}
    admin.add(engines[1])  # re-added at once: removed again on every converge, noted once a minute
    reg.converge([engines[0]])
    assert {w["url"] for w in admin.workers()} == {engines[0]}
    assert [url for action, url, _ in notes if action == "removed"].count(engines[1]) == 1


def test_external_router_keeps_a_foreign_worker_warns_once_and_status_shows_it(
    router: VllmRouterProcess, engines: list[str], tmp_path: Path
) -> None:
    """An external router is its owner's: a worker the job did not register stays, but the driver warns
    once (log and event) that rollouts may reach it with the job's API key, and `rl-launch status` says so."""
    from launcher.jobdir import StateWriter
    from launcher.status import collect_snapshot
    from tests.support.status_frame import frame_text

    spec = load_resolved(_spec(tmp_path, f"kind: vllm-router\nmode: external\nurl: {router.url}\n"))
    job = JobDir(tmp_path / "job").create()
    job.new_api_key()
    said: list[str] = []
    ctx = GatewayContext(spec, job, "127.0.0.1", 0, job.read_api_key(), "t", say=said.append)
    gw = make_gateway("vllm-router", ctx)
    try:
        gw.start([engines[0] + "/v1"])
        router.admin.add(engines[2])  # another job's, or a stranger's
        for _ in range(3):  # three fleet ticks
            gw.set_serving([engines[0] + "/v1"])
        assert router.admin.worker_urls() == {engines[0], engines[2]}  # not ours to remove
        warned = [e for e in job.read_events() if e["phase"] == "gateway_member" and e["action"] == "foreign"]
        assert [(e["url"], e["level"]) for e in warned] == [(engines[2], "warning")]
        assert "API key" in warned[0]["why"]
        assert [m for m in said if "WARNING" in m and engines[2] in m] != []
        view = gw.view()
        assert {m.url: m.detail for m in view.members} == {engines[0]: "", engines[2]: "not this job's"}
        StateWriter(job).update(
            phase="training",
            router_url=router.url,
            gateway=view.to_json(),
            fleet={"engines": [{"id": "node0-0", "url": engines[0], "state": "HEALTHY"}]},
        )
        snap = collect_snapshot(job.path, window_s=0.0)
    finally:
        gw.stop()
    assert snap["gateway"]["extra"] == [engines[2]]
    problem = next(p for p in snap["problems"] if engines[2] in p)
    print(f"\nexternal vllm-router with a foreign worker: {warned[0]['detail']}\nstatus: ! {problem}")
    assert "does not own" in problem and "API key" in problem
    assert router.admin.live() and router.admin.worker_urls() == {engines[2]}  # ours gone, theirs stays
    assert f"does not own ({engines[2]})" in frame_text(snap)


def test_external_gateway_registers_replaces_and_leaves_the_router_running(
    router: VllmRouterProcess, engines: list[str], tmp_path: Path
) -> None:
    spec = load_resolved(_spec(tmp_path, f"kind: vllm-router\nmode: external\nurl: {router.url}/\n"))
    job = JobDir(tmp_path / "job").create()
    ctx = GatewayContext(spec=spec, job=job, host="127.0.0.1", port=0, api_key="k", admin_token="t")
    gw = make_gateway("vllm-router", ctx)
    assert gw.start([e + "/v1" for e in engines[:2]]) == router.url
    view = gw.view()
    assert view.reachable and {(m.url, m.healthy) for m in view.members} == {(e, True) for e in engines[:2]}
    assert gw.drain_outcomes() == {} and gw.instance() is None
    # the refit window beside it (the driver's fleet endpoint), with the admin token
    from launcher.fleet.client import FleetClient

    fleet = FleetClient(gw.fleet_url() or "", "t")
    assert fleet.weight_version().result["engines"] == {e: "default" for e in engines[:2]}

    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    req = urllib.request.Request(
        router.url + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200 and json.loads(resp.read())["choices"]

    # engine 1 died; its successor serves on a new URL (engines[2])
    gw.set_serving([engines[0] + "/v1", engines[2] + "/v1"])
    _until(lambda: router.admin.worker_urls() == {engines[0], engines[2]}, what="successor registered")
    events = [
        (e.get("action"), e.get("url")) for e in job.read_events() if e.get("phase") == "gateway_member"
    ]
    assert ("deregistered", engines[1]) in events and ("registered", engines[2]) in events

    gw.stop()
    assert router.admin.live() and router.admin.worker_urls() == set()  # ours gone, its router running

    dead = f"http://127.0.0.1:{free_port()}"
    spec = load_resolved(_spec(tmp_path, f"kind: vllm-router\nmode: external\nurl: {dead}\n"))
    with pytest.raises(GatewayError, match=rf"router\.url {dead}: vllm-router does not answer"):
        make_gateway("vllm-router", GatewayContext(spec, job, "127.0.0.1", 0, "k", "t")).start(engines)


# -- whole jobs --------------------------------------------------------------------------------------------
def _kill_process_trainer() -> str:
    """The local fleet's fault trainer (tests/support/jobs.py), whose ``kill_router`` mode here kills the
    managed vllm-router *process* (its pid from the router actor) instead of the actor."""
    from tests.support.jobs import TRAINER

    kill_actor = 'ray.kill(ray.get_actor("router"), no_restart=False)'
    assert kill_actor in TRAINER
    return TRAINER.replace(kill_actor, 'os.kill(ray.get(ray.get_actor("router").pid.remote()), 9)')


def _local_job(tmp_path: Path, mode: str, trainer_text: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The local fleet's job (``run_job`` of tests/support/jobs.py), vllm-router (cache_aware) in front."""
    from tests.support.jobs import run_job

    router = {"kind": "vllm-router", "vllm_router": {"policy": "cache_aware"}}
    return run_job(tmp_path, mode, trainer_text=trainer_text, router=router, name="vrouter")


def _member_times(job: Path, victim: dict[str, object]) -> tuple[float, float, str]:
    """Seconds from the fault until the victim left vllm-router and until its successor was registered."""
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    members = [e for e in events if e["phase"] == "gateway_member" and e["t"] > victim["t"]]
    out = next(e for e in members if e["action"] == "deregistered" and e["url"] == victim["victim"])
    back = next(e for e in events if e["phase"] == "engine_restarted")
    successor = next(
        e for e in members if e["action"] == "registered" and e["url"] == back["url"].rstrip("/")
    )
    return out["t"] - victim["t"], successor["t"] - victim["t"], back["url"]


@pytest.mark.ray
def test_local_job_managed_router_killed_actor_is_back_on_the_same_url(
    tmp_path: Path, vllm_router_bin: str
) -> None:
    from tests.support.jobs import TRAINER
    from tests.support.running_job import job_processes

    proc, job = _local_job(tmp_path, "kill_router", TRAINER)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    back = json.loads((job / "router_back.json").read_text())
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    print(f"\nvllm-router actor killed: same URL back after {back['down_s']:.1f}s; lost {replay['errors']}")
    assert back["down_s"] < 10
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
    events = [json.loads(x)["phase"] for x in (job / "events.jsonl").read_text().splitlines()]
    assert "router_restarted" in events
    assert (job / "logs" / "vllm-router.log").exists()
    assert job_processes(job) == []


STRANGER_TRAINER = textwrap.dedent(
    """\
    import json, os, time, urllib.request
    job, router = os.environ["RL_JOB_DIR"], os.environ["RL_ROUTER_URL"]
    def workers():
        listed = json.load(urllib.request.urlopen(router + "/workers", timeout=10))["workers"]
        return [w["url"] for w in listed]
    # Anyone who reaches the job's vllm-router (no credential: it has none) adds a worker of their own.
    req = urllib.request.Request(router + "/workers", data=json.dumps({"url": "FOREIGN"}).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    added = urllib.request.urlopen(req, timeout=60).status
    t, seen, removed_after = time.time(), "FOREIGN" in workers(), None
    while time.time() - t < 20:
        if "FOREIGN" not in workers():
            removed_after = time.time() - t
            break
        time.sleep(0.1)
    json.dump({"added": added, "seen": seen, "removed_after": removed_after, "workers": workers()},
              open(os.path.join(job, "stranger.json"), "w"))
    """
)


@pytest.mark.ray
def test_local_job_managed_router_removes_a_strangers_worker(tmp_path: Path, vllm_router_bin: str) -> None:
    """A stranger's ``POST /workers`` into the job's managed vllm-router (which would hand it rollouts
    with the job's API key) is removed within a few fleet ticks, and the job's events say so."""
    from launcher.engines.sim.local import sim_fleet
    from tests.support.running_job import job_processes

    with sim_fleet(1, {"speed": 20, "model_name": "sim-8b"}) as (foreign,):
        proc, job = _local_job(tmp_path, "stranger", STRANGER_TRAINER.replace("FOREIGN", foreign))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((job / "stranger.json").read_text())
    print(f"\nstranger's worker in the managed vllm-router: {out}")
    assert out["added"] == 200
    assert out["removed_after"] is not None and out["removed_after"] < 5, out  # a few 1 s ticks
    assert foreign not in out["workers"] and len(out["workers"]) == 3  # the job's own engines stay
    events = JobDir(job).read_events()
    (event,) = [e for e in events if e["phase"] == "gateway_member" and e["url"] == foreign]
    assert event["action"] == "removed" and "POST /workers" in event["why"] and event["level"] == "warning"
    assert job_processes(job) == []


@pytest.mark.ray
def test_example_job_registers_into_an_external_router_and_leaves_it_running(
    router: VllmRouterProcess, tmp_path: Path
) -> None:
    """examples/local-vllm-router.yaml switched to external mode: the job's engines serve through a
    vllm-router it does not own; at the end they are gone from it, another job's worker stays, and the
    router keeps running."""
    from launcher.engines.sim.local import sim_fleet
    from tests.support.running_job import job_processes

    with sim_fleet(1, {"speed": 20, "model_name": "sim-8b"}) as foreign:  # another job's, same model
        router.admin.add(foreign[0])
        _run_example_external(router, foreign[0], tmp_path, job_processes)


def _run_example_external(
    router: VllmRouterProcess, foreign: str, tmp_path: Path, job_processes: Callable[[Path], list[str]]
) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "local-vllm-router.yaml"
    overrides = [f"job_root={tmp_path / 'jobs'}", "router.mode=external", f"router.url={router.url}"]
    overrides.append("router.vllm_router=null")  # an external router's policy is its owner's
    proc = subprocess.run(
        [RL_LAUNCH, "submit", str(example), *(x for o in overrides for x in ("--set", o))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "prefix hit" in proc.stdout  # the replay table
    (job,) = list((tmp_path / "jobs").iterdir())
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
    serving = next(e for e in JobDir(job).read_events() if e["phase"] == "router_serving")
    assert serving["router_url"] == router.url and serving["gateway"] == "vllm-router"
    assert router.admin.live() and router.admin.worker_urls() == {foreign}
    assert job_processes(job) == []


def _assert_job_gone(job: Path) -> None:
    """This job (not the whole shared cluster's queue) left Slurm, and none of its processes is left on
    any node (each carries RL_LAUNCH_JOB_DIR; the login node sees every node's processes)."""
    from tests.support.running_job import job_processes
    from tests.support.slurm import job_id_of

    queued = subprocess.run(
        ["squeue", "-h", "-j", job_id_of(job)], capture_output=True, text=True, timeout=10
    )
    assert not queued.stdout.strip(), queued.stdout
    _until(lambda: job_processes(job) == [], timeout_s=20, what=f"no process of {job} left")


@pytest.mark.slurm
@pytest.mark.parametrize("mode", ["kill", "wedge"])
def test_slurm_failed_engine_leaves_vllm_router_and_its_successor_joins(
    tmp_path: Path, slurm: None, vllm_router_bin: str, mode: str
) -> None:
    """round_robin, so the victim carries its share of the turns when it fails (with cache_aware,
    vllm-router may send all traffic to another engine and the fault would hit nothing; the replay's
    per-engine counts cannot show it, since a dead victim's metrics are gone)."""
    from tests.support.jobs import TRAINER
    from tests.support.slurm import (
        job_dir_of,
        submit,
        write_spec,
    )

    trainer = tmp_path / "fault_trainer.py"
    trainer.write_text(TRAINER)
    spec = write_spec(
        tmp_path,
        f"vrouter-{mode}",
        f"{sys.executable} {trainer} {mode}",
        router={"kind": "vllm-router", "vllm_router": {"policy": "round_robin"}},
    )
    proc = submit(spec, "--follow")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = job_dir_of(proc.stdout)
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    victim = json.loads((job / "victim.json").read_text())
    out_s, in_s, successor = _member_times(job, victim)
    print(
        f"\nslurm vllm-router, engine {mode}: out of vllm-router {out_s:.1f}s, successor {successor} "
        f"registered {in_s:.1f}s after the fault; sessions lost {replay['errors']}"
    )
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
    assert out_s < 10
    _assert_job_gone(job)


@pytest.mark.slurm
def test_slurm_managed_vllm_router_process_killed_is_back_on_the_same_url(
    tmp_path: Path, slurm: None, vllm_router_bin: str
) -> None:
    from tests.support.slurm import (
        job_dir_of,
        submit,
        write_spec,
    )

    trainer = tmp_path / "fault_trainer.py"
    trainer.write_text(_kill_process_trainer())
    spec = write_spec(
        tmp_path,
        "vrouter-kill-process",
        f"{sys.executable} {trainer} kill_router",
        router={"kind": "vllm-router"},
    )
    proc = submit(spec, "--follow")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    job = job_dir_of(proc.stdout)
    back = json.loads((job / "router_back.json").read_text())
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    print(
        f"\nslurm vllm-router process killed: same URL back in {back['down_s']:.1f}s; "
        f"sessions lost {replay['errors']}"
    )
    assert back["down_s"] < 10
    assert any(e["phase"] == "router_restarted" for e in events)
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"], replay
    _assert_job_gone(job)


REFIT_TRAINER = textwrap.dedent(
    """\
    import glob, json, os, threading, time, urllib.request
    from launcher.fleet.client import FleetClient
    job, key = os.environ["RL_JOB_DIR"], os.environ["RL_POLICY_API_KEY"]
    base, router = os.environ["RL_POLICY_BASE_URL"], os.environ["RL_ROUTER_URL"]
    def post(url, body, headers=None):
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
            "Content-Type": "application/json", "Authorization": "Bearer " + key, **(headers or {})})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status
    def registered():
        workers = json.load(urllib.request.urlopen(router + "/workers", timeout=10))["workers"]
        return sorted(w["url"].rstrip("/") for w in workers)
    answered = {}
    def chat(i):
        body = {"model": os.environ["RL_POLICY_MODEL_NAME"], "max_tokens": 8,
                "messages": [{"role": "user", "content": f"rollout {i}"}]}
        answered[i] = (post(base + "/chat/completions", body), time.time())
    fleet = FleetClient.from_job_dir(job)
    out = {"fleet_url": fleet.url}
    fleet.begin_step()
    out["pause"] = fleet.pause("keep").result
    threads = [threading.Thread(target=chat, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    time.sleep(1.0)
    out["answered_while_paused"] = len(answered)
    fleet.reset_prefix_cache()
    fleet.set_weight_version("step-1")
    resumed_at = time.time()
    fleet.resume()
    [t.join(60) for t in threads]
    out["statuses"] = sorted(s for s, _ in answered.values())
    out["all_after_resume"] = all(t >= resumed_at for _, t in answered.values())
    out["step_generation_tokens"] = fleet.step_metrics()["fleet"]["generation_tokens"]
    engines = [e for f in sorted(glob.glob(os.path.join(job, "engines", "node-*.urls.json")))
               for e in json.load(open(f))["engines"]]
    victim = engines[0]["url"]
    post(victim + "/sim/fault", {"mode": "kill"})
    deadline, stale = time.time() + 90, {}
    while time.time() < deadline and not stale:
        stale = {u: w for u, w in fleet.stale_engines().items() if "not verified" not in w}
        time.sleep(0.3)
    out["stale"] = stale
    time.sleep(2.5)  # two more fleet ticks: a stale engine must stay out of vllm-router
    out["registered_while_stale"] = registered()
    fleet.set_weight_version("step-1", engines=list(stale))
    deadline = time.time() + 20
    while time.time() < deadline and not set(stale) <= set(registered()):
        time.sleep(0.3)
    out["registered_after_stamp"] = registered()
    out["versions"] = fleet.weight_version().result
    json.dump(out, open(os.path.join(job, "refit.json"), "w"))
    """
)


@pytest.mark.ray
def test_local_job_refit_window_beside_vllm_router(tmp_path: Path, vllm_router_bin: str) -> None:
    """The trainer's refit loop on a vllm-router job, through the driver's fleet endpoint: a pause holds
    rollouts on the engines until resume, the stamp moves the fleet's version, and an engine restarted on
    the checkpoint's version stays out of vllm-router (STALE) until it is stamped."""
    from tests.support.running_job import job_processes

    proc, job = _local_job(tmp_path, "refit", REFIT_TRAINER)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads((job / "refit.json").read_text())
    state = JobDir(job).read_state()
    assert out["fleet_url"] == state["fleet_url"] != state["router_url"]
    assert out["pause"] == {"mode": "keep", "router_holding": False}
    assert out["answered_while_paused"] == 0 and out["statuses"] == [200] * 4 and out["all_after_resume"]
    assert out["step_generation_tokens"] >= 4 * 8
    (successor,) = out["stale"]
    assert "'default'" in out["stale"][successor]  # restarted on the checkpoint's version
    assert successor not in out["registered_while_stale"] and len(out["registered_while_stale"]) == 2
    assert successor in out["registered_after_stamp"] and len(out["registered_after_stamp"]) == 3
    assert set(out["versions"]["engines"].values()) == {"step-1"} and out["versions"]["current"] == "step-1"
    fleet_states = {e["id"]: e["state"] for e in state.get("fleet", {}).get("engines", [])}
    assert set(fleet_states.values()) == {"STOPPED"}
    events = [e["phase"] for e in JobDir(job).read_events()]
    assert "finished" in events
    assert job_processes(job) == []
