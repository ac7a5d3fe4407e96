"""What a registered engine with a huge ``/metrics`` costs the router (issue 38, finding 6).

A router with a registration capability (``generation.owner: trainer``) is handed two engines through
``POST /t/<capability>/workers``: a fast one, and one whose ``/metrics`` streams ``--mb`` MB of valid
Prometheus text. The owner's ``POST /fleet/step/begin`` (what ``FleetClient.begin_step`` sends, and what
``rl-launch status``'s ``GET /fleet/step`` repeats) makes the router read both engines' counters while
rollouts go on through the router. The engines run in a child process, so this process's memory is the
router's (and the small client's).

Prints the router process's RSS before and its peak (``VmHWM``) after, the step's answer, how much the
huge engine got to send, and the rollouts' latencies meanwhile::

    .venv/bin/python bench/registered_engine_reads.py --mb 400

Measured on the team's shared 2-core development machine, 400 MB, 20-26 rollouts meanwhile:

- read whole (07deb75): peak RSS 4,074 MB (from 55 MB); ``/fleet/step/begin`` 200 after 40.2 s (all
  400 MB read); the slowest rollout 39.6 s.
- capped at 8 MiB: peak RSS 64 MB; ``/fleet/step/begin`` 500 in 0.04 s naming that engine ("answer over
  the 8 MiB cap"), which got to send 12.6 MB; the slowest rollout 0.007 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

CHILD = r"""
import asyncio, sys
from aiohttp import web

total = int(sys.argv[1])
line = b"vllm:prompt_tokens_total 1\n"
chunk = line * (256 * 1024 // len(line))

async def health(request):
    return web.Response(status=200)

async def huge(request):
    resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
    await resp.prepare(request)
    sent = 0
    try:
        while sent < total:
            await resp.write(chunk)
            sent += len(chunk)
        await resp.write_eof()
    except ConnectionError:
        pass
    print(f"sent {sent}", flush=True)
    return resp

async def small(request):
    return web.Response(text="vllm:prompt_tokens_total 5\n")

async def completion(request):
    await request.read()
    return web.json_response({"id": "c", "choices": [{"text": "ok"}]})

async def main():
    ports = []
    for metrics in (small, huge):
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/metrics", metrics)
        app.router.add_post("/v1/completions", completion)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        ports.append(runner.addresses[0][1])
    print(" ".join(map(str, ports)), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def memory_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


async def run(mb: int, rollouts_every_s: float) -> dict[str, Any]:
    from router import GenerationRouter
    from router.config import RouterConfig
    from router.http.capability import registration_url

    child = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        CHILD,
        str(mb * 1000 * 1000),
        stdout=asyncio.subprocess.PIPE,
    )
    assert child.stdout is not None
    fast_port, huge_port = (int(p) for p in (await child.stdout.readline()).split())
    admin = secrets.token_urlsafe(24)
    cap = secrets.token_urlsafe(32)
    router = GenerationRouter(
        RouterConfig(
            host="127.0.0.1",
            port=0,
            api_key=secrets.token_urlsafe(24),
            admin_token=admin,
            registration_capability=cap,
            probe_interval_s=1.0,
        )
    )
    base = router.serve_in_background()
    cap_url = registration_url(base, cap)
    latencies: list[tuple[int, float]] = []
    try:
        async with aiohttp.ClientSession() as s:
            for port in (fast_port, huge_port):
                async with s.post(f"{cap_url}/workers", json={"url": f"http://127.0.0.1:{port}"}) as r:
                    assert r.status == 200, await r.text()
            rss_before = memory_kib("VmRSS")
            hwm_before = memory_kib("VmHWM")
            stop = asyncio.Event()

            async def rollouts() -> None:
                while not stop.is_set():
                    t = time.monotonic()
                    async with s.post(f"{cap_url}/v1/completions", json={"prompt": "hi"}) as r:
                        await r.read()
                        latencies.append((r.status, time.monotonic() - t))
                    await asyncio.sleep(rollouts_every_s)

            load = asyncio.create_task(rollouts())
            await asyncio.sleep(0.5)
            t = time.monotonic()
            headers = {"Authorization": f"Bearer {admin}"}
            async with s.post(f"{base}/fleet/step/begin", headers=headers) as r:
                step_status, step_body = r.status, await r.json()
            step_s = time.monotonic() - t
            await asyncio.sleep(0.5)
            stop.set()
            await load
            hwm_after = memory_kib("VmHWM")
    finally:
        router.stop()
        child.kill()
    sent = None
    rest = (await child.stdout.read()).decode()
    for line in rest.splitlines():
        if line.startswith("sent "):
            sent = int(line.split()[1])
    await child.wait()
    times = [x for _, x in latencies]
    return {
        "huge_metrics_mb": mb,
        "router_rss_before_mb": round(rss_before / 1024, 1),
        "router_peak_rss_before_mb": round(hwm_before / 1024, 1),
        "router_peak_rss_after_mb": round(hwm_after / 1024, 1),
        "step_begin": {"status": step_status, "seconds": round(step_s, 3), "body": step_body},
        "huge_engine_sent_mb": round(sent / 1e6, 1) if sent is not None else None,
        "rollouts": {
            "n": len(times),
            "statuses": sorted({st for st, _ in latencies}),
            "median_s": round(statistics.median(times), 4) if times else None,
            "slowest_s": round(max(times), 4) if times else None,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=400, help="size of the huge engine's /metrics (MB)")
    parser.add_argument("--every", type=float, default=0.05, help="seconds between rollouts")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(run(args.mb, args.every)), indent=2))


if __name__ == "__main__":
    main()
