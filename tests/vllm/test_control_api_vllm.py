"""Trainers' own control calls against the router's ``/control`` on 2 real vLLM CPU engines (issue 39).

Each test replays one trainer's exact sequence (``tests/support/trainer_replays.py``: NeMo-RL's
``remote_vllm`` preflight and refit under keep, wait and abort; prime-rl's directory ``update_weights``)
against the fleet's control URL, with rollouts running through the router meanwhile, and checks what an
RL engineer moving such a run onto rl-launch expects: the fleet moves as one (one checksum, the new
version on every answer), a checkpoint cut in half in the middle of NeMo-RL's sequence is refused in
vLLM's error shape while the fleet serves on with no failed rollout, and a trainer process killed between
``/pause`` and ``/resume`` is ended by its lease.

The engines are the session's shared pair (``tests/vllm/conftest.py``'s ``shared_lora_engines``: keyed,
dev routes on; no engine starts for this module), with a router of this module in front (admin token,
the engines' key), shared by its tests in file order. What the module changes on the engines (their
weights, their version) it puts back at the end: the tiny model's weights again, stamped ``default``.
Needs ``RL_LAUNCH_VLLM_PYTHON``::

    flock /tmp/rl-heavy.lock .venv/bin/python -m pytest -n 0 -q tests/vllm/test_control_api_vllm.py -s
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.fleet.client import FleetClient
from router import GenerationRouter, RouterConfig
from tests.support import vllm_calls
from tests.support.shared_vllm import ENGINE_KEY
from tests.support.trainer_replays import (
    NEMO_RL_PATHS,
    VERSION_HEADER,
    NemoRlRemoteVllm,
    ReplayError,
    control_paths,
    nemo_rl_version_dir,
    prime_rl_update_weights,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TOKEN = "control-admin-token-2468"
REPO = Path(__file__).resolve().parents[2]
ROLLOUT_WAIT_S = 300.0
LEASE_S = 10.0
"""The control lease in the kill test: a trainer's next call renews it. The router's default is 120 s
(``router.fleet.control_session.DEFAULT_CONTROL_LEASE_S``) and no setting changes it, so the test
shortens it on the running router's control session, as a setting would, to keep CI's wait short."""
SETTLE_S = 150.0
"""Bound on the fleet settling after a trainer is gone or refused: the lease and a restore."""


@pytest.fixture(scope="module")
def fleet(
    shared_lora_engines: list[Any], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The shared engines behind a router of this module, and the fleet's client; at the end the engines
    get the tiny model's weights back under the version they started with (``default``)."""
    router = GenerationRouter(
        RouterConfig(
            host="127.0.0.1",
            port=0,
            policy="round_robin",
            admin_token=TOKEN,
            backend_api_key=ENGINE_KEY,
            backend_timeout_s=300,
        ),
        [e.api_url for e in shared_lora_engines],
    )
    router.serve_in_background()
    client = FleetClient(router.base_url(), TOKEN)
    logdir = tmp_path_factory.mktemp("control-api-vllm")
    try:
        yield {"engines": shared_lora_engines, "router": router, "client": client, "logdir": logdir}
        # Put back unless this module was the engines' last user (the conftest stopped them already).
        if all(e.is_alive() for e in shared_lora_engines):
            vllm_calls._until(lambda: not client.refit_state().get("active"), SETTLE_S)
            restored = client.load_weights(tiny_model_dir, "default")
            assert restored["ok"], restored
    finally:
        router.stop()


def _nemo(fleet: Any, mode: str = "keep", prefixed: bool = False) -> NemoRlRemoteVllm:
    """NeMo-RL's ``remote_vllm_cfg`` for this fleet as docs/trainers.md writes it: generation on the
    router's ``/v1``, control on the router's origin with NeMo-RL's default paths, the admin token as its
    one key; ``prefixed``: every path under ``/control`` instead (the router's second mount of the API)."""
    url = fleet["router"].base_url()
    return NemoRlRemoteVllm(
        base_url=url + "/v1",
        served_model_name="tiny",
        api_key=TOKEN,
        control_base_url=url + "/control" if prefixed else url,
        paths=control_paths() if prefixed else dict(NEMO_RL_PATHS),
        inflight_policy=mode,
    )


