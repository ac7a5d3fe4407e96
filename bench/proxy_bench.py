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

    python bench/proxy_bench.py --mode gym --connections 1 256 --policies cache_aware \
        --workers 1 2 all --repeats 2 --sglang /tmp/sgl/bin/smg

``--mode gym``: Gym-shaped traffic (see ``GYM_LUA``): ~40 KB requests that grow turn by turn, ~41 KB
logprob answers, one request in ten streamed (SSE). ``--workers``: router arms at these worker counts.
``--sglang``: SGLang's gateway (``pip install sglang-router`` in a throw-away venv; not a dependency).
``--record on|both``: router arms with the request record on (``router.record``), or both ways.
Router CPU per request counts the router's worker processes too.

Needs: apt-get install nginx-light wrk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script from a checkout: the project's own modules

from router.ports import free_port  # noqa: E402  (after the path, on purpose)

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


# -- Gym-shaped traffic (--mode gym) ------------------------------------------------------------------------
# What NeMo-Gym sends a fleet: every turn resends the whole conversation (a 6 KB system prompt and task,
# then ~2.4 KB more per turn: the assistant reply as returned and the tool output), non-streaming chat
# with logprobs and token ids, so each answer carries ~41 KB of logprobs. One request in ten is a
# streamed completion (SSE) of the same size. 256 sessions advance one turn per request, cycling through
# turns 0..GYM_TURNS-1 (mean body ~40 KB).
GYM_TURNS = 28
GYM_LUA = r"""
local system = string.rep("You are a coding agent with tools: bash, edit, search, test. ", 100)
local reply = string.rep("I will run the tests and read the failing assertion first. ", 20)
local tool = string.rep("tests/test_x.py::test_case FAILED assert 1 == 2 at line 42 ", 20)
local sessions = {}
for i = 1, 256 do sessions[i] = (i * 7) % __TURNS__ end
local n = 0
local function chat(i, t)
  local parts = {'{"model":"m","logprobs":true,"top_logprobs":0,"return_tokens_as_token_ids":true,',
                 '"messages":[{"role":"system","content":"', system, '"},',
                 '{"role":"user","content":"task ', i, ': make the failing test pass"}'}
  for k = 1, t do
    parts[#parts + 1] = ',{"role":"assistant","content":"turn ' .. k .. ' ' .. reply .. '"}'
    parts[#parts + 1] = ',{"role":"user","content":"' .. tool .. '"}'
  end
  parts[#parts + 1] = '],"max_tokens":512}'
  return table.concat(parts)
end
request = function()
  n = n + 1
  local i = (n % 256) + 1
  local t = sessions[i]
  sessions[i] = (t + 1) % __TURNS__
  if n % 10 == 0 then
    return wrk.format("POST", "/v1/completions", {["Content-Type"] = "application/json"},
                      '{"model":"m","stream":true,"prompt":"task ' .. i .. ' ' .. reply .. '"}')
  end
  return wrk.format("POST", "/v1/chat/completions", {["Content-Type"] = "application/json"}, chat(i, t))
end
""".replace("__TURNS__", str(GYM_TURNS))


def gym_reply(n_tokens: int = 420) -> str:
    """A chat completion with per-token logprobs and token ids, as vLLM answers Gym (~41 KB)."""
    entries = ",".join(
        f'{{"token":"token_id:{1000 + i}","logprob":-0.{i % 97:02d}1234,"bytes":[116,111,107],'
        f'"top_logprobs":[]}}'
        for i in range(n_tokens)
    )
    return (
        '{"id":"chatcmpl-1","object":"chat.completion","model":"m","choices":[{"index":0,'
        '"message":{"role":"assistant","content":"'
        + "ok " * 400
        + '"},"logprobs":{"content":['
        + entries
        + ']},"finish_reason":"stop"}],"usage":{"prompt_tokens":9000,"completion_tokens":420}}'
    )


def gym_stream(n_events: int = 300) -> str:
    """A streamed completion (SSE) of about the same size."""
    event = (
        'data: {"id":"cmpl-1","object":"text_completion",'
        '"choices":[{"index":0,"text":" tok","logprobs":null}]}'
    )
    return "".join(f"{event}{' ' * (i % 7)}\n\n" for i in range(n_events)) + "data: [DONE]\n\n"


def gym_mean_request_bytes() -> float:
    """Mean request body of the Gym-shaped mix (what wrk sends), for bytes/s."""
    system = len("You are a coding agent with tools: bash, edit, search, test. ") * 100
    reply = len("I will run the tests and read the failing assertion first. ") * 20
    tool = len("tests/test_x.py::test_case FAILED assert 1 == 2 at line 42 ") * 20
    base = (
        len(
            '{"model":"m","logprobs":true,"top_logprobs":0,"return_tokens_as_token_ids":true,"messages":'
            '[{"role":"system","content":""},{"role":"user","content":"task 100: make the failing test '
            'pass"}],"max_tokens":512}'
        )
        + system
    )
    per_turn = len(',{"role":"assistant","content":"turn 10 "},{"role":"user","content":""}') + reply + tool
    chat = base + per_turn * (GYM_TURNS - 1) / 2
    stream = len('{"model":"m","stream":true,"prompt":"task 100 "}') + reply
    return 0.9 * chat + 0.1 * stream


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


