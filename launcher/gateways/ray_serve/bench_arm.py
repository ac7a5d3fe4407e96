"""The bench's ``ray-serve[:POLICY]`` arm (``kind.RayServeFront.bench_arm``): a fresh, cold Serve
application of simulated engines on a local Ray, torn down after the arm.

``ray-serve`` is Serve's own request routing (power of two choices); ``ray-serve:cache_aware`` (or any of
our policy names) puts that policy into Serve's request routing (``request_router.PolicyRequestRouter``).
Replicas are sized as in a job (``max_ongoing_requests`` from the simulator's ``max_num_seqs``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from launcher.engines.sim.kind import SIM
from launcher.gateways.ray_serve.gateway import (
    APP_NAME,
    POWER_OF_TWO,
    SERVE_RAY_ENV,
    build_app,
    engine_replicas,
    start_serve,
    wait_healthy,
)
from launcher.gateways.ray_serve.plan import ONGOING_PER_SEQ, ServePlan

SIM_MODEL = "sim-model"


def local_plan(
    n_engines: int, routing: str, sim_options: dict[str, Any], job_dir: str, startup_timeout_s: float = 120.0
) -> ServePlan:
    from launcher.engines.sim.cli import options_to_flags

    return ServePlan(
        num_replicas=n_engines,
        max_replicas_per_node=n_engines,
        max_ongoing_requests=ONGOING_PER_SEQ * SIM.max_num_seqs({"sim": sim_options}),
        engine={
            "kind": SIM.name,
            "count": 1,
            "host": "127.0.0.1",
            "model": SIM_MODEL,
            "served_name": SIM_MODEL,
            "sim_args": options_to_flags(sim_options),
            "startup_timeout_s": startup_timeout_s,
            "log_dir": f"{job_dir}/logs",
            "job_dir": job_dir,
        },
        local=True,
        routing=routing,
    )


@contextlib.contextmanager
def local_ray() -> Iterator[None]:
    """A local Ray for this process unless one is connected already (loopback only), locked like a job's:
    its own token (other local users cannot attach and run code as this user) and its files in a private
    directory (``launcher.steps.ray_node``), never the shared, world-writable ``/tmp/ray``."""
    import secrets

    import ray

    from launcher.steps.ray_cluster import reload_ray_auth
    from launcher.steps.ray_node import make_private, private_temp_dir

    if ray.is_initialized():
        yield
        return
    # For this Ray only: left in the process's environment, the loopback setting would reach later
    # sbatch jobs and make their Ray workers refuse to join a multi-node cluster, and the token settings
    # would point a later Ray at a deleted file.
    private = tempfile.mkdtemp(prefix="rl-ray-")  # 0700
    token = os.path.join(private, "ray_token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(secrets.token_urlsafe(32))
    defaults = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", **SERVE_RAY_ENV}
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token}
    saved = {key: os.environ.get(key) for key in (*defaults, *auth, "RAY_AUTH_TOKEN")}
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    os.environ.update(auth)
    os.environ.pop("RAY_AUTH_TOKEN", None)
    reload_ray_auth()
    try:
        # address="local": a new Ray of our own, never another process's cluster found on this machine.
        ray.init(
            address="local",
            include_dashboard=False,
            num_cpus=max(2, os.cpu_count() or 2),
            log_to_driver=False,
            _temp_dir=str(make_private(private_temp_dir(private))),
        )
        try:
            yield
        finally:
            ray.shutdown()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        reload_ray_auth()
        shutil.rmtree(private, ignore_errors=True)


@contextlib.contextmanager
def serve_app(plan: ServePlan, port: int) -> Iterator[str]:
    """Serve on 127.0.0.1:``port`` running ``plan``; yields the base URL; shuts Serve down on exit."""
    from ray import serve

    start_serve("127.0.0.1", port)
    try:
        serve.run(build_app(plan), name=APP_NAME, route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, float(plan.engine.get("startup_timeout_s", 120)) + 30)
        yield url
    finally:
        serve.shutdown()


@contextlib.contextmanager
def ray_serve_arm(
    n_engines: int, option: str | None, sim_options: dict[str, Any], sim_process: bool
) -> Iterator[tuple[str, list[str]]]:
    """FRONT_ARMS entry: yields (the ingress URL, the engines' URLs). Engines are always processes here
    (each replica starts one), so ``sim_process`` changes nothing."""
    from router.ports import free_port

    job_dir = tempfile.mkdtemp(prefix="rl-launch-serve-arm-")
    try:
        with (
            local_ray(),
            serve_app(
                local_plan(n_engines, option or POWER_OF_TWO, sim_options, job_dir), free_port("127.0.0.1")
            ) as url,
        ):
            yield url, [r["url"] for r in engine_replicas(job_dir)]
    finally:
        shutil.rmtree(job_dir, ignore_errors=True)
