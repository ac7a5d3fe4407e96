"""What someone without the job's secrets can do to a running Dynamo job (issue 17), against the real parts:
the Debian etcd and nats-server, the real ``dynamo.frontend`` and a real ``dynamo.mocker`` worker, started
by ``rl-launch submit`` in local mode (one job for the whole module; its "training" waits until the tests
are done). Each attack is what an outsider on the network would run, with no credential:

* (a) an etcd client reading and writing the job's keys (``etcdctl get --prefix ""`` / ``put``, through
  etcd's v3 JSON gateway: Debian's etcd-server package ships no etcdctl);
* (b) a NATS client connecting and subscribing to every subject (``SUB >``), with no credential and with
  the ``user``/``user`` Dynamo's client falls back to;
* (c) a request to the front URL (the one Gym gets) without the job's key, then with it;
* a fake Dynamo worker (a ``dynamo.mocker`` without the job's credentials) trying to join the frontend's
  routing, the attack the review names: completions of the attacker's choosing fed into training;
* (d) ``cluster: slurm`` without the opt-in, refused by ``rl-launch validate``.

Each prints what the attack got (``pytest -s``) for the report.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.jobdir import JobDir
from launcher.spec import SpecError, parse_spec
from tests.support.cli import RL_LAUNCH
from tests.support.dynamo import mocker
from tests.support.running_job import job_processes
from tests.support.specs import local_spec, trainer_command, write_spec

pytestmark = [pytest.mark.ray, pytest.mark.dynamo]

WAIT_FOR_RELEASE = textwrap.dedent(
    """\
    import os, sys, time
    release = os.path.join(os.environ["RL_JOB_DIR"], "release")
    deadline = time.time() + 600
    while not os.path.exists(release) and time.time() < deadline:
        time.sleep(0.2)
    sys.exit(0 if os.path.exists(release) else 3)
    """
)


@dataclass
class RunningJob:
    job: Path
    proc: subprocess.Popen[bytes]
    router_url: str
    etcd: str
    """``host:port`` of the job's etcd client URL, as the driver announced it."""
    nats: str

    def api_key(self) -> str:
        return JobDir(self.job).read_api_key()

    def frontend_health_url(self) -> str:
        """Where the Dynamo frontend's own ``/health`` (its instance list) is: the loopback URL the
        driver announces once the frontend sits behind the key-checking front, else the front URL."""
        for event in JobDir(self.job).read_events():
            if event.get("phase") == "gateway_frontend" and event.get("frontend_url"):
                return f"{event['frontend_url']}/health"
        return f"{self.router_url}/health"


