"""The router as a Ray actor (real local Ray): a killed actor is restarted and rebinds the same URL.

Named and placed to run first among the tests that start Ray inside the pytest process (tests/component/
is collected before tests/slurm/): after a Ray Serve app ran in-process
(tests/slurm/test_gateway_ray_serve.py), a later in-process ray.init's first actor was cancelled before it
started; reproduced with the two files in that order, not in this one."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import pytest

from router.actor import remote_router_actor
from router.config import RouterConfig
from router.ports import free_port as reserve_port

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local():
    # Ray started outside a network namespace rewrites 127.0.0.1 to the external interface address
    # unless this is set; all traffic must stay on loopback.
    # Set for this module only: left in the environment it would reach later sbatch jobs and make their
    # Ray workers refuse to join a multi-node cluster.
    saved = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray = pytest.importorskip("ray")
    # address="local": always a fresh cluster of our own, never one another test or job left running
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        configure_logging=False,
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.status


def test_killed_actor_rebinds_the_same_port(ray_local) -> None:
    ray = ray_local
    port = reserve_port()
    Actor = remote_router_actor(num_cpus=0)
    # The launcher always gives the actor the job's tokens.
    config = RouterConfig(
        host="127.0.0.1", port=port, policy="least_outstanding", health_managed=True, admin_token="admin-key"
    )
    actor = Actor.remote(config, [])
    url = ray.get(actor.base_url.remote(), timeout=60)
    assert url == f"http://127.0.0.1:{port}"
    assert _get(url + "/health") == 200
    first_pid = ray.get(actor.pid.remote())
    ray.get(actor.set_serving_backends.remote(["http://127.0.0.1:9/v1"]))
    ray.get(actor.restore_weight_version.remote("v5"))
    assert ray.get(actor.current_weight_version.remote()) == "v5"

    ray.kill(actor, no_restart=False)
    t0 = time.monotonic()
    while True:  # the client's view: the same URL answers again
        try:
            if _get(url + "/health") == 200 and ray.get(actor.pid.remote(), timeout=5) != first_pid:
                break
        except Exception:
            pass
        assert time.monotonic() - t0 < 60, "router actor did not come back on the same URL"
        time.sleep(0.1)
    assert ray.get(actor.base_url.remote()) == url
    # state is rebuilt from constructor arguments only; the controller pushes the serving set again
    assert ray.get(actor.serving_backends.remote()) == []
    # ... and the fleet's weight version, which the restarted router forgot (the builtin gateway's calls)
    assert ray.get(actor.current_weight_version.remote()) is None
    ray.get(actor.restore_weight_version.remote("v5"))
    assert ray.get(actor.current_weight_version.remote()) == "v5"
    assert ray.get(actor.stale_backends.remote()) == {}
    ray.get(actor.stop.remote())
    ray.kill(actor, no_restart=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_actor_with_worker_processes_serves_and_comes_back(ray_local, tmp_path) -> None:
    import asyncio

    from tests.support.http_backends import FakeEngine

    ray = ray_local
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(FakeEngine(name="e0").start())
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        port = reserve_port()
        Actor = remote_router_actor(num_cpus=0)
        config = RouterConfig(
            host="127.0.0.1",
            port=port,
            policy="cache_aware",
            health_managed=True,
            workers=2,
            admin_token="admin-key",
        )
        actor = Actor.remote(config, [engine.api_url])
        url = ray.get(actor.base_url.remote(), timeout=120)
        workers = ray.get(actor.worker_pids.remote())
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        assert _post(url + "/v1/chat/completions")["backend"] == "e0"
        assert ray.get(actor.in_flight.remote()) == {engine.url: 0}

        ray.kill(actor, no_restart=False)
        t0 = time.monotonic()
        while True:  # the same URL answers again, served by new worker processes
            try:
                again = ray.get(actor.worker_pids.remote(), timeout=5)
                if _post(url + "/v1/chat/completions")["backend"] == "e0" and set(again).isdisjoint(workers):
                    break
            except Exception:
                pass
            assert time.monotonic() - t0 < 120, "router actor with workers did not come back on the same URL"
            time.sleep(0.2)
        # the dead actor's workers lost their channel to it and exited: no orphan holds the port
        assert not any(_alive(p) for p in workers)
        ray.get(actor.stop.remote())
        ray.kill(actor, no_restart=True)
    finally:
        asyncio.run_coroutine_threadsafe(engine.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)


def _post(url: str) -> dict[str, object]:
    request = urllib.request.Request(
        url, data=b'{"messages": [{"role": "user", "content": "hi"}]}', method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        return json.loads(r.read())
