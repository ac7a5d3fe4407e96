"""The request record of a local job, and the dashboard's view of it, as a user meets them:

* the job's record (``<job>/record``, on by default) has one line per request the replay sent, with the
  engines and tokens the engines' own counters show, and the finished job's plots;
* ``rl-launch status`` in a terminal (tmux) during the job names the sessions the replay's own report
  lists as the slowest (the replay sends ``X-Session-ID``; the record keeps only its hash).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from router.record.draft import session_hash
from router.record.format import read_records
from tests.support.cli import RL_LAUNCH
from tests.support.specs import local_spec, sim, trainer_command, write_spec

pytestmark = pytest.mark.ray

TRAINER = textwrap.dedent(
    """\
    import json, os, subprocess, sys, time, urllib.request
    job = os.environ["RL_JOB_DIR"]
    subprocess.run(["rl-launch", "bench", "replay", "--url", os.environ["RL_POLICY_BASE_URL"], "--workload",
                    "longtail", "--scale", "0.05", "--seed", "7", "--session-header",
                    "--json", os.path.join(job, "replay.json")], check=True)
    from launcher.jobdir import JobDir
    from router.prometheus import metric_sum, parse_metrics
    counters = {}
    for e in JobDir(job).engine_entries():
        req = urllib.request.Request(e.url + "/metrics",  # the engines take the job's engine key only
                                     headers={"Authorization": "Bearer " + JobDir(job).read_engine_key()})
        text = urllib.request.urlopen(req, timeout=5).read().decode()
        m = parse_metrics(text, ("vllm:",))
        counters[e.url] = {"requests": metric_sum(m, "vllm:request_success_total"),
                           "tokens": metric_sum(m, "vllm:generation_tokens_total")}
    json.dump(counters, open(os.path.join(job, "engine_counters.json"), "w"))
    if sys.argv[1] == "hold":  # stay up (bounded) while the test looks at the dashboard
        open(os.path.join(job, "ready"), "w").close()
        deadline = time.time() + 120
        while not os.path.exists(os.path.join(job, "release")) and time.time() < deadline:
            time.sleep(0.2)
    """
)


def _job(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], Path]:
    spec = local_spec(
        "rec",
        root=tmp_path / "jobs",
        command=trainer_command(tmp_path, TRAINER, mode),
        generation=sim(3, speed=10),
    )
    path = write_spec(tmp_path / "spec.yaml", spec)
    proc = subprocess.Popen(
        [RL_LAUNCH, "submit", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "jobs").exists() or not list((tmp_path / "jobs").iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None, "the job did not start"
        time.sleep(0.2)
    (job,) = list((tmp_path / "jobs").iterdir())
    return proc, job


def test_a_jobs_record_matches_what_the_replay_sent_and_the_engines_counted(tmp_path: Path) -> None:
    proc, job = _job(tmp_path, "run")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    report = read_records(job / "record")
    assert not report.skipped, report.summary()
    replay = json.loads((job / "replay.json").read_text())
    row = replay["rows"][0]
    assert row["errors"] == 0
    assert len(report.records) == row["requests"]  # one line per request the replay sent (none failed)
    counters = json.loads((job / "engine_counters.json").read_text())
    by_engine = Counter(r.engine for r in report.records)
    tokens = Counter()
    for r in report.records:
        tokens[r.engine] += r.completion_tokens or 0
    for url, c in counters.items():
        assert by_engine[url] == c["requests"], (url, by_engine, counters)
        assert tokens[url] == c["tokens"], (url, tokens, counters)
    assert all(r.session for r in report.records) and all(r.prefix for r in report.records)
    assert not any(r.text for r in report.records)  # no prompt text unless the spec asks
    assert (job / "plots" / "timeline.png").stat().st_size > 0 and (job / "plots" / "engines.png").exists()
    print(f"\nrecord: {report.summary()}; engines {dict(by_engine)}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_dashboard_in_a_terminal_names_the_replays_slowest_sessions(tmp_path: Path) -> None:
    proc, job = _job(tmp_path, "hold")
    name = f"rl-status-{job.name}"[-40:]
    try:
        deadline = time.monotonic() + 240
        while not (job / "ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the replay did not finish"
            time.sleep(0.3)
        subprocess.run(
            # the pane's own size: COLUMNS/LINES left in this process's environment (tmux hands them on)
            # would override the 220x80 terminal rich measures
            [
                "tmux",
                "new-session",
                "-d",
                "-s",
                name,
                "-x",
                "220",
                "-y",
                "80",
                f"env -u COLUMNS -u LINES {RL_LAUNCH} status {job}",
            ],
            check=True,
        )
        time.sleep(5)  # a few refreshes
        screen = subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)
        (job / "release").touch()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    (slowest,) = json.loads((job / "replay.json").read_text())["slowest"].values()
    named = [session_hash(s["session"]) for s in slowest[:3]]
    assert "slowest sessions" in screen, screen
    missing = [h for h in named if h not in screen]
    ids = [s["session"] for s in slowest[:3]]
    print(f"\nreplay's slowest: {ids} -> {named}; all on the dashboard: {not missing}")
    assert not missing, screen
