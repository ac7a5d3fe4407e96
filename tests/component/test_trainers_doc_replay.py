"""docs/trainers.md's NeMo-RL block, replayed as NeMo-RL's client sends it, against a router keyed as a
job's is (the client key on generation, the admin token on ``/fleet`` and ``/control``) over simulated
engines: the page's config works by changing a URL and a key, nothing else.

The values are the job's own: a job directory with the driver's secrets, the router started with them,
and the training command's environment made by the driver's ``wire_gym``; the block is read from the
page and its ``${oc.env:...}`` resolved from that environment, as OmegaConf would. NeMo-RL's calls are
``tests.support.trainer_replays.NemoRlRemoteVllm`` (its client's URL rule, one Bearer, raise on >= 400).
NeMo-RL itself cannot run here (Megatron, GPUs); ``tests/vllm/test_control_api_vllm.py`` replays the same
calls on real vLLM engines.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from launcher.driver.gym_wiring import wire_gym
from launcher.jobdir import JobDir, StateWriter
from launcher.spec import load_resolved
from launcher.spec.snapshot import write_spec
from router import GenerationRouter
from tests.support.checkpoints import checkpoint
from tests.support.http_backends import router_factory
from tests.support.refit_calls import chat, checksums, in_thread, send
from tests.support.trainer_replays import (
    NEMO_RL_PATHS,
    NemoRlRemoteVllm,
    ReplayError,
    TrlAsyncGrpo,
    nemo_rl_version_dir,
    prime_rl_update_weights,
    service_url,
)
from tests.support.trainers_doc import NEMO_RL_EXAMPLE, nemo_rl_block, resolved


@pytest.fixture
def job(tmp_path: Path) -> JobDir:
    """A job directory as the driver leaves it before the router starts: spec and secrets."""
    job = JobDir(tmp_path / "job").create()
    write_spec(job, load_resolved(NEMO_RL_EXAMPLE))
    job.new_api_key()
    job.new_admin_token()
    return job


def keyed_router(job: JobDir) -> Any:
    """Routers keyed as the job's is: its client key on generation, its admin token on the rest."""
    return router_factory(
        policy="round_robin",
        probe_interval_s=0,
        api_key=job.read_api_key(),
        admin_token=job.read_admin_token(),
    )


