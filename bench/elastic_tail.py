"""The tail policy's trade on a real Slurm cluster: node-seconds given back against wall clock lost.

Runs the same long-tail rollout step as a real job (``rl-launch submit``: one training node whose
command replays the step through the router, two generation nodes of simulated engines) three times: a
static fleet, ``generation.elastic`` on with the drain waiting for the requests in flight
(``tail-wait``: the router's ``continuation_max_moves: 0``, the behaviour before issue 41), and with the
drain moving them to the engines that stay (``tail``: the router continues them, issue 41). It prints for
each the step's wall clock and the generation node-seconds held during it (each node from the step's
first request until the step's end, or until the node went back to Slurm). The targets: at least 25%
fewer node-seconds for at most 5% more wall clock (issue 22); the same node-seconds for at most +1% wall
clock once drains do not wait (issue 41). Also writes a plot of in-flight requests and generation nodes
over time for every arm.

Run it on the login node of the project's local Slurm cluster (3 nodes):

    slurm/cluster.sh start
    slurm/cluster.sh exec .venv/bin/python bench/elastic_tail.py [--scale 0.1] [--seed 1] [--repeats 1]

or, with ``--local``, as local jobs on this machine (the engines, the router and the replay share its
cores: noisier).

``--virtual`` measures the same trade on a virtual clock instead (``launcher.bench.elastic_virtual``: the
simulator's schedulers, the router's policy and the driver's ``TailPolicy``, no job; seconds of CPU, the
same figures every time), for ``--seeds`` traces, with the tail policy's ``--for-s`` swept
(``--sweep-for-s``) so the arms can be compared at equal node-seconds:

    .venv/bin/python bench/elastic_tail.py --virtual --scale 0.5 --seeds 1,2 --sweep-for-s 5,10,20

The in-flight curve is read from each job's request record (a request is in flight from its arrival until
its answer ended), the nodes from the elastic state the driver wrote (``launcher.fleet.elastic.shapes``).
"""

from __future__ import annotations

import argparse
import json
import os
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
    router: dict[str, Any] = {"backend_timeout_s": 60}
    # the drain waits for what is in flight (tail-wait, as before issue 41) or moves it (tail: opt-in)
    router["continuation_max_moves"] = 0 if arm == "tail-wait" else 3
    if arm != "static":
        generation["elastic"] = {
            "floor_nodes": 1,
            "shrink_below": args.shrink_below,
            "for_s": args.for_s,
            "capacity_per_engine": args.capacity_per_engine,
        }
    if args.local:  # one generation node to start with here; the second is grown before the step
        generation["nodes"] = 1
        grow = f"{RL_LAUNCH} fleet grow $RL_JOB_DIR --nodes 1 --wait --timeout 120"
        return {
            "name": f"tail-{arm}",
            "cluster": "local",
            "job_root": str(root),
            "training": {"command": f"{grow} && {replay}"},
            "generation": generation,
            "router": router,
        }
    return {
        "name": f"tail-{arm}",
        "cluster": "slurm",
        "job_root": str(root),
        "slurm": {"partition": "debug", "time": "00:30:00", "cpus_per_task": 2, "gpus_per_node": 0},
        "training": {"nodes": 1, "command": replay},
        "generation": generation,
        "router": router,
    }