def start_nginx(workdir: Path, ports: list[int], gym: bool = False) -> subprocess.Popen[bytes]:
    listens = "\n".join(f"    listen 127.0.0.1:{p} reuseport;" for p in ports)
    if gym:
        # Static files answer POST through the 405 -> 200 redirect (nginx's static module refuses POST);
        # a 41 KB answer is too long for a `return` string in nginx's configuration.
        # nginx's workers drop to an unprivileged user when started as root: they must reach the files.
        workdir.chmod(0o711)
        (workdir / "www").mkdir(mode=0o755, exist_ok=True)
        (workdir / "www" / "chat.json").write_text(gym_reply())
        (workdir / "www" / "stream.sse").write_text(gym_stream())
        locations = f"""
    root {workdir}/www;
    types {{ application/json json; text/event-stream sse; }}
    error_page 405 =200 $uri;
    location = /v1/chat/completions {{ default_type application/json; try_files /chat.json =404; }}
    location = /v1/completions {{ default_type text/event-stream; try_files /stream.sse =404; }}
    location = /health {{ return 200 ''; }}"""
    else:
        locations = f"""
    location / {{ default_type application/json; return 200 '{FIXED_REPLY}'; }}
    location = /health {{ return 200 ''; }}"""
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
  client_max_body_size 16m;
  client_body_buffer_size 256k;
  server {{
{listens}
{locations}
  }}
}}
"""
    (workdir / "nginx.conf").write_text(conf)
    proc = subprocess.Popen(["nginx", "-c", str(workdir / "nginx.conf"), "-p", str(workdir)])
    wait_http(f"http://127.0.0.1:{ports[0]}/health")
    return proc


def start_router(
    policy: str, backends: list[str], work: Path, workers: int = 1, record: Path | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """``rl-launch router`` on 127.0.0.1 with a throw-away admin token (a router without any secret does
    not start; the proxied routes the bench sends need none). ``record``: its request record directory
    (``--record-dir``), emptied first."""
    port = free_port()
    token = work / "admin_token"
    if not token.exists():
        token.touch(mode=0o600)
        token.write_text(secrets.token_urlsafe(24))
    cmd = [sys.executable, "-m", "launcher.cli", "router", "--policy", policy, "--port", str(port)]
    cmd += ["--workers", str(workers), "--probe-interval-s", "0", "--admin-token-file", str(token)]
    for b in backends:
        cmd += ["--backend", b]
    if record is not None:
        shutil.rmtree(record, ignore_errors=True)
        cmd += ["--record-dir", str(record)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 60)
    return proc, url


def start_sglang(smg: str, backends: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    """SGLang's model gateway (``smg``, from the ``sglang-router`` wheel) with cache_aware, for comparison
    only: it is not a dependency. Always on 127.0.0.1 (it binds 0.0.0.0 by default)."""
    port, metrics_port = free_port(), free_port()
    cmd = [
        smg,
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "cache_aware",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        "--worker-urls",
        *(b.removesuffix("/v1") for b in backends),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 60)
    return proc, url


def tree_cpu_seconds(pid: int) -> float:
    """CPU of a process and its children (a router's worker processes)."""
    total = cpu_seconds(pid)
    for task in Path(f"/proc/{pid}/task").iterdir():  # children hang off the thread that started them
        try:
            for child in (task / "children").read_text().split():
                total += tree_cpu_seconds(int(child))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


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
    transfer = re.search(r"Transfer/sec:\s+([\d.]+)(B|KB|MB|GB)", out)
    unit = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}
    return {
        "resp_bytes_s": float(transfer.group(1)) * unit[transfer.group(2)] if transfer else 0.0,
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


def parse_workers(values: list[str]) -> list[int]:
    from router.config import default_worker_count

    out: list[int] = []
    for v in values:
        n = default_worker_count() if v == "all" else int(v)
        if n not in out:
            out.append(n)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    ap.add_argument(
        "--mode", choices=("small", "gym"), default="small", help="traffic shape (see module doc)"
    )
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "least_outstanding", "round_robin"])
    ap.add_argument("--connections", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--workers", nargs="+", default=["1"], help="router worker counts: numbers or 'all'")
    ap.add_argument("--repeats", type=int, default=1, help="run every arm this many times, alternating")
    ap.add_argument("--sglang", default=None, metavar="SMG", help="path of SGLang's `smg`: adds its arm")
    ap.add_argument("--no-direct", action="store_true", help="skip the direct arm")
    ap.add_argument(
        "--record",
        choices=("off", "on", "both"),
        default="off",
        help="router arms with the request record on (--record-dir in the run's temporary directory); "
        "both: each router arm twice, without and with, alternating",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    for tool in ("nginx", "wrk"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: apt-get install nginx-light wrk")
    gym = args.mode == "gym"
    workers = parse_workers(args.workers)
    request_bytes = gym_mean_request_bytes() if gym else None

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="proxy-bench-") as tmp:
        work = Path(tmp)
        script = work / "post.lua"
        script.write_text(GYM_LUA if gym else WRK_LUA)
        ports = [free_port() for _ in range(N_BACKENDS)]
        nginx = start_nginx(work, ports, gym=gym)
        try:
            backends = [f"http://127.0.0.1:{p}/v1" for p in ports]
            starters: list[tuple[str, object]] = []
            if not args.no_direct:
                starters.append(("direct", lambda: (None, f"http://127.0.0.1:{ports[0]}")))
            starters.append(("bare_aiohttp", lambda: start_bare_proxy(f"http://127.0.0.1:{ports[0]}")))
            records = {"off": [False], "on": [True], "both": [False, True]}[args.record]
            for policy in args.policies:
                for n in workers:
                    for rec in records:
                        name = policy if n == 1 and len(workers) == 1 else f"{policy} w={n}"
                        name += " +record" if rec else ""
                        where = work / f"record-{policy}-{n}" if rec else None
                        launch = lambda policy=policy, n=n, where=where: start_router(  # noqa: E731
                            policy, backends, work, n, where
                        )
                        starters.append((name, launch))
            if args.sglang:
                starters.append(("sglang cache_aware", lambda: start_sglang(args.sglang, backends)))
            for rep in range(args.repeats):
                for arm, start in starters:
                    proc, url = start()  # type: ignore[operator]
                    try:
                        for c in args.connections:
                            run_wrk(url + "/v1/chat/completions", c, 2, script)  # warm-up
                            cpu0 = tree_cpu_seconds(proc.pid) if proc else 0.0
                            figures = run_wrk(url + "/v1/chat/completions", c, args.duration, script)
                            if proc:
                                used = tree_cpu_seconds(proc.pid) - cpu0
                                figures["router_cpu_us_per_req"] = (
                                    used / (figures["rps"] * args.duration) * 1e6
                                )
                            if request_bytes:
                                figures["req_bytes_s"] = figures["rps"] * request_bytes
                            rows.append({"arm": arm, "connections": c, "repeat": rep, **figures})
                            cpu = figures.get("router_cpu_us_per_req")
                            print(
                                f"{arm:>22} c={c:<3} {figures['rps']:>8.0f} req/s "
                                f" in {figures.get('req_bytes_s', 0) / 1e6:6.1f} MB/s"
                                f" out {figures['resp_bytes_s'] / 1e6:6.1f} MB/s"
                                f"  p50 {figures['p50_ms']:.3f} ms  p99 {figures['p99_ms']:.3f} ms"
                                f"  non-2xx {figures['non_2xx']:.0f}"
                                + (f"  CPU {cpu:.0f} us/req" if cpu else ""),
                                flush=True,
                            )
                    finally:
                        if proc is not None:
                            proc.send_signal(signal.SIGINT)
                            try:
                                proc.wait(15)
                            except subprocess.TimeoutExpired:
                                proc.kill()
                                proc.wait()
        finally:
            nginx.send_signal(signal.SIGQUIT)
            nginx.wait(10)

    def mean(arm: str, c: int, key: str) -> float | None:
        values = [float(r[key]) for r in rows if r["arm"] == arm and r["connections"] == c]  # type: ignore[arg-type]
        return sum(values) / len(values) if values else None

    arms = list(dict.fromkeys(str(r["arm"]) for r in rows))
    print("\nmeans over repeats:")
    for c in args.connections:
        bare = mean("bare_aiohttp", c, "rps")
        direct_p50 = mean("direct", c, "p50_ms")
        for arm in arms:
            rps = mean(arm, c, "rps")
            if rps is None:
                continue
            extra = f"  {rps / bare:.2f}x bare aiohttp" if bare and arm != "bare_aiohttp" else ""
            if direct_p50 is not None and arm != "direct":
                extra += f"  added p50 {mean(arm, c, 'p50_ms') - direct_p50:.3f} ms"  # type: ignore[operator]
            print(
                f"{arm:>22} c={c:<3} {rps:>8.0f} req/s  p50 {mean(arm, c, 'p50_ms'):.3f} ms"
                f"  p99 {mean(arm, c, 'p99_ms'):.3f} ms{extra}"
            )
    costs = {}
    if not gym:
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