def set_by_the_command(env: dict[str, str], name: str) -> str:
    """``name`` as the example's training command sets it for NeMo-RL's process (the driver hands only
    the admin token's file): the assignments before ``uv run``, run by bash in the job's environment."""
    command = load_resolved(NEMO_RL_EXAMPLE).training.command
    assignments = command.split(" uv run ", 1)[0]
    assert name in assignments, f"the example's command does not set ${name}: {assignments[:200]}"
    out = subprocess.run(
        ["bash", "-c", f'{assignments}; printf "%s" "${name}"'], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout, out.stderr
    return out.stdout


def nemo_rl(job: JobDir, router: GenerationRouter, model: str, **paths: str) -> NemoRlRemoteVllm:
    """NeMo-RL configured with the page's block, in the job's environment (``wire_gym``)."""
    state = StateWriter(job)
    state.update(router_url=router.base_url(), fleet_url=router.base_url())
    env = wire_gym(load_resolved(NEMO_RL_EXAMPLE), job, state, {}, model_name=model)
    cfg = resolved(nemo_rl_block()["policy"]["generation"]["remote_vllm_cfg"], env)
    return NemoRlRemoteVllm(
        base_url=cfg["base_url"],
        served_model_name=cfg["served_model_name"],
        api_key=set_by_the_command(env, cfg["api_key_env_var"]),
        control_base_url=cfg["control_base_url"],
        paths={name: paths.get(name, cfg.get(name, default)) for name, default in NEMO_RL_PATHS.items()},
        inflight_policy=cfg["refit"]["inflight_policy"],
    )


async def test_the_pages_nemo_rl_block_preflights_and_refits_a_job_keyed_router(sims, job: JobDir) -> None:
    engines = await sims(2)
    with keyed_router(job) as make:
        router = make([e.url for e in engines])
        model = engines[0].config.model_name
        nemo = nemo_rl(job, router, model)
        refit_cfg = nemo_rl_block()["policy"]["generation"]["remote_vllm_cfg"]["refit"]
        checkpoint_dir = Path(resolved(refit_cfg, {"RL_JOB_DIR": str(job.path)})["checkpoint_dir"])
        before = checksums(engines)

        await in_thread(nemo.preflight)
        export = checkpoint(checkpoint_dir, nemo_rl_version_dir(checkpoint_dir, 1).name, b"n")
        refit = await in_thread(nemo.refit, export)
        reset = await in_thread(nemo.invalidate_kv_cache)  # its async loop's, after the resume
        # NeMo-RL's token-capture plugin route: a fixed path on the control URL's origin, not a *_path
        capture = await in_thread(
            nemo.transport.send,
            "POST",
            service_url(nemo.control_base_url or "", "/v1/nemo-rl/token-capture/configure"),
            body={"bridge_url": "http://127.0.0.1:1", "auth_token": "t"},
            raise_on_error=False,
        )
        nemo.transport.calls.remove(capture)
        status, body = await send(
            router.base_url(), chat(), {"Authorization": f"Bearer {job.read_api_key()}"}
        )

    calls = nemo.transport.calls
    assert [c.status for c in calls] == [200] * len(calls), [c.brief() for c in calls]
    # NeMo-RL's default paths on the control URL, the fleet URL's origin (the router's own, here)
    assert all(c.url.startswith(router.base_url() + "/") and "/control" not in c.url for c in calls), [
        c.url for c in calls
    ]
    version = refit[-1].answer["weight_version"]
    assert version == "version_00000001-c1", refit[-1].answer  # derived: NeMo-RL sends none
    assert reset.answer["success"] is True
    after = checksums(engines)
    assert after[0] == after[1] != before[0]
    assert {e.rl.weight_version for e in engines} == {version}
    assert status == 200 and body["choices"], body  # Gym's rollouts: the client key, on the new weights
    assert capture.status == 401, capture.brief()  # the page: refused, never forwarded
    print(f"\n[trainers doc] NeMo-RL on a keyed router: {[c.brief()[:70] for c in calls]}")


async def test_models_path_on_the_generation_url_takes_the_admin_token_on_a_job_keyed_router(
    sims, job: JobDir
) -> None:
    """NeMo-RL sends its one key (the admin token) to the generation URL's ``/v1/models`` as well: that
    listing takes the admin token too (``router.http.auth.Access.LISTING``), so NeMo-RL's default
    ``models_path`` passes its preflight; generation still refuses the admin token."""
    engines = await sims(2)
    with keyed_router(job) as make:
        router = make([e.url for e in engines])
        nemo = nemo_rl(job, router, engines[0].config.model_name, models_path="/v1/models")
        await in_thread(nemo.preflight)
        status, _ = await send(
            router.base_url(), chat(), {"Authorization": f"Bearer {job.read_admin_token()}"}
        )
    listing = next(c for c in nemo.transport.calls if c.url.endswith("/v1/models"))
    assert listing.status == 200 and "/control/" not in listing.url, listing.brief()
    assert status == 401


async def test_what_the_page_says_blocks_prime_rl_and_trl_on_a_job_keyed_router(
    sims, job: JobDir, tmp_path: Path
) -> None:
    """prime-rl sends one key to both planes: the admin token opens ``/control`` and is refused on
    generation, the client key the other way round; a weight directory without ``config.json`` (what its
    filesystem broadcast writes) is refused by the check. TRL sends no key: refused everywhere but the
    router's open ``/health``."""
    engines = await sims(2)
    admin = {"Authorization": f"Bearer {job.read_admin_token()}"}
    client = {"Authorization": f"Bearer {job.read_api_key()}"}
    with keyed_router(job) as make:
        router = make([e.url for e in engines])
        url = router.base_url()
        rollout_with_admin = (await send(url, chat(), admin))[0]
        with pytest.raises(ReplayError) as control_with_client:
            await in_thread(prime_rl_update_weights, url, tmp_path / "w", job.read_api_key(), 1)
        shards = checkpoint(tmp_path, "step_1", b"p")
        (shards / "config.json").unlink()
        with pytest.raises(ReplayError) as no_config:
            await in_thread(prime_rl_update_weights, url, shards, job.read_admin_token(), 1)
        rollout_keyless = (await send(url, chat()))[0]
        trl_at_router, trl_at_control = TrlAsyncGrpo(url), TrlAsyncGrpo(url + "/control")
        refused = []
        for trl in (trl_at_router, trl_at_control):
            with pytest.raises(ReplayError) as err:
                await in_thread(trl.init_weight_transfer, "127.0.0.1", 29500)
            refused.append(err.value.call)
        rollout_with_client = (await send(url, chat(), client))[0]

    assert rollout_with_admin == 401 and rollout_with_client == 200
    assert control_with_client.value.call.status == 401, control_with_client.value.call.brief()
    assert no_config.value.call.status == 400 and "no config.json" in json.dumps(no_config.value.call.answer)
    assert rollout_keyless == 401
    assert [c.status for c in trl_at_router.transport.calls][:1] == [200]  # the open /health
    assert [c.status for c in refused] == [401, 401], [c.brief() for c in refused]
    print(
        f"\n[trainers doc] prime-rl: rollout with the admin token {rollout_with_admin}, "
        f"the control URL with the client key {control_with_client.value.call.brief()[:80]}, "
        f"no config.json {no_config.value.call.brief()[:120]}; TRL: {[c.brief()[:60] for c in refused]}"
    )
