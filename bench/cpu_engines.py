"""Where a local job's vLLM CPU engines run, and what it costs them: cores per engine, idle CPU, latency.

Submits a local job of ``--engines`` real vLLM CPU engines of the tests' tiny model (``rl-launch submit``,
as a user would) whose training command is this script's ``--inside`` half. Inside the job it reads,
for every engine: vLLM's own "OpenMP thread binding info" (core ids per rank, reserved cpus) from the
engine log, the affinity of every thread of the engine's processes (what ``taskset -p`` shows), the CPU
each engine's worker burns while idle, and the latency of the same fixed requests sent straight to each
engine, first one engine at a time ("alone") and then to all engines at once ("together": where engines
that share a core slow each other down). Bounded: ``--requests`` requests per engine and phase, each
at most 120 s.

    export RL_LAUNCH_VLLM_PYTHON="$(scripts/install-vllm.sh --cpu)"
    flock /tmp/rl-heavy.lock .venv/bin/python bench/cpu_engines.py --engines 2 --requests 6 --streams 4

Prints the report and writes it as JSON (``--json``, default ``<job>/cpu_engines.json``).

Measured on a 2-core machine, back to back (``bench/figures/cpu-engines.json``): before (vLLM's auto
binding) both engines logged "core ids=[0] reserved_cpus=[1]" and both workers ran on core 0; all
engines' requests together took 2.87 s, p90 0.58 s and 1.93 s per engine. After (one core each,
"core ids=[0]" and "core ids=[1]"): 1.37 s, p90 0.28 s and 0.23 s. The price: one engine busy alone is
no longer helped by the other core (its API server and scheduler share its core): median 0.144 s ->
0.232 s for the engine whose server had core 1 to itself before, 0.189 s -> 0.199 s for the other.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.engine_cores import (  # noqa: E402
    cpu_seconds,
    group_processes,
    log_binding,
    server_pgid,
    workers,
)

PROMPT = [17 + (i * 37) % 480 for i in range(32)]
"""Fixed prompt token ids: every run sends the same requests."""


def complete(url: str, key: str, max_tokens: int) -> float:
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    return time.perf_counter() - t0


def figures(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    return {"median_s": statistics.median(s), "p90_s": s[min(len(s) - 1, int(0.9 * len(s)))], "max_s": s[-1]}


def burst(url: str, key: str, requests: int, streams: int, max_tokens: int) -> list[float]:
    """``streams`` concurrent clients, ``requests`` requests each, against one engine: a batch like a
    rollout's, so the engine's worker computes rather than waits on its API server."""
    times: list[float] = []

    def one() -> None:
        times.extend(complete(url, key, max_tokens) for _ in range(requests))

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return times


def inside(requests: int, streams: int, max_tokens: int, idle_s: float) -> dict[str, Any]:
    from launcher.jobdir import JobDir

    job = JobDir(os.environ["RL_JOB_DIR"])
    key = job.read_engine_key()
    entries = [e for listing in job.listings() for e in listing.engines]
    report: dict[str, Any] = {
        "cores": sorted(os.sched_getaffinity(0)),
        "load": {"requests": requests, "streams": streams, "max_tokens": max_tokens},
        "engines": [],
    }
    for e in entries:
        port = int(e.url.rsplit(":", 1)[1])
        pgid = server_pgid(port)
        procs = group_processes(pgid) if pgid else []
        binding = log_binding(Path(e.log)) if e.log else None
        report["engines"].append(
            {
                "id": e.id,
                "url": e.url,
                "log_binding": binding.line() if binding else None,
                "rank_cores": binding.rank_cores if binding else None,
                "processes": [{"pid": p.pid, "title": p.title, "affinity": p.affinity} for p in procs],
                "worker_threads": {
                    str(p.pid): sorted({tuple(c) for c in p.threads.values()}) for p in workers(procs)
                },
                "worker_pids": [p.pid for p in workers(procs)],
            }
        )
    for e in entries:  # warm up: the first request of an engine pays one-off costs
        complete(e.url, key, max_tokens)
    time.sleep(3.0)  # let vLLM's busy loops go idle
    before = {e["id"]: sum(cpu_seconds(p) for p in e["worker_pids"]) for e in report["engines"]}
    time.sleep(idle_s)
    for e in report["engines"]:
        e["idle_worker_cpu_pct"] = (
            100 * (sum(cpu_seconds(p) for p in e["worker_pids"]) - before[e["id"]]) / idle_s
        )
    for e, rec in zip(entries, report["engines"], strict=True):
        t0 = time.perf_counter()
        rec["alone"] = figures(burst(e.url, key, requests, streams, max_tokens))
        rec["alone"]["wall_s"] = time.perf_counter() - t0
    together: dict[str, list[float]] = {r["id"]: [] for r in report["engines"]}

    def stream(url: str, eid: str) -> None:
        together[eid].extend(burst(url, key, requests, streams, max_tokens))

    threads = [threading.Thread(target=stream, args=(e.url, e.id)) for e in entries]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report["together_wall_s"] = time.perf_counter() - t0
    for rec in report["engines"]:
        rec["together"] = figures(together[rec["id"]])
    return report


def show(report: dict[str, Any]) -> None:
    print(f"cores of the job: {report['cores']}; load per engine: {report['load']}")
    for e in report["engines"]:
        print(f"engine {e['id']} ({e['url']}):")
        print(f"  log: {e['log_binding']}")
        for p in e["processes"]:
            print(f"  pid {p['pid']} {p['title'][:40]:40s} affinity {p['affinity']}")
        for pid, sets in e["worker_threads"].items():
            print(f"  worker {pid} threads' affinities: {[list(s) for s in sets]}")
        print(f"  idle worker CPU: {e['idle_worker_cpu_pct']:.0f}%")
        for phase in ("alone", "together"):
            f = e[phase]
            print(
                f"  {phase:8s}: median {f['median_s']:.3f} s, p90 {f['p90_s']:.3f} s, max {f['max_s']:.3f} s"
                + (f", all done in {f['wall_s']:.2f} s" if "wall_s" in f else "")
            )
    print(f"together: all engines' requests done in {report['together_wall_s']:.2f} s")


def outside(args: argparse.Namespace) -> int:
    from tests.support.tiny_model import default_model_dir, ensure_tiny_model

    python = os.environ.get("RL_LAUNCH_VLLM_PYTHON")
    if not python:
        sys.exit(
            "cpu_engines: set RL_LAUNCH_VLLM_PYTHON "
            '(export RL_LAUNCH_VLLM_PYTHON="$(scripts/install-vllm.sh --cpu)")'
        )
    model = ensure_tiny_model(python, Path(args.model) if args.model else default_model_dir())
    root = Path(args.job_root or tempfile.mkdtemp(prefix="cpu-engines-"))
    spec = {
        "name": "cpu-engines",
        "cluster": "local",
        "job_root": str(root),
        "training": {
            "command": f"python {Path(__file__).resolve()} --inside --requests {args.requests} "
            f"--streams {args.streams} "
            f"--max-tokens {args.max_tokens} --idle {args.idle}"
        },
        "generation": {
            "engine": "vllm",
            "model": str(model),
            "served_model_name": "tiny",
            "engines_per_node": args.engines,
            "startup_timeout_s": 600,
            "vllm_args": ["--max-model-len=512", "--enforce-eager"],
            "env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
        },
    }
    path = root / "spec.json"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))
    rl_launch = str(Path(sys.executable).with_name("rl-launch"))
    proc = subprocess.run(
        [rl_launch, "submit", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    jobs = [d for d in root.iterdir() if d.is_dir()]
    result = jobs[0] / "cpu_engines.json" if jobs else None
    if proc.returncode != 0 or result is None or not result.exists():
        print(proc.stdout[-3000:] + proc.stderr[-3000:])
        return 1
    report = json.loads(result.read_text())
    show(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"job: {jobs[0]}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--requests", type=int, default=6, help="requests per client and phase")
    ap.add_argument("--streams", type=int, default=4, help="concurrent clients per engine")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--idle", type=float, default=5.0, help="seconds over which idle CPU is measured")
    ap.add_argument("--model", default=None, help="the tiny model's directory (built there if missing)")
    ap.add_argument("--job-root", default=None)
    ap.add_argument("--json", default=None, help="also write the report here")
    ap.add_argument("--inside", action="store_true", help="(the job's training command)")
    args = ap.parse_args()
    if not args.inside:
        return outside(args)
    report = inside(args.requests, args.streams, args.max_tokens, args.idle)
    Path(os.environ["RL_JOB_DIR"], "cpu_engines.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
