"""A job whose trainer owns its engines (``generation.owner: trainer``), and the trainer's side of it, as
the trainer-owned tests play it on simulated engines (tests/local) and on real vLLM (tests/vllm).

``trainer_owned_job`` submits the job as a user does (``rl-launch submit``), its training command a
stand-in for NeMo-RL's run script that writes the ``$RL_ROUTER_REGISTRATION_URL`` it is handed (0600, under
the test's tmp) and waits; it yields a ``TrainerOwnedJob`` once that URL is there, ends the job with
``rl-launch cancel`` when the check is done (or failed) and, after a check that passed, waits until
nothing of the job runs. ``TrainerProcess`` is a process the trainer starts itself (an engine, a listener)
in a session of its own on a fixed port, so a test can kill it and start it again where it was; ``call``
is one request as NeMo-RL's and Gym's code makes it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from tests.support.cli import RL_LAUNCH
from tests.support.running_job import job_leftovers, wait_for
from tests.support.specs import local_spec, write_spec


class TrainerProcess:
    """One process of the trainer's on a fixed ``port``, started (and started again) in a session of its
    own, its output appended to ``log``; ``what`` names it when it exits before it is ready."""

    def __init__(self, argv: list[str], log: Path, port: int, what: str | None = None) -> None:
        self.argv, self.log, self.port = argv, log, port
        self.what = what or str(argv[:3])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def environment(self) -> dict[str, str]:
        """What it runs with: this process's environment (a subclass drops or adds what it must)."""
        return dict(os.environ)

    def start(self) -> Self:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.environment(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def ready(self) -> bool:
        """Whether it answers ``/health``; an AssertionError with its log's tail if it exited."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.what} on {self.port} exited:\n{self.log.read_text()[-3000:]}")
        try:
            return urllib.request.urlopen(f"{self.url}/health", timeout=2).status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL its whole session (an engine's workers too), as a crash would end it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def call(
    method: str, url: str, body: Any = None, key: str | None = None, timeout: float = 60
) -> tuple[int, dict[str, Any]]:
    """One request as NeMo-RL's and Gym's code makes it: JSON, no header but the ``key`` they send (none
    when None); the status and the JSON answer, an error status's included."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@dataclass
class TrainerOwnedJob:
    """The submitted job: its directory, the job root, the spec file, and the registration URL its
    training command was handed."""

    job: Path
    root: Path
    spec_path: Path
    router_url: str

    def status(self) -> dict[str, Any]:
        """``rl-launch status JOB --json`` as the user runs it (it must exit 0)."""
        proc = subprocess.run(
            [RL_LAUNCH, "status", self.job.name, "--root", str(self.root), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)


@contextmanager
def trainer_owned_job(tmp_path: Path, name: str, engine: str, within_s: float) -> Iterator[TrainerOwnedJob]:
    """Submit a local job named ``name`` whose trainer owns its ``engine`` engines (a builtin round-robin
    router); yield it once its training command has written the registration URL (within ``within_s``).
    Afterwards the job is cancelled as a user does (exit 0) and, unless the check failed, every process
    of it has ended within 60 s."""
    out = tmp_path / "trainer"
    out.mkdir(mode=0o700)
    root = tmp_path / "jobs"
    spec = local_spec(
        name,
        root=root,
        # A stand-in for NeMo-RL's run script: it reads the URL it is handed (0600, under the test's tmp).
        command=(
            f'umask 077; printf %s "$RL_ROUTER_REGISTRATION_URL" > {out}/url.tmp && '
            f"mv {out}/url.tmp {out}/url && sleep 900"
        ),
        generation={"owner": "trainer", "engine": engine},
        router={"kind": "builtin", "policy": "round_robin"},
    )
    spec_path = write_spec(tmp_path / "spec.yaml", spec)
    submit = subprocess.Popen(
        [RL_LAUNCH, "submit", str(spec_path)],
        stdout=(tmp_path / "submit.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    job: Path | None = None
    try:
        url_file = out / "url"
        wait_for(
            lambda: url_file.exists() or submit.poll() is not None, within_s, "the job's training command"
        )
        assert url_file.exists(), (tmp_path / "submit.log").read_text()[-3000:]
        router_url = url_file.read_text()
        (job,) = root.iterdir()
        yield TrainerOwnedJob(job=job, root=root, spec_path=spec_path, router_url=router_url)
    finally:
        if job is not None and submit.poll() is None:
            proc = subprocess.run(
                [RL_LAUNCH, "cancel", job.name, "--root", str(root), "--timeout", "120"],
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        submit.wait(120)
    wait_for(lambda: job_leftovers(job) == [], 60, "the job's processes to end")
