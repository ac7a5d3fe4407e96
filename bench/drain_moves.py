"""How long a drain holds a node with long generations in flight: waiting for them against moving them.

The case the tail policy's drain was slow for (issue 41): a node given back while its engines run long
generations. Runs a local job twice (``cluster: local``: one generation node, a second grown at the start;
simulated engines at speed 1, the builtin router), once with ``router.continuation_max_moves: 0`` (the
drain waits for the requests in flight, as before) and once with moves on (the drain moves them to the
engines that stay). Its training command sends ``--requests`` completions of ``--max-tokens`` tokens
through the router, and once they run, shrinks the fleet by the grown node (``rl-launch fleet shrink
--wait``). Printed for each: how long the shrink took (its call, and the driver's "drained in" event),
the requests moved (the request record), and whether every answer came back whole.

    .venv/bin/python bench/drain_moves.py [--requests 8] [--max-tokens 2000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import yaml

from launcher.jobdir import JobDir
from launcher.jobdir.paths import record_dir

RL_LAUNCH = str(Path(sys.executable).with_name("rl-launch"))

TRAINER = textwrap.dedent(
    """\
    import json, os, subprocess, sys, threading, time, urllib.request
    job, n, max_tokens = os.environ["RL_JOB_DIR"], int(sys.argv[1]), int(sys.argv[2])
    rl = os.path.join(os.path.dirname(sys.executable), "rl-launch")
    def fleet(*args):
        t0 = time.time()
        p = subprocess.run([rl, "fleet", *args], capture_output=True, text=True, timeout=300)
        return {"code": p.returncode, "out": p.stdout.strip(), "err": p.stderr.strip(), "s": time.time() - t0}
    out = {"grow": fleet("grow", job, "--nodes", "1", "--wait", "--timeout", "120"), "answers": [None] * n}
    url = os.environ["RL_POLICY_BASE_URL"].rstrip("/").removesuffix("/v1") + "/v1/completions"
    key = os.environ["RL_POLICY_API_KEY"]
    def one(i):
        body = {"model": "sim-8b", "prompt": f"request {i}: a long story", "max_tokens": max_tokens,
                "ignore_eos": True, "return_token_ids": True}
        req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
            "Authorization": "Bearer " + key, "Content-Type": "application/json"})
        try:
            got = json.load(urllib.request.urlopen(req, timeout=600))
            ch = got["choices"][0]
            out["answers"][i] = {"tokens": len(ch["token_ids"]), "finish": ch["finish_reason"]}
        except Exception as exc:
            out["answers"][i] = {"error": repr(exc)[:200]}
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t_start = time.time()
    for t in threads:
        t.start()
    time.sleep(3)  # every request runs, part of each made
    out["shrink"] = fleet("shrink", job, "--nodes", "1", "--wait", "--timeout", "300")
    for t in threads:
        t.join()
    out["answers_s"] = time.time() - t_start
    json.dump(out, open(os.path.join(job, "drain_moves.json"), "w"))
    """
)


def run(max_moves: int, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    script = root / "trainer.py"
    script.write_text(TRAINER)
    jobs = root / f"jobs-{max_moves}"
    spec = {
        "name": f"drain-moves-{max_moves}",
        "cluster": "local",
        "job_root": str(jobs),
        "training": {"command": f"{sys.executable} {script} {args.requests} {args.max_tokens}"},
        "generation": {
            "engine": "sim",
            "engines_per_node": 2,
            "served_model_name": "sim-8b",
            "sim": {"speed": 1.0},
            "drain_timeout_s": 300,
        },
        "router": {"continuation_max_moves": max_moves, "backend_timeout_s": 600},
    }
    path = root / f"spec-{max_moves}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    done = subprocess.run([RL_LAUNCH, "submit", str(path)], capture_output=True, text=True, timeout=900)
    (job,) = list(jobs.iterdir())
    out_file = job / "drain_moves.json"
    if not out_file.exists():
        raise SystemExit(f"max_moves {max_moves}: no result ({job}): {done.stderr.strip()[-2000:]}")
    out = json.loads(out_file.read_text())
    drained = [e["detail"] for e in JobDir(job).read_events() if e.get("action") == "node_released"]
    lines = [json.loads(ln) for f in sorted(record_dir(job).glob("requests*.jsonl")) for ln in f.open()]
    out["moves"] = [m for ln in lines for m in ln.get("moves") or ()]
    out["released"] = drained
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="drain-moves-") as tmp:
        for max_moves in (0, 3):
            root = Path(tmp) / f"m{max_moves}"
            root.mkdir()
            r = run(max_moves, root, args)
            answers = r["answers"]
            whole = sum(1 for a in answers if a and a.get("tokens") == args.max_tokens)
            print(
                f"continuation_max_moves {max_moves}: shrink --wait took {r['shrink']['s']:.1f} s "
                f"({'; '.join(r['released']) or 'no release event'}); {len(r['moves'])} move(s) "
                f"{sorted({m['reason'] for m in r['moves']})}; {whole}/{len(answers)} answers whole "
                f"({args.max_tokens} tokens); every answer in {r['answers_s']:.1f} s",
                flush=True,
            )
            bad = [a for a in answers if not a or a.get("tokens") != args.max_tokens]
            if bad:
                print(f"    not whole: {bad}")


if __name__ == "__main__":
    main()