def _control_get(fleet: Any, path: str) -> tuple[int, Any, str | None]:
    req = urllib.request.Request(
        fleet["router"].base_url() + "/control" + path, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.status, json.loads(resp.read() or b"null"), resp.headers.get(VERSION_HEADER)


def _one_checksum(client: FleetClient) -> str:
    groups = client.checksum().result["groups"]
    assert len(groups) == 1, f"the engines disagree: {groups}"
    return next(iter(groups))


def _versions_served(url: str, n: int = 4) -> set[str | None]:
    """The version header on ``n`` rollouts through the router (each must answer 200)."""
    seen = set()
    for i in range(n):
        status, headers, _ = vllm_calls._chat_with_headers(url, f"which weights {i}")
        assert status == 200
        seen.add(headers.get(VERSION_HEADER))
    return seen


def _joined(results: dict[int, Any], threads: list[Any], n: int) -> list[tuple[int, str | None]]:
    """Every rollout's (status, finish_reason or the error body), after waiting for all (bounded)."""
    for t in threads:
        t.join(ROLLOUT_WAIT_S)
    assert len(results) == n, f"{n - len(results)} rollouts did not come back in {ROLLOUT_WAIT_S} s"
    out = []
    for i in range(n):
        status, body, *_ = results[i]
        reason = body["choices"][0]["finish_reason"] if status == 200 and body else json.dumps(body)[:160]
        out.append((status, reason))
    return out


def _exports(fleet: Any, vllm_python: str, tiny_model_dir: Path) -> Path:
    """NeMo-RL's ``refit.checkpoint_dir`` with three exports whose weights all differ: version 1 and 2
    perturbed copies of the tiny model, version 3 the tiny model itself (what the engines started on,
    so it differs from version 2). Made once per module."""
    root = fleet["logdir"] / "nemo-rl-exports"
    if not root.exists():
        root.mkdir()
        vllm_calls._perturbed_copy(vllm_python, tiny_model_dir, nemo_rl_version_dir(root, 1), 2.0)
        vllm_calls._perturbed_copy(vllm_python, tiny_model_dir, nemo_rl_version_dir(root, 2), 3.0)
        shutil.copytree(tiny_model_dir, nemo_rl_version_dir(root, 3))
    return root


def test_nemo_rl_preflight_passes_with_its_default_paths_and_under_control(fleet: Any) -> None:
    """NeMo-RL's preflight, configured as docs/trainers.md writes it (a URL and a key: its default paths
    land on the router's root, its client keeping only the URL's origin) and with every path under
    ``/control``: both pass. The control ``/health`` names both engines with ``"control_fanout":
    true`` (NeMo-RL refuses several backends without it), ``/v1/models`` lists the served model,
    ``/server_info`` is an object, and every control answer names the fleet's version (none yet on a
    fleet no refit has stamped)."""
    current = fleet["client"].weight_version(check=False).result["current"]
    seen = {}
    for prefixed in (True, False):
        nemo = _nemo(fleet, prefixed=prefixed)
        info = nemo.preflight()
        calls = nemo.transport.calls
        assert isinstance(info, dict) and info, info
        assert [c.status for c in calls] == [200, 200, 200, 200], [c.brief() for c in calls]
        assert all(("/control/" in c.url) == prefixed for c in calls), [c.brief() for c in calls]
        health = calls[1].answer
        assert health["control_fanout"] is True, health
        assert health.get("total_backends", 2) == 2, health
        assert {c.fleet_version for c in calls[1:]} == {current}, ([c.brief() for c in calls], current)
        seen["under /control" if prefixed else "default paths"] = [c.brief()[:90] for c in calls]
    print(f"\n[control vllm] NeMo-RL preflight: {seen}")


def test_prime_rl_directory_update_moves_the_fleet_as_one(
    fleet: Any, vllm_python: str, tiny_model_dir: Path
) -> None:
    """prime-rl's ``/pause?mode=keep``, ``NCCL_READY`` written into the directory, ``/update_weights
    {"weight_dir": DIR}``, ``/resume``, with its admin URL at ``<fleet>/control``: every engine on the
    directory's weights (one checksum, a new one), the version on the answers and on rollouts."""
    client: FleetClient = fleet["client"]
    url = fleet["router"].base_url()
    before = _one_checksum(client)
    exports = _exports(fleet, vllm_python, tiny_model_dir)
    target = nemo_rl_version_dir(exports, 1)
    results, threads = vllm_calls._stream(url, 6, "prime-rl rollout")
    calls = prime_rl_update_weights(url + "/control", target, TOKEN, attempts=1)
    outcomes = _joined(results, threads, 6)
    assert [c.status for c in calls] == [200, 200, 200], [c.brief() for c in calls]
    assert (target / "NCCL_READY").exists()
    after = _one_checksum(client)
    assert after != before
    version = calls[-1].fleet_version
    assert version and all(c.fleet_version for c in calls), [c.brief() for c in calls]
    assert set(client.weight_version().result["engines"].values()) == {version}
    assert _versions_served(url) == {version}
    assert [s for s, _ in outcomes] == [200] * 6, outcomes
    print(f"\n[control vllm] prime-rl: {[c.brief()[:80] for c in calls]}; version {version}, {after}")


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
def test_nemo_rl_refit_moves_the_fleet_as_one(
    fleet: Any, vllm_python: str, tiny_model_dir: Path, mode: str
) -> None:
    """NeMo-RL's refit under each ``refit.inflight_policy`` (keep with its default paths, on the
    router's root; wait and abort with docs/trainers.md's): ``/pause?mode=M&clear_cache=true``,
    ``/collective_rpc reload_weights`` from its next export, ``/resume`` (then the async loop's
    ``/reset_prefix_cache``, outside the window), with rollouts streaming through the router: one
    checksum, new, on both engines; the version the router derived on the ``/resume`` answer, on every
    engine and on every rollout after; no rollout failed (under abort a rollout in flight may end with
    vLLM's ``finish_reason: "abort"``, which is what abort means)."""
    client: FleetClient = fleet["client"]
    url = fleet["router"].base_url()
    exports = _exports(fleet, vllm_python, tiny_model_dir)
    n = {"keep": 2, "wait": 3, "abort": 1}[mode]
    before, version_before = _one_checksum(client), client.weight_version().result["current"]
    nemo = _nemo(fleet, mode, prefixed=mode == "wait")  # wait: the /control mount; the others: the docs
    results, threads = vllm_calls._stream(url, 6, f"rollout under {mode}")
    t0 = time.perf_counter()
    calls = nemo.refit(nemo_rl_version_dir(exports, n))
    took = time.perf_counter() - t0
    reset = nemo.invalidate_kv_cache()
    outcomes = _joined(results, threads, 6)
    assert [c.status for c in calls] == [200, 200, 200], [c.brief() for c in calls]
    assert reset.status == 200, reset.brief()  # after the resume: no transaction open, still answered
    version = calls[-1].fleet_version
    assert version and version != version_before, (version, version_before)
    after = _one_checksum(client)
    assert after != before, "the fleet's weights did not change"
    assert set(client.weight_version().result["engines"].values()) == {version}
    assert _versions_served(url) == {version}
    assert all(s == 200 for s, _ in outcomes), outcomes
    if mode != "abort":
        assert all(r != "abort" for _, r in outcomes), outcomes
    print(
        f"\n[control vllm] NeMo-RL refit ({mode}) in {took:.2f} s: "
        f"{[f'{c.brief()[:60]} {c.seconds:.2f}s' for c in calls]}; version {version}; rollouts {outcomes}"
    )


def test_a_cut_checkpoint_mid_sequence_is_refused_in_vllms_shape_and_the_fleet_serves_on(
    fleet: Any, vllm_python: str, tiny_model_dir: Path
) -> None:
    """NeMo-RL's sequence with its next export cut to half its size: the pause is answered, the
    ``/collective_rpc`` is refused with vLLM's error JSON naming the cut file (so NeMo-RL's client raises,
    as against one vLLM, and sends nothing more: no ``/resume``), no rollout fails, and the fleet serves
    on its previous weights and version, resumed without the trainer; a restarted trainer refits next."""
    client: FleetClient = fleet["client"]
    url = fleet["router"].base_url()
    exports = _exports(fleet, vllm_python, tiny_model_dir)
    on, version = _one_checksum(client), client.weight_version().result["current"]
    cut = nemo_rl_version_dir(exports, 4)
    shutil.copytree(nemo_rl_version_dir(exports, 1), cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    nemo = _nemo(fleet, "keep")
    results, threads = vllm_calls._stream(url, 8, "rollout during the cut refit")
    pause = nemo.pause()
    with pytest.raises(ReplayError) as refused:
        nemo.reload_weights(cut)
    outcomes = _joined(results, threads, 8)
    assert pause.status == 200, pause.brief()
    call = refused.value.call
    assert call.status is not None and 400 <= call.status <= 500, call.brief()
    error = call.answer["error"] if isinstance(call.answer, dict) else None
    if isinstance(error, dict):  # vLLM's OpenAI-style error
        assert {"message", "type", "code"} <= set(error) and error["code"] == call.status, call.answer
        message = error["message"]
    else:  # vLLM's RL routes: {"error": "..."}
        assert isinstance(error, str), call.answer
        message = error
    assert "shorter than" in message and "version_00000004" in message, message
    assert [s for s, _ in outcomes] == [200] * 8, outcomes
    assert vllm_calls._until(lambda: _control_get(fleet, "/is_paused")[1]["is_paused"] is False, SETTLE_S)
    assert _one_checksum(client) == on
    assert client.weight_version().result["current"] == version
    assert _versions_served(url) == {version}
    again = _nemo(fleet, "keep").refit(nemo_rl_version_dir(exports, 2))  # the restarted trainer's step
    assert [c.status for c in again] == [200, 200, 200], [c.brief() for c in again]
    assert _one_checksum(client) != on
    print(f"\n[control vllm] cut checkpoint: {call.brief()}; rollouts {outcomes}")


@pytest.mark.parametrize("after", ["pause", "reload"])
def test_a_trainer_killed_between_pause_and_resume_is_ended_by_its_lease(
    fleet: Any, vllm_python: str, tiny_model_dir: Path, after: str
) -> None:
    """A trainer process (the replay, run as a program) pauses the fleet through NeMo-RL's calls (and,
    ``after="reload"``, reloads its next export), then is SIGKILLed before its ``/resume``: the router
    ends the transaction when its lease runs out, the rollouts held meanwhile all complete, the fleet
    serves again on one checksum with one version on every engine and every answer, and the next
    trainer can pause."""
    client: FleetClient = fleet["client"]
    url = fleet["router"].base_url()
    exports = _exports(fleet, vllm_python, tiny_model_dir)
    before = _one_checksum(client)
    env = {**os.environ, "RL_REPLAY_CONTROL_KEY": TOKEN, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "tests.support.trainer_replays", "nemo-rl-hold", "--base-url", url]
    command += ["--model", "tiny", "--key-env", "RL_REPLAY_CONTROL_KEY", "--mode", "keep"]
    if after == "reload":
        command += ["--reload", str(nemo_rl_version_dir(exports, 3))]
    session = fleet["router"].fleet.control.session
    lease_was, session.lease_s = session.lease_s, LEASE_S
    trainer = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = trainer.stdout.readline() if trainer.stdout else b""  # the replay prints once it holds
        assert line, f"the trainer ended before holding: {trainer.stderr.read() if trainer.stderr else ''}"
        held = json.loads(line)["held"]
        results, threads = vllm_calls._stream(url, 6, "rollout while the trainer is dead")
        t_kill = time.monotonic()
        trainer.send_signal(signal.SIGKILL)
        trainer.wait(30)
    finally:
        session.lease_s = lease_was
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(30)
    resumed = vllm_calls._until(lambda: _control_get(fleet, "/is_paused")[1]["is_paused"] is False, SETTLE_S)
    resumed_after = time.monotonic() - t_kill
    outcomes = _joined(results, threads, 6)
    restored = vllm_calls._until(lambda: client.stale_engines() == {}, SETTLE_S)
    groups = client.checksum(check=False).result["groups"]
    versions = set(client.weight_version(check=False).result["engines"].values())
    seen = {
        "resumed_after_s": round(resumed_after, 1),
        "rollouts": outcomes,
        "stale": client.stale_engines(),
        "checksums": groups,
        "versions": versions,
    }
    print(f"\n[control vllm] trainer killed after {held}: {seen}")
    assert resumed, seen
    assert [s for s, _ in outcomes] == [200] * 6, seen  # held while paused, none failed
    assert restored and len(groups) == 1 and len(versions) == 1, seen
    settled = next(iter(groups))
    assert _versions_served(url) == versions
    nemo = _nemo(fleet, "keep")
    assert nemo.pause().status == 200  # the next trainer is not locked out
    assert nemo.resume().status == 200
    kept = "kept its weights" if settled == before else "moved to the killed trainer's export"
    print(f"[control vllm] after the lease the fleet {kept} ({settled}, version {versions})")
