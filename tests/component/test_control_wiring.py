"""The training command's control URL (issue 39, docs/trainers.md): ``RL_CONTROL_BASE_URL`` (the origin
of the job's fleet URL, at whose root the router serves the control API) and ``RL_CONTROL_API_KEY_FILE``
(the 0600 file of the job's admin token, what ``FleetClient.from_job_dir`` uses) in its environment,
``control_url`` in the job state, and never the key itself in its environment, argv, a log or the saved
spec; a job without ``/fleet`` routes gets neither, and the driver's log says why.

Real parts: job directories under pytest's tmp dir with the secrets the driver makes, the driver's
``wire_gym`` on the job state, the training command run by the driver's ``TrainingCommand`` (``bash -c``),
and for a job on a standing fleet the driver's ``StandingAttachment.attach`` against a fleet record and
consumers file, the key checked with the router's own ``ConsumerKeys``. Not here: the driver's
``_start_router`` (it needs Ray and a front; tests/local start whole jobs).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from launcher.driver.gym_wiring import control_url_of, wire_gym
from launcher.driver.standing import StandingAttachment
from launcher.driver.training import TrainingCommand
from launcher.fleet import standing
from launcher.fleet.client import FleetClient
from launcher.jobdir import JobDir, StateWriter, start_ticks
from launcher.spec import ResolvedSpec, load_resolved
from launcher.spec.snapshot import write_spec
from router.consumers import ConsumerKeys

REPO = Path(__file__).resolve().parents[2]
ROUTER = "http://127.0.0.1:45123"
"""A URL the state records (nothing listens: the wiring only writes it down)."""
ENDPOINT = "http://127.0.0.1:45124"
"""The driver's fleet endpoint beside vllm-router / ray-serve: another port than the front's."""

DUMP = (
    'umask 077; key=unset; [ -n "${RL_CONTROL_API_KEY_FILE-}" ] && key="$(cat "$RL_CONTROL_API_KEY_FILE")"; '
    'printf "%s\\n%s\\n%s\\n" "${RL_CONTROL_BASE_URL-unset}" "$key" "${RL_CONTROL_API_KEY-unset}" '
    '> "$OUT_FILE"; echo training ran'
)
"""The training command: reads its key from the file as docs/trainers.md's commands do, and writes the
control URL, that key and whatever ``RL_CONTROL_API_KEY`` it inherited to a 0600 file the test reads
(never to its log)."""


def job_with_secrets(root: Path, spec: ResolvedSpec, name: str) -> JobDir:
    """A job directory as the driver's ``_write_spec`` leaves it: the saved spec and the secrets."""
    job = JobDir(root / f"{name}-local-1").create()
    write_spec(job, spec)
    job.new_api_key()
    job.new_admin_token()
    return job


def run_training(job: JobDir, env: dict[str, str], out: Path) -> tuple[str, str]:
    command = TrainingCommand(DUMP, job.training_log)
    code = command.run({**env, "OUT_FILE": str(out)}, check=lambda: None)
    command.stop()
    assert code == 0, job.training_log.read_text()
    base, key, inherited = out.read_text().splitlines()
    # The admin token is never in the environment every process of the training command inherits
    # (Gym servers, agent sandboxes): only its file's path is (tests/local/test_credentials.py).
    assert inherited == "unset", "RL_CONTROL_API_KEY reached the training command's environment"
    return base, key


def everything_written(job: JobDir, said: list[str], argv: str) -> str:
    """What other users of the cluster may read: argv, the driver's log lines, every file of the job
    directory but its secrets and the 0600 Gym overlay (which holds the client key, not the admin token)."""
    texts = [argv, *said]
    for path in job.path.rglob("*"):
        if path.is_file() and "secrets" not in path.parts:
            texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