@pytest.fixture(scope="module")
def dynamo_job(
    dynamo_runtime: None, tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[RunningJob]:
    tmp = tmp_path_factory.mktemp("dynamo-security")
    spec = local_spec(
        "dynamo-security",
        root=tmp / "jobs",
        command=trainer_command(tmp, WAIT_FOR_RELEASE),
        generation=mocker(tiny_model_dir, 1, startup_timeout_s=120),
        router={
            "kind": "dynamo",
            "dynamo": {"discovery": "etcd", "worker_args": ["--speedup-ratio", "10"]},
        },
    )
    path = write_spec(tmp / "spec.yaml", spec)
    out = (tmp / "submit.log").open("w")
    proc = subprocess.Popen([RL_LAUNCH, "submit", str(path)], stdout=out, stderr=subprocess.STDOUT)
    job: Path | None = None
    try:
        deadline = time.monotonic() + 240
        while True:
            states = list((tmp / "jobs").glob("*/state.json"))
            state = json.loads(states[0].read_text()) if states else {}
            if state.get("phase") == "training":
                break
            assert proc.poll() is None, (tmp / "submit.log").read_text()[-3000:]
            assert time.monotonic() < deadline, state
            time.sleep(0.3)
        job = states[0].parent
        up = next(e["detail"] for e in JobDir(job).read_events() if e["phase"] == "gateway_runtime")
        m = re.search(r"etcd (\S+?), NATS (\S+?) ", up)
        assert m, up
        yield RunningJob(job, proc, state["router_url"], m.group(1), m.group(2))
        (job / "release").write_text("")
        assert proc.wait(timeout=120) == 0, (tmp / "submit.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        out.close()
    assert job is not None and job_processes(job) == []


# -- (a) etcd ------------------------------------------------------------------------------------------
def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def etcd_call(endpoint: str, path: str, body: dict[str, Any], token: str | None = None) -> tuple[int, Any]:
    """One etcd v3 call through its JSON gateway (what etcdctl does over gRPC), no credential unless
    ``token``."""
    headers = {"Content-Type": "application/json", **({"Authorization": token} if token else {})}
    req = urllib.request.Request(f"http://{endpoint}{path}", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_unauthenticated_etcd_client_can_neither_read_nor_write_the_jobs_keys(dynamo_job: RunningJob) -> None:
    everything = {"key": _b64("\0"), "range_end": _b64("\0")}  # etcdctl get --prefix ""
    got = etcd_call(dynamo_job.etcd, "/v3/kv/range", everything)
    keys = [base64.b64decode(kv["key"]).decode() for kv in got[1].get("kvs", [])] if got[0] == 200 else []
    print(
        f'\n(a) anonymous `get --prefix ""` on etcd {dynamo_job.etcd}: HTTP {got[0]}: '
        f"{keys if got[0] == 200 else got[1]}"
    )
    fake = {"key": _b64("v1/instances/rl-launch/fake"), "value": _b64('{"attacker": true}')}
    put = etcd_call(dynamo_job.etcd, "/v3/kv/put", fake)
    print(f"(a) anonymous `put v1/instances/rl-launch/fake`: HTTP {put[0]}: {put[1]}")
    assert got[0] != 200 and "user name is empty" in str(got[1]), got
    assert put[0] != 200 and "user name is empty" in str(put[1]), put
    # The keys are there, for whoever holds the job's credentials (the workers' registrations).
    password = (dynamo_job.job / "secrets" / "dynamo_etcd_password").read_text().strip()
    auth = etcd_call(dynamo_job.etcd, "/v3/auth/authenticate", {"name": "rl-launch", "password": password})
    assert auth[0] == 200, auth
    mine = etcd_call(dynamo_job.etcd, "/v3/kv/range", everything, auth[1]["token"])
    keys = [base64.b64decode(kv["key"]).decode() for kv in mine[1].get("kvs", [])]
    print(f"(a) with the job's etcd credentials: HTTP {mine[0]}, {len(keys)} keys, e.g. {keys[:2]}")
    assert mine[0] == 200 and any(k.startswith("v1/instances/") for k in keys), mine


# -- (b) NATS ------------------------------------------------------------------------------------------
def nats_attempt(endpoint: str, credentials: dict[str, str]) -> list[str]:
    """Connect with ``credentials`` (none: ``{}``), subscribe to every subject, ping: the server's
    answers, in order (``+OK``, ``PONG``... or ``-ERR 'Authorization Violation'``)."""
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        lines = sock.makefile("rb")
        info = lines.readline()
        assert info.startswith(b"INFO "), info
        connect = {"verbose": True, "pedantic": False, "name": "attacker", **credentials}
        sock.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\nSUB > 1\r\nPING\r\n")
        answers: list[str] = []
        while len(answers) < 4:
            try:
                line = lines.readline()
            except OSError:
                break
            if not line:
                break
            answers.append(line.decode(errors="replace").strip())
            if line.startswith((b"PONG", b"-ERR")):
                break
        return answers


def test_unauthenticated_nats_client_cannot_connect_or_subscribe(dynamo_job: RunningJob) -> None:
    anonymous = nats_attempt(dynamo_job.nats, {})
    default = nats_attempt(dynamo_job.nats, {"user": "user", "pass": "user"})
    print(f"\n(b) anonymous CONNECT + SUB '>' on NATS {dynamo_job.nats}: {anonymous}")
    print(f"(b) with Dynamo's fallback user/user: {default}")
    for answers in (anonymous, default):
        assert "PONG" not in answers and answers and "Authorization Violation" in answers[0], answers
    token = (dynamo_job.job / "secrets" / "dynamo_nats_token").read_text().strip()
    mine = nats_attempt(dynamo_job.nats, {"auth_token": token})
    print(f"(b) with the job's NATS token: {mine}")
    assert mine[-1] == "PONG", mine


# -- (c) the front URL ----------------------------------------------------------------------------------
def completion(url: str, key: str | None) -> tuple[int, str]:
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(f"{url}/v1/completions", body, headers), timeout=20
        ) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def test_front_url_answers_401_without_the_jobs_key_and_200_with_it(dynamo_job: RunningJob) -> None:
    url = dynamo_job.router_url
    without = completion(url, None)
    wrong = completion(url, "not-the-key")
    with_key = completion(url, dynamo_job.api_key())
    print(f"\n(c) POST {url}/v1/completions without a key: {without[0]} {without[1][:120]}")
    print(f"(c) with a wrong key: {wrong[0]} {wrong[1][:120]}")
    print(f"(c) with the job's key: {with_key[0]} {with_key[1][:120]}")
    assert without[0] == 401 and wrong[0] == 401, (without, wrong)
    assert with_key[0] == 200 and json.loads(with_key[1])["usage"]["completion_tokens"] == 2, with_key


# -- a fake worker ----------------------------------------------------------------------------------------
def test_a_worker_without_the_jobs_credentials_cannot_join_the_frontend(
    dynamo_job: RunningJob, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A ``dynamo.mocker`` started by someone who knows only the addresses (etcd and NATS are announced
    in the job's events; on a cluster a port scan finds them) tries to register as a worker."""
    health = dynamo_job.frontend_health_url()

    def instances() -> list[str]:
        got = json.load(urllib.request.urlopen(health, timeout=5))
        return sorted(str(i["instance_id"]) for i in got["instances"] if i["endpoint"] == "generate")

    before = instances()
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("ETCD_", "NATS_", "DYN_", "RL_LAUNCH_JOB"))
    }
    env.update(
        ETCD_ENDPOINTS=f"http://{dynamo_job.etcd}",
        NATS_SERVER=f"nats://{dynamo_job.nats}",
        DYN_NAMESPACE="rl-launch",
        HF_HUB_OFFLINE="1",
        DYN_TCP_RPC_HOST="127.0.0.1",
        DYN_EVENT_PLANE_HOST="127.0.0.1",
        ETCD_STARTUP_CONNECT_TIMEOUT_SECONDS="5",
    )
    python = os.environ["RL_LAUNCH_DYNAMO_PYTHON"]
    argv = [
        python, "-m", "dynamo.mocker", "--model-path", str(tiny_model_dir), "--model-name", "tiny",
        "--num-workers", "1", "--discovery-backend", "etcd", "--request-plane", "tcp",
        "--event-plane", "nats",
    ]  # fmt: skip
    log = tmp_path / "fake-worker.log"
    with log.open("wb") as out:
        fake = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        joined: list[str] = []
        while time.monotonic() < deadline and fake.poll() is None:
            joined = [i for i in instances() if i not in before]
            if joined:
                break
            time.sleep(0.5)
        print(
            f"\nfake worker (no credentials): exit code {fake.poll()}, instances before {before}, "
            f"joined {joined}; last log line: {log.read_text(errors='replace').strip().splitlines()[-1:]}"
        )
        assert not joined, f"a worker without the job's credentials joined the frontend: {joined}"
        assert fake.poll() is not None, "the fake worker neither joined nor failed in 60 s"
    finally:
        if fake.poll() is None:
            os.killpg(fake.pid, signal.SIGKILL)
            fake.wait(10)
    assert instances() == before


# -- (d) the Slurm refusal -----------------------------------------------------------------------------------
def _slurm_spec(**dynamo: object) -> dict[str, object]:
    return {
        "name": "d",
        "cluster": "slurm",
        "slurm": {"time": "01:00:00"},
        "training": {"command": "true"},
        "generation": {"engine": "dynamo-mocker", "model": "/models/tiny", "nodes": 2},
        "router": {"kind": "dynamo", **({"dynamo": dynamo} if dynamo else {})},
    }


def test_slurm_without_the_insecure_network_opt_in_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_slurm_spec()))
    got = subprocess.run([RL_LAUNCH, "validate", str(path)], capture_output=True, text=True, timeout=60)
    print(
        f"\n(d) rl-launch validate (cluster: slurm, no opt-in): exit {got.returncode}\n"
        f"{got.stdout}{got.stderr}"
    )
    assert got.returncode != 0, got.stdout
    assert "router.dynamo.allow_insecure_network" in got.stdout + got.stderr
    with pytest.raises(SpecError) as err:
        parse_spec(_slurm_spec()).resolved()
    assert "router.dynamo.allow_insecure_network" in str(err.value)
    # The explicit opt-in is accepted; cluster: local needs none (everything is on loopback there).
    assert (
        parse_spec(_slurm_spec(allow_insecure_network=True)).resolved().router.dynamo.allow_insecure_network
    )
    local = {**_slurm_spec(), "cluster": "local", "generation": {"engine": "dynamo-mocker", "model": "/m"}}
    assert parse_spec(local).resolved().router.kind == "dynamo"


