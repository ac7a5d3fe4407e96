"""The arms of the replay: Gym straight at the engines (``direct``), or Gym at a router.

Why a fresh simulated fleet (and router) per arm in ``--compare``: prefix caches and router state must
start cold in every arm, or the second arm would inherit the first one's warm caches and look better
than it is. The direct arm uses Gym's own pinning (``sha256(session_id) % n`` over the engine URLs) so
it is exactly the "no router" baseline of the public results.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from launcher.bench.client import ClientConfig, ReplayClient, ReplayResult, SessionRecord
from launcher.bench.cpu import CpuWatch
from launcher.bench.metrics import deltas, sample_load, scrape
from launcher.bench.report import summarize
from launcher.bench.trace import Trace
from launcher.engines.sim.local import sim_fleet, url_root
from launcher.gateways.kinds import GATEWAY_KINDS

DIRECT = "direct"

# Arms of the other fronts (``launcher.gateways``), named ``<front>`` or ``<front>:<option>`` (e.g.
# ``vllm-router:cache_aware``): front -> "module:function", each front's own (``FrontKind.bench_arm``).
# The function is a context manager ``(n_engines, option, sim_options, sim_process)`` that starts that
# front with a fresh cold simulated fleet behind it and yields ``(client_url, engine_urls)``; each front's
# module owns how (a vllm-router process in front of sim engines; a Serve deployment whose replicas start
# their own engines).
FRONT_ARMS: dict[str, str] = {
    name: kind.bench_arm for name, kind in GATEWAY_KINDS.items() if kind.bench_arm is not None
}


def router_policies() -> tuple[str, ...]:
    """Policy names the router knows (each is a valid ``--compare`` arm besides ``direct``)."""
    from router.policies import POLICIES

    return tuple(POLICIES)


def front_of(arm: str) -> str | None:
    """The other front an arm names (``vllm-router`` of ``vllm-router:cache_aware``), or None."""
    front = arm.split(":", 1)[0]
    return front if front in FRONT_ARMS else None


def validate_arms(arms: Sequence[str]) -> list[str]:
    known = (DIRECT, *router_policies())
    bad = [a for a in arms if a not in known and front_of(a) is None]
    if bad:
        fronts = [f"{f}[:OPTION]" for f in FRONT_ARMS]
        raise ValueError(f"unknown arm(s) {', '.join(bad)}; choose from {', '.join((*known, *fronts))}")
    return list(arms)


@contextlib.contextmanager
def front_for(
    arm: str, n_engines: int, sim_options: Mapping[str, Any] | None, sim_process: bool
) -> Iterator[tuple[str, list[str]]]:
    """Start the other front an arm names, with its own cold fleet; yield (client URL, engine URLs)."""
    import importlib

    front = front_of(arm)
    assert front is not None
    module, function = FRONT_ARMS[front].split(":")
    option = arm.split(":", 1)[1] if ":" in arm else None
    start = getattr(importlib.import_module(module), function)
    with start(n_engines, option, dict(sim_options or {}), sim_process) as (url, engines):
        yield url, [url_root(u) for u in engines]


@dataclass(slots=True)
class ArmOutcome:
    """One arm's summary row plus what the plots need: session end times, and (when sampled) each
    engine's requests over time as ``(seconds since the arm started, [per engine])``."""

    arm: str
    row: dict[str, Any]
    timeline: list[float]
    n_sessions: int
    result: ReplayResult = field(repr=False)
    engine_load: list[tuple[float, list[float | None]]] = field(default_factory=list, repr=False)


@dataclass(frozen=True, slots=True)
class Watch:
    """What an arm observes beside the replay: ``in_process`` (the client's process also runs the fleet
    and the router, so its CPU warning says so) and ``sample_s`` (scrape each engine's load this often
    for the per-engine plot; 0: never, so a run that draws no plot adds no traffic)."""

    in_process: bool = False
    sample_s: float = 0.0


def _v1(url: str) -> str:
    u = url.rstrip("/")
    return u if u.endswith("/v1") else u + "/v1"