def run_arm(arm: str, root: Path, args: argparse.Namespace) -> Path:
    path = root.parent / f"{arm}.yaml"
    path.write_text(yaml.safe_dump(spec_for(arm, root, args), sort_keys=False))
    if args.local:  # a local submit runs the job to its end
        before = set(root.iterdir()) if root.exists() else set()
        done = subprocess.run(
            [RL_LAUNCH, "submit", str(path)], capture_output=True, text=True, timeout=args.timeout_s
        )
        (job,) = set(root.iterdir()) - before
        if JobDir(job).read_result() is None:
            raise SystemExit(f"{arm}: the local job did not finish: {done.stderr.strip()[-2000:]}")
        return job
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
    lines = [json.loads(ln) for f in sorted(record_dir_of(job).glob("requests*.jsonl")) for ln in f.open()]
    moved = {ln["id"] for ln in lines if ln.get("moves")}  # continued on another engine (issue 41)
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
        "router_retries": sum(1 for r in records if len(r.attempts) > 1 and r.id not in moved),
        "moved": len(moved),
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
    fig.suptitle("long-tail step on 2 generation nodes: static fleet vs tail policy (drain waits / moves)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


ARMS = ("static", "tail-wait", "tail")


def virtual(args: argparse.Namespace) -> None:
    """The three arms on a virtual clock, the tail's ``for_s`` swept; one line per arm and seed, then the
    move arm's best wall clock among the settings that save at least the waiting drain's node-seconds."""
    from launcher.bench.elastic_virtual import TailArm, compare_tail
    from launcher.bench.workload import generate
    from launcher.engines.sim.config import SimConfig
    from launcher.fleet.elastic.tail import TailSettings

    sweep = [float(x) for x in args.sweep_for_s.split(",")] if args.sweep_for_s else [args.for_s]
    out: list[dict[str, Any]] = []
    for seed in [int(x) for x in args.seeds.split(",")]:
        trace = generate("longtail", seed=seed, scale=args.scale)
        arms = [TailArm("static")]
        for for_s in sweep:
            st = TailSettings(floor_nodes=1, shrink_below=args.shrink_below, for_s=for_s)
            arms += [
                TailArm(f"tail-wait for_s={for_s:g}", st),
                TailArm(f"tail for_s={for_s:g}", st, move=True),
            ]
        rows = compare_tail(
            trace, arms, config=SimConfig(speed=args.sim_speed), capacity_per_engine=args.capacity_per_engine
        )
        for r in rows:
            r["seed"] = seed
            print(
                f"seed {seed} {r['arm']:22s} wall {r['wall_s']:8.2f} s ({r['wall_pct']:+5.2f}%)  "
                f"node-s {r['node_s']:8.2f} ({r['node_s_saved_pct']:5.2f}% fewer)  "
                f"released {r['released_at']}  moved {r['moved']} ({r['moved_tokens']} tokens kept)",
                flush=True,
            )
        wait = rows[1]  # the waiting drain at the first setting: the 'before'
        same = [r for r in rows if r["arm"].startswith("tail ") and r["node_s"] <= wait["node_s"] + 1e-9]
        if same:
            best = min(same, key=lambda r: r["wall_s"])
            print(
                f"seed {seed}: before ({wait['arm']}): {wait['node_s_saved_pct']:.2f}% fewer node-s for "
                f"{wait['wall_pct']:+.2f}% wall; after, the same or more node-s saved ({best['arm']}): "
                f"{best['node_s_saved_pct']:.2f}% for {best['wall_pct']:+.2f}% wall (target <= +1%)",
                flush=True,
            )
        out += rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = args.out.with_name(args.out.name + "-virtual.json")
    path.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": out}, indent=2))
    print(f"wrote {path}")


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
    parser.add_argument("--virtual", action="store_true", help="on a virtual clock, no job (see above)")
    parser.add_argument("--local", action="store_true", help="local jobs (cluster: local) instead of Slurm")
    parser.add_argument("--seeds", default="1", help="--virtual: the traces, comma-separated")
    parser.add_argument("--sweep-for-s", default="", help="--virtual: for_s values to try, comma-separated")
    args = parser.parse_args()
    if args.virtual:
        if os.environ.get("PYTHONHASHSEED") != "0":  # the figures depend on it (elastic_virtual's doc)
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "PYTHONHASHSEED": "0"})
        virtual(args)
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="elastic-tail-") as tmp:
        for k in range(args.repeats):
            results = {}
            for arm in ARMS:
                root = Path(tmp) / f"r{k}" / "jobs"
                root.mkdir(parents=True, exist_ok=True)
                results[arm] = measure(run_arm(arm, root, args))
                r = results[arm]
                print(
                    f"run {k + 1} {arm:6s}: wall {r['wall_s']:7.1f} s  node-s {r['node_s']:7.1f}  "
                    f"sessions {r['sessions']} errors {r['errors']} retries {r['retries']} "
                    f"failed {r['failed_requests']} router-retried {r['router_retries']} moved {r['moved']}",
                    flush=True,
                )
                for line in r["decisions"]:
                    print(f"    {line}")
            runs.append(results)
            s = results["static"]
            for arm in ARMS[1:]:
                t = results[arm]
                print(
                    f"run {k + 1} {arm}: node-seconds {100 * (1 - t['node_s'] / s['node_s']):.1f}% fewer, "
                    f"wall clock {100 * (t['wall_s'] / s['wall_s'] - 1):+.1f}% "
                    "(targets: >= 25% fewer for <= +5%; moving drains: the same for <= +1%)",
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
