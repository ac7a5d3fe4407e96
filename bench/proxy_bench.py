"""Proxy overhead of the generation router: throughput and latency through it vs. direct.

Arms: ``direct`` (wrk straight at nginx), ``bare_aiohttp`` (bench/bare_proxy.py: the minimal aiohttp
pass-through the issue quotes as a reference, measured in the same run because a shared 2-core machine
swings by a third between minutes), then the router with each policy.

Not a test: it prints figures. Instant backends are nginx (Debian's package) answering a fixed chat JSON
on 8 ports, so the backend is never the bottleneck (a Python backend would be); load comes from ``wrk``
(C, Debian's package) with a Lua script POSTing chat bodies that share a long system prompt and differ
per session, so cache_aware does its real work on every request. The router runs as its own process, as
in production. Also prints the cost of one policy decision at 8 and 1024 backends.

    python bench/proxy_bench.py [--duration 10] [--policies cache_aware least_outstanding] [--json out.json]

Needs: apt-get install nginx-light wrk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
N_BACKENDS = 8
FIXED_REPLY = (
    '{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,'
    '"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],'
    '"usage":{"prompt_tokens":10,"completion_tokens":1,"total_tokens":11}}'
)
WRK_LUA = r"""
-- POST chat bodies: a shared system prompt, then one of 256 sessions with a growing history.
local system = string.rep("You are a coding agent with tools. ", 60)
local bodies = {}
for i = 1, 256 do
  local history = string.rep('{"role":"tool","content":"output of step in session ' .. i .. '"},', i % 7)
  bodies[i] = '{"model":"m","messages":[{"role":"system","content":"' .. system .. '"},' ..
    history .. '{"role":"user","content":"task ' .. i .. '"}],"max_tokens":16}'
end
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"},
                    bodies[(n % 256) + 1])
end
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except Exception:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up") from None
            time.sleep(0.1)


def start_nginx(workdir: Path, ports: list[int]) -> subprocess.Popen[bytes]:
    listens = "\n".join(f"    listen 127.0.0.1:{p} reuseport;" for p in ports)
    conf = f"""
worker_processes 1;
daemon off;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {workdir}/body;
  keepalive_requests 1000000;
  server {{
{listens}
    location / {{ default_type application/json; return 200 '{FIXED_REPLY}'; }}
    location = /health {{ return 200 ''; }}
  }}
}}
"""
    (workdir / "nginx.conf").write_text(conf)
    proc = subprocess.Popen(["nginx", "-c", str(workdir / "nginx.conf"), "-p", str(workdir)])
    wait_http(f"http://127.0.0.1:{ports[0]}/health")
    return proc


def start_router(policy: str, backends: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "launcher.cli", "router", "--policy", policy, "--port", str(port)]
    for b in backends:
        cmd += ["--backend", b]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health")
    return proc, url


def start_bare_proxy(backend: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "bare_proxy.py"), str(port), backend])
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health")
    return proc, url


def run_wrk(url: str, connections: int, duration_s: int, script: Path) -> dict[str, float]:
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{duration_s}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
        check=True,
        timeout=duration_s + 30,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]

    def pct(p: str) -> float:
        m = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert m, out
        scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
        return float(m.group(1)) * scale

    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "rps": rps,
        "p50_ms": pct("50"),
        "p99_ms": pct("99"),
        "non_2xx": float(errors.group(1)) if errors else 0.0,
    }


