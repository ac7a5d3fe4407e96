"""The tail policy's trade on a real Slurm cluster: node-seconds given back against wall clock lost.

Runs the same long-tail rollout step twice as a real job (``rl-launch submit``: one training node whose
command replays the step through the router, two generation nodes of simulated engines), once as a static
fleet and once with ``generation.elastic`` on, and prints for each the step's wall clock and the
generation node-seconds held during it (each node from the step's first request until the step's end, or
until the node went back to Slurm). The target (issue 22): at least 25% fewer node-seconds for at most 5%
more wall clock. Also writes a plot of in-flight requests and generation nodes over time for both arms.

Run it on the login node of the project's local Slurm cluster (3 nodes):

    slurm/cluster.sh start
    slurm/cluster.sh exec .venv/bin/python bench/elastic_tail.py [--scale 0.1] [--seed 1] [--repeats 1]

The in-flight curve is read from each job's request record (a request is in flight from its arrival until
its answer ended), the nodes from the elastic state the driver wrote (``launcher.fleet.elastic.shapes``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from launcher.jobdir import JobDir
from launcher.jobdir.paths import record_dir as record_dir_of
from router.record.format import read_records

RL_LAUNCH = str(Path(sys.executable).with_name("rl-launch"))


def spec_for(arm: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    replay = (
        f"{RL_LAUNCH} bench replay --url $RL_POLICY_BASE_URL --workload longtail --scale {args.scale} "
        f"--seed {args.seed} --retry-attempts 3 --json $RL_JOB_DIR/replay.json --results-dir $RL_JOB_DIR"
    )
    generation: dict[str, Any] = {
        "nodes": 2,
        "engine": "sim",
        "engines_per_node": 2,
        "served_model_name": "sim-8b",
        "startup_timeout_s": 60,
        "sim": {"speed": args.sim_speed},
        "drain_timeout_s": 120,
    }
    if arm == "tail":
        generation["elastic"] = {
            "floor_nodes": 1,
            "shrink_below": args.shrink_below,
            "for_s": args.for_s,
            "capacity_per_engine": args.capacity_per_engine,
        }
    return {
        "name": f"tail-{arm}",
        "cluster": "slurm",
        "job_root": str(root),
        "slurm": {"partition": "debug", "time": "00:30:00", "cpus_per_task": 2, "gpus_per_node": 0},
        "training": {"nodes": 1, "command": replay},
        "generation": generation,
        "router": {"backend_timeout_s": 60},
    }


def run_arm(arm: str, root: Path, args: argparse.Namespace) -> Path:
    path = root.parent / f"{arm}.yaml"
    path.write_text(yaml.safe_dump(spec_for(arm, root, args), sort_keys=False))
    out = subprocess.run(
        [RL_LAUNCH, "submit", str(path), "--json"], capture_output=True, text=True, timeout=120
    )
    if out.returncode != 0:
        raise SystemExit(f"{arm}: submit failed: {out.stderr.strip()}")
    job = Path(json.loads(out.stdout)["job_dir"])
    deadline = time.monotonic() + args.timeout_s
    while JobDir(job).read_result() is None or not (JobDir(job).read_state().get("elastic") or {}).get(
        "final"
    ):
        if time.monotonic() > deadline:
            subprocess.run([RL_LAUNCH, "cancel", str(job)], capture_output=True, timeout=60)
            raise SystemExit(f"{arm}: not done within {args.timeout_s:g} s ({job})")
        time.sleep(2)
    return job


def measure(job: Path) -> dict[str, Any]:
    jd = JobDir(job)
    result = jd.read_result()
    records = [r for r in read_records(record_dir_of(job)).records if r.path.startswith("/v1/")]
    if not records:
        raise SystemExit(f"{job}: no request recorded ({result})")
    start = min(r.t for r in records)
    end = max(r.t + (r.duration_s or 0.0) for r in records)
    elastic = jd.read_state().get("elastic") or {}
    node_s = 0.0
    nodes_over_time: list[tuple[float, int]] = []
    rows = elastic.get("nodes") or []
    for n in rows:
        held_from, held_to = max(start, n["since"]), min(end, n.get("released_at") or end)
        node_s += max(0.0, held_to - held_from)
    for t in [start + i * (end - start) / 400 for i in range(401)]:
        nodes_over_time.append(
            (t - start, sum(1 for n in rows if n["since"] <= t < (n.get("released_at") or float("inf"))))
        )
    replay = json.loads((job / "replay.json").read_text())["rows"][0]
    events = [e for e in jd.read_events() if e.get("phase") == "elastic"]
    return {
        "job": str(job),
        "exit_code": result.exit_code if result else None,
        "wall_s": round(end - start, 2),
        "node_s": round(node_s, 1),
        "sessions": replay["sessions"],
        "errors": replay["errors"],
        "retries": replay["retries"],
        "failed_requests": replay["failed_requests"],
        "requests": len(records),
        "router_retries": sum(1 for r in records if len(r.attempts) > 1),
        "in_flight": [(r.t - start, r.t - start + (r.duration_s or 0.0)) for r in records],
        "nodes_over_time": nodes_over_time,
        "decisions": [e["detail"] for e in events if e.get("action") in ("policy", "node_released")],
    }


def in_flight_curve(
    spans: list[tuple[float, float]], end: float, points: int = 400
) -> tuple[list[float], list[int]]:
    ts = [i * end / points for i in range(points + 1)]
    return ts, [sum(1 for a, b in spans if a <= t < b) for t in ts]


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for arm, r in results.items():
        ts, counts = in_flight_curve(r["in_flight"], r["wall_s"])
        axes[0].plot(ts, counts, label=f"{arm} ({r['wall_s']:.0f} s)")
        nt, nn = zip(*r["nodes_over_time"], strict=True)
        axes[1].step(nt, nn, where="post", label=f"{arm} ({r['node_s']:.0f} node-s)")
    axes[0].set_ylabel("requests in flight")
    axes[1].set_ylabel("generation nodes held")
    axes[1].set_xlabel("seconds since the step's first request")
    axes[1].set_ylim(0, 2.5)
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle("long-tail step on 2 generation nodes: static fleet vs tail policy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sim-speed", type=float, default=1.0)
    parser.add_argument("--shrink-below", type=float, default=0.25)
    parser.add_argument("--for-s", type=float, default=5.0)
    parser.add_argument("--capacity-per-engine", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results/elastic-tail"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="elastic-tail-") as tmp:
        for k in range(args.repeats):
            results = {}
            for arm in ("static", "tail"):
                root = Path(tmp) / f"r{k}" / "jobs"
                root.mkdir(parents=True, exist_ok=True)
                results[arm] = measure(run_arm(arm, root, args))
                r = results[arm]
                print(
                    f"run {k + 1} {arm:6s}: wall {r['wall_s']:7.1f} s  node-s {r['node_s']:7.1f}  "
                    f"sessions {r['sessions']} errors {r['errors']} retries {r['retries']} "
                    f"failed {r['failed_requests']} router-retried {r['router_retries']}",
                    flush=True,
                )
                for line in r["decisions"]:
                    print(f"    {line}")
            runs.append(results)
            s, t = results["static"], results["tail"]
            print(
                f"run {k + 1}: node-seconds {100 * (1 - t['node_s'] / s['node_s']):+.1f}% fewer, "
                f"wall clock {100 * (t['wall_s'] / s['wall_s'] - 1):+.1f}% "
                "(target: >= 25% fewer for <= +5%)",
                flush=True,
            )
            plot(results, args.out.with_name(f"{args.out.name}-{k + 1}.png"))
    slim = [
        {
            arm: {k: v for k, v in r.items() if k not in ("in_flight", "nodes_over_time")}
            for arm, r in res.items()
        }
        for res in runs
    ]
    args.out.with_suffix(".json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "runs": slim}, indent=2)
    )
    print(f"wrote {args.out}-*.png and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
