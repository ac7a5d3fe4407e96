"""The Gym wiring phase: the overlay (``policy_base_url`` = router + ``/v1``, ``policy_api_key``,
``policy_model_name``; mode 0600) and the same values as environment variables for the training command;
for engines the trainer owns, the registration URL as well (``RL_ROUTER_REGISTRATION_URL``); where the
job has a fleet URL, vLLM's control API for the whole fleet (``RL_CONTROL_BASE_URL`` = the fleet URL's
origin; ``RL_CONTROL_API_KEY_FILE`` = the 0600 file of the job's admin token), what a trainer written
for one vLLM sets as its control URL, and the file its API-key variable is filled from (docs/trainers.md).
The file, not the token: the admin token pauses and refits the fleet, and every process the training
command starts (Gym servers, agent sandboxes running model-written code) inherits its environment, where
the job's credentials keep one use each (the client key only, tests/local/test_credentials.py). A trainer
that needs the token in a variable (NeMo-RL's ``api_key_env_var``) is given it by the training command's
own line, ``RL_CONTROL_API_KEY="$(cat "$RL_CONTROL_API_KEY_FILE")"``, for that process alone.

Secrets reach the training command only through its environment (and the 0600 overlay): never its argv,
the driver's log or the saved spec, which other users of the cluster can read.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml

from launcher.fleet.client import why_no_fleet_url
from launcher.jobdir import JobDir, StateWriter, write_text_atomic
from launcher.spec import ResolvedSpec
from router.http.capability import registration_url

CONTROL_ENV = ("RL_CONTROL_BASE_URL", "RL_CONTROL_API_KEY_FILE", "RL_CONTROL_API_KEY")
"""The training command's control URL and the file of its Bearer token (the admin token
``FleetClient.from_job_dir`` uses: a job attached to a standing fleet as an admin consumer holds its own,
registered as its admin key there); ``RL_CONTROL_API_KEY`` is never set, only dropped when inherited."""


def control_url_of(fleet_url: str | None) -> str | None:
    """The control URL of a job whose fleet URL is ``fleet_url`` (``None`` without one): the fleet URL's
    origin, at whose root the router answers vLLM's control API for the whole fleet
    (``router.fleet.vllm_control``), beside ``/fleet/*`` and with the same admin token. The origin, not
    ``<fleet_url>/control`` (also served): NeMo-RL's ``remote_vllm`` keeps only the origin of its
    ``control_base_url``, and a client that keeps the path (prime-rl, TRL) then lands on the same routes."""
    if not fleet_url:
        return None
    parts = urlsplit(fleet_url)
    return urlunsplit((parts.scheme, parts.netloc, "", "", ""))


def control_line(control_url: str | None, job: JobDir, state: dict[str, Any]) -> str:
    """The driver log's line on the control URL: where it is and which key it takes (never the key), or
    why the job has none, where a user looks for the job's URLs."""
    if control_url:
        return (
            f"vLLM control API for the whole fleet: {control_url} (Bearer: the job's admin token; "
            "$RL_CONTROL_BASE_URL and $RL_CONTROL_API_KEY_FILE in the training command's environment)"
        )
    return f"no vLLM control API for this job (no RL_CONTROL_BASE_URL): {why_no_fleet_url(job, state)}"


def write_gym_overlay(path: Path, values: dict[str, str]) -> None:
    """The Gym overlay (it holds the client key): a new 0600 file renamed into place, so an existing
    file's looser mode is not kept and a symlink planted at ``path`` is replaced, never written through
    (the old in-place write did both)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(values, sort_keys=False), mode=0o600)


def wire_gym(
    spec: ResolvedSpec,
    job: JobDir,
    state: StateWriter,
    ray_client_env: dict[str, str],
    model_name: str | None = None,
    say: Callable[[str], None] | None = None,
) -> dict[str, str]:
    """Write the job's Gym overlay; return the training command's environment: the driver's own, the
    spec's ``training.env``, the policy's URL, key and model name (``model_name``, default the spec's),
    the job's paths, the control URL and its key where the job state has a ``fleet_url`` (recorded in the
    state as ``control_url``: a job attached to a standing fleet gets its fleet URL at attach time), and
    ``ray_client_env`` (what attaches to the job's Ray; empty without one). On a standing fleet the key is
    the job's own consumer key (``launcher.fleet.standing.attach``). ``say``: the driver's log, told where
    the control URL is or why there is none."""
    snapshot = state.snapshot()
    router_url = snapshot["router_url"]
    control_url = control_url_of(snapshot.get("fleet_url"))
    key = job.read_api_key()
    model = model_name or spec.gym.model_name
    overlay = spec.gym_overlay_path(job.path)
    write_gym_overlay(
        overlay,
        {
            "policy_base_url": f"{router_url}/v1",
            "policy_api_key": key,
            "policy_model_name": model,
        },
    )
    env = dict(os.environ)
    for name in CONTROL_ENV:
        # One inherited from the shell the driver runs in (a job submitted from inside another job) names
        # another job's fleet: this job's are set below, or none.
        env.pop(name, None)
    # The training command sees the same rl-launch/python that runs the driver, even when the user
    # started it by path without activating the venv.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(spec.training.env)
    env.update(
        {
            "RL_POLICY_BASE_URL": f"{router_url}/v1",
            "RL_POLICY_API_KEY": key,
            "RL_POLICY_MODEL_NAME": model,
            "RL_GYM_OVERLAY": str(overlay),
            "RL_JOB_DIR": str(job.path),
            "RL_ROUTER_URL": router_url,
        }
    )
    capability = job.read_registration_capability()
    if capability:
        # Engines the trainer owns: the URL to register them at and to roll out through (NeMo-RL's
        # ``env.nemo_gym.router_url``); in the environment, never in argv or the spec.
        env["RL_ROUTER_REGISTRATION_URL"] = registration_url(router_url, capability)
    if control_url:
        env["RL_CONTROL_BASE_URL"] = control_url
        job.read_admin_token()  # the file exists and is readable: the trainer fills its variable from it
        env["RL_CONTROL_API_KEY_FILE"] = str(job.admin_token_file)
        if snapshot.get("control_url") != control_url:
            state.update(control_url=control_url)
    if say is not None:
        say(control_line(control_url, job, snapshot))
    env.update(ray_client_env)
    return env