def cpu_seconds(pid: int) -> float:
    """User+system CPU of a process: per-request CPU is a figure that survives a busy machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decision_cost_us(n_backends: int, policy_name: str, n: int = 20000) -> float:
    sys.path.insert(0, str(ROOT))
    import orjson

    from router.policies import LoadTracker, RouteRequest, make_policy

    backends = [f"http://10.0.{i // 250}.{i % 250}:8000" for i in range(n_backends)]
    load = LoadTracker(backends)
    policy = make_policy(policy_name)
    system = "You are a coding agent with tools. " * 60
    bodies = [
        orjson.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": system},
                    *({"role": "tool", "content": f"step {j} of session {i}"} for j in range(i % 7)),
                    {"role": "user", "content": f"task {i}"},
                ],
            }
        )
        for i in range(512)
    ]
    reqs = [RouteRequest("/v1/chat/completions", body=bodies[i % len(bodies)]) for i in range(n)]
    inflight: list[str] = []
    t0 = time.perf_counter()
    for r in reqs:
        prepared = policy.prepare(r)
        url = policy.choose(prepared, load)
        policy.commit(prepared, url)  # what the router does per decision
        load.acquire(url)
        inflight.append(url)
        if len(inflight) > 256:  # keep ~256 in flight, like a busy fleet
            load.release(inflight.pop(0))
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "least_outstanding", "round_robin"])
    ap.add_argument("--connections", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: apt-get install nginx-light wrk")

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as tmp:
        work = Path(tmp)
        script = work / "post.lua"
        script.write_text(WRK_LUA)
        ports = [free_port() for _ in range(N_BACKENDS)]
        nginx = start_nginx(work, ports)
        try:
            backends = [f"http://127.0.0.1:{p}/v1" for p in ports]
            bare_proc, bare_url = start_bare_proxy(f"http://127.0.0.1:{ports[0]}")
            arms: list[tuple[str, str, subprocess.Popen[bytes] | None]] = [
                ("direct", f"http://127.0.0.1:{ports[0]}", None),
                ("bare_aiohttp", bare_url, bare_proc),
            ]
            for policy in args.policies:
                proc, url = start_router(policy, backends)
                arms.append((policy, url, proc))
            for arm, url, proc in arms:
                try:
                    for c in args.connections:
                        run_wrk(url + "/v1/chat/completions", c, 2, script)  # warm-up
                        cpu0 = cpu_seconds(proc.pid) if proc else 0.0
                        figures = run_wrk(url + "/v1/chat/completions", c, args.duration, script)
                        if proc:
                            used = cpu_seconds(proc.pid) - cpu0
                            figures["router_cpu_us_per_req"] = used / (figures["rps"] * args.duration) * 1e6
                        rows.append({"arm": arm, "connections": c, **figures})
                        cpu = figures.get("router_cpu_us_per_req")
                        print(
                            f"{arm:>18} c={c:<3} {figures['rps']:>9.0f} req/s  p50 {figures['p50_ms']:.3f} ms"
                            f"  p99 {figures['p99_ms']:.3f} ms  non-2xx {figures['non_2xx']:.0f}"
                            + (f"  router CPU {cpu:.0f} us/req" if cpu else ""),
                            flush=True,
                        )
                finally:
                    if proc is not None:
                        proc.send_signal(signal.SIGINT)
                        proc.wait(10)
        finally:
            nginx.send_signal(signal.SIGQUIT)
            nginx.wait(10)

    direct = {r["connections"]: r for r in rows if r["arm"] == "direct"}
    bare = {r["connections"]: r for r in rows if r["arm"] == "bare_aiohttp"}
    for r in rows:
        if r["arm"] not in ("direct", "bare_aiohttp"):
            r["rps_vs_bare_aiohttp"] = round(float(r["rps"]) / float(bare[r["connections"]]["rps"]), 2)
            print(f"{r['arm']} c={r['connections']}: {r['rps_vs_bare_aiohttp']:.2f}x bare aiohttp's req/s")
    for r in rows:
        if r["arm"] != "direct":
            r["added_p50_ms"] = round(float(r["p50_ms"]) - float(direct[r["connections"]]["p50_ms"]), 3)
    print(
        "\nadded p50 at c=1 vs direct:",
        {r["arm"]: r["added_p50_ms"] for r in rows if r["arm"] != "direct" and r["connections"] == 1},
    )
    costs = {}
    for policy in args.policies:
        for n in (8, 1024):
            costs[f"{policy}@{n}"] = round(decision_cost_us(n, policy), 2)
            print(f"decision cost {policy:>18} at {n:>4} backends: {costs[f'{policy}@{n}']:.1f} us")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"rows": rows, "decision_us": costs, "cpus": os.cpu_count()}, indent=2)
        )


if __name__ == "__main__":
    main()