def test_the_runtime_credentials_are_private_files_and_in_no_argv_or_log(dynamo_job: RunningJob) -> None:
    """The etcd password and NATS token live in 0600 files (0700 directories) and reach the processes
    by environment only: no command line on this machine, no log, event or config of the job holds them
    (the NATS server's own 0600 config and etcd's private data directory excepted)."""
    secrets_dir = dynamo_job.job / "secrets"
    values = {}
    for name in ("dynamo_etcd_password", "dynamo_nats_token"):
        path = secrets_dir / name
        assert path.stat().st_mode & 0o777 == 0o600, oct(path.stat().st_mode)
        values[name] = path.read_text().strip().encode()
    assert secrets_dir.stat().st_mode & 0o777 == 0o700
    runtime = dynamo_job.job / "dynamo"
    assert runtime.stat().st_mode & 0o777 == 0o700
    assert (runtime / "nats.conf").stat().st_mode & 0o777 == 0o600
    assert (runtime / "etcd").stat().st_mode & 0o777 == 0o700
    for path in dynamo_job.job.rglob("*"):
        if path.is_file() and secrets_dir not in path.parents and path != runtime / "nats.conf":
            # etcd 3.4 logs the user-add request, password included, in its write-ahead log (3.5 hashes it
            # first): its data directory is private like the secrets, and removed at teardown.
            if runtime / "etcd" in path.parents:
                continue
            data = path.read_bytes()
            assert not [n for n, v in values.items() if v in data], f"a Dynamo credential is in {path}"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        assert not [n for n, v in values.items() if v in cmdline], f"a Dynamo credential in the argv of {pid}"