async def router_workers(router_url: str, timeout_s: float = 5.0, token: str | None = None) -> list[str]:
    """Engine URLs behind a router, from its vllm-router-compatible ``GET /workers`` (empty if none).
    ``token``: the router's admin token (the launcher uses the run's API key for both)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http,
            http.get(url_root(router_url) + "/workers", headers=headers, allow_redirects=False) as resp,
        ):
            if resp.status != 200:
                return []
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return []
    urls = data.get("urls") if isinstance(data, dict) else None
    if not urls and isinstance(data, dict):
        urls = [w.get("url") for w in data.get("workers") or [] if isinstance(w, dict)]
    return [url_root(u) for u in urls or [] if isinstance(u, str)]


async def run_arm_async(
    arm: str,
    trace: Trace,
    client_urls: Sequence[str],
    engine_urls: Sequence[str],
    config: ClientConfig,
    *,
    policy: str | None = None,
    on_session_end: Callable[[SessionRecord], None] | None = None,
    watch: Watch = Watch(),
) -> ArmOutcome:
    """Scrape engine counters, replay, scrape again; the row's hit rate and load are the deltas.

    ``client_urls`` are what Gym is given (the engines for ``direct``, the router otherwise); they and
    ``engine_urls`` may be given with or without ``/v1``. The row's ``cpu`` is what every process of
    this replay used during it (``launcher.bench.cpu``), its ``warnings`` what may have decided its times.
    """
    engines = [url_root(u) for u in engine_urls]
    scrape_key = config.engine_key or config.api_key
    before = await scrape(engines, api_key=scrape_key) if engines else []
    client = ReplayClient([_v1(u) for u in client_urls], config, on_session_end)
    stop = asyncio.Event()
    sampler = None
    if watch.sample_s > 0 and engines:
        sampler = asyncio.create_task(sample_load(engines, watch.sample_s, stop, api_key=scrape_key))
    cpu = CpuWatch(in_process=watch.in_process).start()
    try:
        result = await client.run(trace)
    finally:
        used = cpu.stop()
        stop.set()
        samples = await sampler if sampler is not None else []
    after = await scrape(engines, api_key=scrape_key) if engines else []
    client_counts = None
    if arm == DIRECT or len(client_urls) > 1:
        counts = result.target_counts()
        client_counts = [counts.get(_v1(u), 0) for u in client_urls]
    row = summarize(
        arm,
        result,
        deltas(before, after) if engines else None,
        policy=policy or arm,
        engine_urls=engines,
        client_engine_counts=client_counts,
    )
    row["cpu"] = used
    row["warnings"] = used["warnings"]
    load = [(t - result.started_at, v) for t, v in samples]
    return ArmOutcome(arm, row, result.completion_times(), len(trace.sessions), result, load)


def run_direct(
    trace: Trace,
    engine_urls: Sequence[str],
    config: ClientConfig,
    *,
    arm: str = DIRECT,
    on_session_end: Callable[[SessionRecord], None] | None = None,
    watch: Watch = Watch(),
) -> ArmOutcome:
    """Gym given the engine list itself: sessions pinned by sha256, no router in the path."""
    return asyncio.run(
        run_arm_async(
            arm,
            trace,
            engine_urls,
            engine_urls,
            config,
            policy=DIRECT,
            on_session_end=on_session_end,
            watch=watch,
        )
    )


def run_url(
    trace: Trace,
    url: str,
    config: ClientConfig,
    *,
    engine_urls: Sequence[str] | None = None,
    arm: str = "router",
    on_session_end: Callable[[SessionRecord], None] | None = None,
    watch: Watch = Watch(),
) -> ArmOutcome:
    """Gym given one router URL. Engines for the metrics come from ``engine_urls`` or the router's
    ``GET /workers``; without either, hit rate and per-engine load are left empty."""

    async def go() -> ArmOutcome:
        engines = list(engine_urls or []) or await router_workers(url, token=config.api_key)
        return await run_arm_async(
            arm, trace, [url], engines, config, policy=arm, on_session_end=on_session_end, watch=watch
        )

    return asyncio.run(go())


# ----------------------------------------------------------------------------------------------------
# Router per arm
# ----------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def router_for(
    engine_urls: Sequence[str],
    policy: str,
    router_options: Mapping[str, Any] | None = None,
    *,
    process: bool = False,
) -> Iterator[str]:
    """A fresh router with ``policy`` in front of ``engine_urls``; yields its base URL.

    With ``process`` it runs as ``rl-launch router`` in a child process, as in production: in-process,
    the router's loop shares this process's GIL with the replay client, which inflates every router
    arm's latency against the ``direct`` arm and would bias the comparison.

    The bench's router takes an admin token nobody is told (a router never starts with its admin routes
    open, and on a shared machine loopback is every local user's): the replay needs no admin route.
    """
    if process:
        with _router_process(engine_urls, policy, router_options) as url:
            yield url
        return
    from router import GenerationRouter, RouterConfig

    options = {"policy": policy, **dict(router_options or {})}
    config = RouterConfig(host="127.0.0.1", port=0, admin_token=secrets.token_urlsafe(32), **options)
    r = GenerationRouter(config, [_v1(u) for u in engine_urls])
    try:
        r.serve_in_background()
        yield r.base_url()
    finally:
        r.stop()


@contextlib.contextmanager
def _router_process(
    engine_urls: Sequence[str], policy: str, router_options: Mapping[str, Any] | None
) -> Iterator[str]:
    import json
    import subprocess
    import sys
    import time
    import urllib.request

    from router.ports import free_port

    port = free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "launcher.cli", "router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--policy", policy, "--options-json", json.dumps(dict(router_options or {}))]
    for u in engine_urls:
        cmd += ["--backend", _v1(u)]
    env = {**os.environ, "RL_ROUTER_ADMIN_TOKEN": secrets.token_urlsafe(32)}  # environment, never argv
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RuntimeError(f"router process did not start: {err[-2000:]}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_compare(
    trace: Trace,
    arms: Sequence[str],
    n_engines: int,
    config: ClientConfig,
    *,
    sim_options: Mapping[str, Any] | None = None,
    router_options: Mapping[str, Any] | None = None,
    sim_process: bool = True,
    on_arm_start: Callable[[str], None] | None = None,
    on_session_end: Callable[[SessionRecord], None] | None = None,
    sample_s: float = 0.0,
) -> list[ArmOutcome]:
    """Each arm back to back on its own cold simulated fleet (and its own router unless ``direct``).

    ``sim_process`` (the default) runs each fleet and each router in child processes: in this process
    they would share the replay client's GIL (and, on few cores, its CPU), and an arm would measure the
    harness as much as the router (see ``launcher.bench.cpu``). ``sample_s``: see ``Watch``."""
    validate_arms(arms)
    watch = Watch(in_process=not sim_process, sample_s=sample_s)
    outcomes: list[ArmOutcome] = []
    for arm in arms:
        if on_arm_start is not None:
            on_arm_start(arm)
        cfg = dataclasses.replace(config)  # fresh per arm: model discovery must not leak across arms
        if front_of(arm) is not None:
            with front_for(arm, n_engines, sim_options, sim_process) as (url, engines):
                outcomes.append(
                    run_url(
                        trace,
                        url,
                        cfg,
                        engine_urls=engines,
                        arm=arm,
                        on_session_end=on_session_end,
                        watch=Watch(sample_s=sample_s),  # another front: its own processes
                    )
                )
            continue
        with sim_fleet(n_engines, sim_options, process=sim_process) as engines:
            if arm == DIRECT:
                outcomes.append(run_direct(trace, engines, cfg, on_session_end=on_session_end, watch=watch))
            else:
                with router_for(engines, arm, router_options, process=sim_process) as url:
                    outcomes.append(
                        run_url(
                            trace,
                            url,
                            cfg,
                            engine_urls=engines,
                            arm=arm,
                            on_session_end=on_session_end,
                            watch=watch,
                        )
                    )
    return outcomes
