"""The Gym wiring phase: the overlay (``policy_base_url`` = router + ``/v1``, ``policy_api_key``,
``policy_model_name``; mode 0600) and the same values as environment variables for the training command;
for engines the trainer owns, the registration URL as well (``RL_ROUTER_REGISTRATION_URL``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

from launcher.jobdir import JobDir, write_text_atomic
from launcher.spec import ResolvedSpec
from router.http.capability import registration_url


def write_gym_overlay(path: Path, values: dict[str, str]) -> None:
    """The Gym overlay (it holds the client key): a new 0600 file renamed into place, so an existing
    file's looser mode is not kept and a symlink planted at ``path`` is replaced, never written through
    (the old in-place write did both)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, yaml.safe_dump(values, sort_keys=False), mode=0o600)


def wire_gym(
    spec: ResolvedSpec,
    job: JobDir,
    router_url: str,
    ray_client_env: dict[str, str],
    model_name: str | None = None,
) -> dict[str, str]:
    """Write the job's Gym overlay; return the training command's environment: the driver's own, the
    spec's ``training.env``, the policy's URL, key and model name (``model_name``, default the spec's),
    the job's paths, and ``ray_client_env`` (what attaches to the job's Ray; empty without one). On a
    standing fleet the key is the job's own consumer key (``launcher.fleet.standing.attach``)."""
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
    env.update(ray_client_env)
    return env