@pytest.mark.parametrize(
    ("example", "fleet_url"),
    [("local.yaml", ROUTER), ("local-vllm-router.yaml", ENDPOINT), ("local-ray-serve.yaml", ENDPOINT)],
)
def test_a_job_with_fleet_routes_hands_its_trainer_the_control_url_and_admin_token(
    example: str, fleet_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """builtin: the fleet URL is the router's own; vllm-router, ray-serve: the driver's fleet endpoint
    beside the front (another port), so the control URL is not the generation URL + /control there."""
    monkeypatch.setenv("RL_CONTROL_API_KEY", "inherited-from-another-job")
    spec = load_resolved(REPO / "examples" / example)
    job = job_with_secrets(tmp_path, spec, spec.name)
    state = StateWriter(job)
    state.update(fleet_url=fleet_url)  # as Driver._start_router records them
    state.event("router_serving", "", router_url=ROUTER, control_url=control_url_of(fleet_url))
    said: list[str] = []

    env = wire_gym(spec, job, state, {}, say=said.append)
    base, key = run_training(job, env, tmp_path / "seen")

    admin = job.read_admin_token()
    assert base == fleet_url == control_url_of(fleet_url)  # the origin: NeMo-RL keeps no more of it
    assert key == admin and key != job.read_api_key() and key != "inherited-from-another-job"
    assert env["RL_CONTROL_API_KEY_FILE"] == str(job.admin_token_file) and "RL_CONTROL_API_KEY" not in env
    assert env["RL_POLICY_BASE_URL"] == f"{ROUTER}/v1"
    assert job.read_state()["control_url"] == fleet_url
    assert any(f"vLLM control API for the whole fleet: {fleet_url} (" in line for line in said), said
    # the same token the client uses at the same URL
    client = FleetClient.from_job_dir(job.path)
    assert client.url == base and client._token == key
    assert admin not in everything_written(job, said, spec.training.command)


def test_the_control_url_is_the_fleet_urls_origin() -> None:
    """NeMo-RL's ``service_url`` keeps only the origin of ``control_base_url``; a path-keeping client
    (prime-rl, TRL) must land on the same routes, so the URL handed over has no path at all."""
    assert control_url_of("http://127.0.0.1:45123") == "http://127.0.0.1:45123"
    assert control_url_of("http://127.0.0.1:45123/") == "http://127.0.0.1:45123"
    assert control_url_of("http://[::1]:8/fleet/x?q=1") == "http://[::1]:8"
    assert control_url_of(None) is None and control_url_of("") is None


def test_a_front_without_fleet_routes_gets_neither_and_the_log_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dynamo has no /fleet routes: no control URL, no key, even one inherited from the driver's own
    environment (a job submitted from inside another job's training command), and the reason in the
    driver's log, where a user looks for the job's URLs."""
    monkeypatch.setenv("RL_CONTROL_BASE_URL", "http://127.0.0.1:1/control")
    monkeypatch.setenv("RL_CONTROL_API_KEY", "inherited-from-another-job")
    spec = load_resolved(REPO / "examples" / "local-dynamo.yaml")
    job = job_with_secrets(tmp_path, spec, spec.name)
    state = StateWriter(job)
    state.event("router_serving", "", router_url=ROUTER, control_url=control_url_of(None))
    said: list[str] = []

    env = wire_gym(spec, job, state, {}, say=said.append)
    base, key = run_training(job, env, tmp_path / "seen")

    assert (base, key) == ("unset", "unset")
    assert job.read_state()["control_url"] is None
    line = next(line for line in said if "control API" in line)
    assert line.startswith("no vLLM control API for this job (no RL_CONTROL_BASE_URL): ")
    assert "router.kind 'dynamo' has no /fleet routes" in line, line
    with pytest.raises(ValueError) as refused:  # the same words as the client's refusal
        FleetClient.from_job_dir(job.path)
    assert str(refused.value) in line


def fleet_serving(root: Path) -> tuple[standing.FleetRecord, JobDir]:
    """A standing fleet as its driver records it once it serves (examples/fleet-local.yaml: the job named
    local-sim is an admin consumer), its driver this test's process."""
    spec = load_resolved(REPO / "examples" / "fleet-local.yaml", [f"job_root={root}"])
    fleet = job_with_secrets(root, spec, spec.name)
    record = standing.new_record(spec.name, fleet.path, "local", spec.generation.served_model_name, None)
    StateWriter(fleet).event(
        "fleet_serving",
        "serving",
        router_url=ROUTER,
        fleet_url=ROUTER,
        fleet_serving_since=1.0,
        fleet_record=record.to_json(),
        driver_pid=os.getpid(),
        driver_start_ticks=start_ticks(os.getpid()),
        driver_host=socket.gethostname(),
    )
    standing.write_record(root, record)
    return record, fleet


@pytest.mark.parametrize(("name", "admin"), [("local-sim", True), ("plain-job", False)])
def test_a_job_on_a_standing_fleet_gets_the_control_url_only_as_an_admin_consumer(
    name: str, admin: bool, tmp_path: Path
) -> None:
    """An admin consumer's key on the fleet is its own admin token (``standing.attach``): that is what its
    trainer reads from ``RL_CONTROL_API_KEY_FILE``, at the fleet's control URL; a plain consumer gets
    neither, and the log says it is one."""
    root = tmp_path / "jobs"
    record, fleet = fleet_serving(root)
    spec = load_resolved(
        REPO / "examples" / "local.yaml", [f"name={name}", f"job_root={root}"], attach_to=record.name
    )
    job = job_with_secrets(root, spec, name)
    state = StateWriter(job)
    said: list[str] = []
    attachment = StandingAttachment(spec, job, state, said.append)
    attachment.attach()
    try:
        env = wire_gym(spec, job, state, {}, model_name="sim-8b", say=said.append)
        base, key = run_training(job, env, tmp_path / "seen")
        # what the fleet's router takes this key for, while the job is attached
        holder = ConsumerKeys(standing.consumers_path(record.job_dir)).lookup(key)
    finally:
        attachment.close()

    line = next(line for line in said if "control API" in line)
    if not admin:
        assert (base, key) == ("unset", "unset") and "control_url" not in job.read_state()
        assert holder is None
        assert "as a plain consumer" in line, line
        return
    assert base == ROUTER == job.read_state()["control_url"]
    assert key == job.read_admin_token() != fleet.read_admin_token()
    assert f"{ROUTER} (" in line
    assert holder is not None and holder.admin and holder.is_admin_key, holder
    assert key not in everything_written(job, said, spec.training.command)
    assert key not in json.dumps(fleet.read_state())
