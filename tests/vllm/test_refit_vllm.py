"""The refit window against real vLLM CPU engines (``VLLM_SERVER_DEV_MODE=1``) behind the router.

Two engines start once for the module (each start costs ~90 s on a 2-core box) and every test reuses
them, in file order; the last test replaces one with an engine started from a copy of the tiny model whose
weights were changed, which is both "an engine restarted with an old version" and "an engine serving
other weights". Both take the job's key, as the launcher starts them: engine 0 behind the launcher's key
guard, engine 1 as vLLM ships it (its key checked under ``/v1`` only), so the first test shows on real
vLLM what the guard closes (the probes are ``tests/support/engine_key_probes.py``; the simulator's half is
``tests/component/test_engine_key_guard.py``). The router presents the key to both (``backend_api_key``).
Needs ``RL_LAUNCH_VLLM_PYTHON``::

    .venv/bin/pytest tests/vllm/test_refit_vllm.py -m vllm -s    # -s prints the pause/resume figures
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.engines.base import EngineStartError
from launcher.engines.vllm.engine import VllmEngine
from launcher.fleet.client import FleetClient, FleetOpError, RefitError
from router import GenerationRouter, RouterConfig
from router.fleet.engine_counters import parse_counters
from tests.support.checkpoints import llama_weight_table
from tests.support.engine_key_probes import KEY, PROBES, _call, expected, refused_without_key
from tests.support.prometheus_readers import ours, reference
from tests.support.vllm_calls import (
    PERTURB,
    _chat,
    _chat_with_headers,
    _in_thread,
    _perturbed_copy,
    _stream,
    _until,
    dev_engine,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
TOKEN = "refit-admin-token-5678"
STARTUP_TIMEOUT_S = 600.0


def _engine(python: str, model: Path, log: Path, cpu: int | None, key_guard: bool = True) -> VllmEngine:
    return dev_engine(python, model, log, cpu, KEY, key_guard)


def _start(engines: list[VllmEngine]) -> None:
    t0 = time.monotonic()
    for e in engines:
        e.start()
    for e in engines:
        try:
            e.wait_ready(t0 + STARTUP_TIMEOUT_S)
        except EngineStartError as exc:
            pytest.fail(f"vLLM engine failed to start:\n{exc}", pytrace=False)
        print(f"\n[refit vllm] engine {e.url} ready after {(e.ready_at or 0) - (e.started_at or 0):.1f}s")


@pytest.fixture(scope="module")
def fleet(vllm_python: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two real engines, a router in front (admin token), and the trainer's client."""
    logdir = tmp_path_factory.mktemp("refit-vllm")
    cpus = sorted(os.sched_getaffinity(0))
    engines = [  # 0: behind the launcher's key guard; 1: as vLLM ships it (see the module doc)
        _engine(
            vllm_python,
            tiny_model_dir,
            logdir / f"engine{i}.log",
            cpus[i] if len(cpus) >= 2 else None,
            key_guard=i == 0,
        )
        for i in range(2)
    ]
    router: GenerationRouter | None = None
    state: dict[str, Any] = {"engines": engines, "logdir": logdir, "cpus": cpus}
    try:
        _start(engines)
        config = RouterConfig(
            host="127.0.0.1",
            port=0,
            policy="round_robin",
            admin_token=TOKEN,
            backend_api_key=KEY,
            backend_timeout_s=300,
        )
        router = GenerationRouter(config, [e.api_url for e in engines])
        router.serve_in_background()
        state.update(router=router, client=FleetClient(router.base_url(), TOKEN))
        yield state
    finally:
        if router is not None:
            router.stop()
        for e in state["engines"]:
            e.stop()


def _engine_gauge(engine_url: str, name: str) -> float:
    req = urllib.request.Request(engine_url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _generation_tokens(engine_url: str) -> float:
    return _engine_gauge(engine_url, "vllm:generation_tokens_total")


def _weight_version(base: str) -> object:
    req = urllib.request.Request(base + "/weight_info", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read()).get("weight_version")


def test_real_vllm_dev_routes_open_as_shipped_and_closed_behind_the_guard(fleet: Any) -> None:
    """Issue 17's finding on real vLLM in dev mode: with the key, vLLM still answers every route outside
    ``/v1`` to anyone (``/pause``, ``/update_weight_version``, ``/collective_rpc``...); behind the guard
    every route but ``/health`` takes the key. Runs first: it leaves both engines as it found them."""
    guarded, raw = fleet["engines"]
    assert "--middleware" in guarded.command() and "--middleware" not in raw.command()
    assert KEY not in " ".join(guarded.command())  # the key stays out of argv
    got_raw = refused_without_key(raw.url)
    assert got_raw == expected(False), got_raw
    assert not got_raw["POST /pause?mode=keep"] and not got_raw["POST /collective_rpc"]
    got_guarded = refused_without_key(guarded.url)
    assert got_guarded == expected(True), got_guarded
    # The stranger's stamp reached the engine as shipped, never the guarded one.
    assert _weight_version(raw.url) == "stranger" and _weight_version(guarded.url) != "stranger"
    for method, path, body in PROBES:  # the key opens every route
        assert _call(guarded.url, method, path, body, KEY) != 401, path
    for engine in (raw, guarded):  # as found: serving, on the version they started with
        assert _call(engine.url, "POST", "/resume", None, KEY) == 200
        body = {"new_version": "default"}
        assert _call(engine.url, "POST", "/update_weight_version", body, KEY) == 200
        assert _weight_version(engine.url) == "default"


def test_keep_pause_requests_in_flight_and_held_complete_after_resume(fleet: Any) -> None:
    client: FleetClient = fleet["client"]
    url = fleet["router"].base_url()
    results: dict[int, Any] = {}
    threads = [_in_thread(results, i, url, 300, f"in flight {i}") for i in range(4)]
    time.sleep(1.0)
    in_flight_at_pause = 4 - len(results)
    t0 = time.perf_counter()
    pause = client.pause("keep")
    paused_at = time.monotonic()
    assert client.is_paused()
    held = [_in_thread(results, 10 + i, url, 16, f"held {i}") for i in range(3)]
    time.sleep(2.0)
    assert not any(k >= 10 for k in results), "a request sent during the pause was not held"
    t1 = time.perf_counter()
    resume = client.resume()
    t2 = time.perf_counter()
    for t in threads + held:
        t.join(300)
    assert sorted(results) == [0, 1, 2, 3, 10, 11, 12]
    for k, (status, body, _, _) in results.items():
        assert status == 200, (k, body)
        assert body["usage"]["completion_tokens"] == (300 if k < 10 else 16), (k, body["choices"][0])
    # Requests frozen by the pause finished after it; the held ones completed after the resume.
    frozen_done = [results[i][3] for i in range(4) if results[i][3] > paused_at]
    assert all(results[k][3] > paused_at + 2.0 for k in (10, 11, 12))
    assert resume.result["released"] == 3
    print(
        f"\n[refit vllm] 2 engines: pause(keep) {pause.took_s * 1000:.0f} ms,"
        f" resume {(t2 - t1) * 1000:.0f} ms,"
        f" pause->resume cycle {(t2 - t0) * 1000:.0f} ms (incl. 2 s hold);"
        f" {in_flight_at_pause} in flight at pause ({len(frozen_done)} finished after it),"
        f" 3 held, longest wait {resume.result['held_longest_wait_s']:.3f} s"
    )


ABORT_TRIES = 3
LONG = 3900  # tokens; with the prompt, within the engines' --max-model-len 4096


def _aborted_in_flight(
    url: str, engines: list[str], abort: Callable[[str], Any], request_id: str | None
) -> tuple[Any, Any, int]:
    """One long request, aborted by ``abort(request id)`` as soon as an engine runs it: (the abort's
    answer, the client's result, tries). The tiny model writes its 3,900 tokens in about two seconds, and
    on a loaded CI machine the test thread once woke from a fixed 0.3 s sleep after the request had ended
    ("length", 2.8 s). So the abort goes when ``vllm:num_requests_running`` shows the request, and an
    attempt the abort still did not reach in time is tried again, a bounded number of times; an abort
    that never reaches the engine fails every try."""
    for attempt in range(1, ABORT_TRIES + 1):
        results: dict[int, Any] = {}
        rid = f"{request_id}-{attempt}" if request_id else None
        headers = {"X-Request-Id": rid} if rid else None
        thread = _in_thread(results, 0, url, LONG, f"abort me, try {attempt}", headers=headers)
        deadline = time.monotonic() + 10  # bounded: the request reaches an engine in milliseconds
        while 0 not in results and time.monotonic() < deadline:
            if sum(_engine_gauge(e, "vllm:num_requests_running") for e in engines) >= 1:
                break
            time.sleep(0.02)
        answer = abort(f"chatcmpl-{rid}") if 0 not in results else None
        thread.join(60)
        assert 0 in results, "the long request did not come back within 60 s"
        status, body, took, _ = results[0]
        if answer is not None and not (status == 200 and body["choices"][0]["finish_reason"] == "length"):
            return answer, results[0], attempt
        print(f"\n[refit vllm] try {attempt}: the request ended ({status}, {took:.1f} s) before the abort")
    pytest.fail(f"in {ABORT_TRIES} tries no abort reached a running request of {LONG} tokens")


def test_abort_all_and_by_id_reach_client_as_engine_answered(fleet: Any) -> None:
    client: FleetClient = fleet["client"]
    router: GenerationRouter = fleet["router"]
    url = router.base_url()
    retries_before = router.metrics.retries._value.get()
    engines = [e.url for e in fleet["engines"]]
    by_id, first, by_id_tries = _aborted_in_flight(
        url, engines, lambda rid: client.abort([rid]), "refit-abort-1"
    )
    rest, second, all_tries = _aborted_in_flight(url, engines, lambda rid: client.abort(), None)
    for status, body, took, _ in (first, second):
        assert took < 60
        if status == 200:  # vLLM ends an aborted request with finish_reason "abort"
            assert body["choices"][0]["finish_reason"] == "abort", body
            assert body["usage"]["completion_tokens"] < LONG
        else:
            assert status < 600 and body is not None
    assert router.metrics.retries._value.get() == retries_before  # never retried on another engine
    got = [(s, (b or {}).get("choices", [{}])[0].get("finish_reason")) for s, b, *_ in (first, second)]
    print(
        f"\n[refit vllm] abort by id: {by_id.result} (try {by_id_tries}),"
        f" abort all: {rest.result} (try {all_tries}); clients got {got}"
    )


def test_version_checksum_and_cache_reset(fleet: Any) -> None:
    client: FleetClient = fleet["client"]
    before = client.weight_version()
    assert set(before.result["engines"].values()) == {"default"}
    stamp = client.set_weight_version("step-1")
    assert stamp.ok and stamp.result["current"] == "step-1"
    assert set(client.weight_version().result["engines"].values()) == {"step-1"}
    check = client.checksum()
    assert check.ok and len(check.result["groups"]) == 1 and check.result["parameters"] > 0
    reset = client.reset_prefix_cache()
    assert reset["ok"] and len(reset["engines"]) == 2


def test_step_metrics_delta_matches_tokens_sent(fleet: Any) -> None:
    client: FleetClient = fleet["client"]
    url = fleet["router"].base_url()
    client.begin_step()
    sent = [_chat(url, 7 + i, f"step prompt number {i} " * (i + 1)) for i in range(4)]
    assert all(s == 200 for s, _ in sent)
    want_gen = sum(b["usage"]["completion_tokens"] for _, b in sent)
    want_prompt = sum(b["usage"]["prompt_tokens"] for _, b in sent)
    deadline = time.monotonic() + 15  # the engines' counters can lag their answers a little
    while True:
        step = client.step_metrics()
        fleet_counts = step["fleet"]
        if fleet_counts.get("generation_tokens") == want_gen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert fleet_counts["generation_tokens"] == want_gen, step
    assert fleet_counts["prompt_tokens"] == want_prompt, step
    assert fleet_counts["finished_length"] == 4, step
    assert fleet_counts["prefix_cache_queries"] >= want_prompt - 4
    print(f"\n[refit vllm] step dict: {step['fleet']}")


def test_one_prometheus_reader_reads_real_vllm_as_prometheus_client_does(fleet: Any) -> None:
    """``router.prometheus`` (strict) against vLLM's own ``/metrics``, every family it exposes."""
    for e in fleet["engines"]:
        req = urllib.request.Request(e.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            text = r.read().decode()
        assert ours(text) == reference(text), e.url
        assert parse_counters(text).keys() >= {"prompt_tokens", "generation_tokens", "prefix_cache_queries"}


def test_restarted_engine_with_old_version_not_served_until_stamped(
    fleet: Any, vllm_python: str, tiny_model_dir: Path
) -> None:
    client: FleetClient = fleet["client"]
    router: GenerationRouter = fleet["router"]
    assert client.weight_version().result["current"] == "step-1"
    # Replace engine 1 with one started from a copy whose weights differ (a checkpoint of another run).
    other = fleet["logdir"] / "tiny-other"
    shutil.copytree(tiny_model_dir, other)
    weights = next(other.glob("*.safetensors"))
    out = subprocess.run(
        [vllm_python, "-c", PERTURB, str(weights)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    old = fleet["engines"][1]
    old.stop()
    cpus = fleet["cpus"]
    new = _engine(
        vllm_python, other, fleet["logdir"] / "engine1-restarted.log", cpus[1] if len(cpus) >= 2 else None
    )
    fleet["engines"][1] = new
    _start([new])
    e0 = fleet["engines"][0]
    router.set_serving_backends([e0.api_url, new.api_url])  # what the fleet controller pushes
    deadline = time.monotonic() + 10
    # Held out at once ("not verified yet"), then judged on its /weight_info.
    while "'default'" not in client.stale_engines().get(new.url, "") and time.monotonic() < deadline:
        time.sleep(0.1)
    stale = client.stale_engines()
    assert list(stale) == [new.url] and "'default'" in stale[new.url], stale
    assert router.serving_backends() == [e0.url]
    url = router.base_url()
    before = _generation_tokens(new.url)
    assert all(_chat(url, 4, f"while stale {i}")[0] == 200 for i in range(4))
    assert _generation_tokens(new.url) == before, "a stale engine served"
    # The trainer refits it (here: only stamps it) and it is readmitted ...
    assert client.set_weight_version("step-1", engines=[new.url]).ok
    assert client.stale_engines() == {}
    assert sorted(router.serving_backends()) == sorted([e0.url, new.url])
    assert all(_chat(url, 4, f"after stamp {i}")[0] == 200 for i in range(4))
    assert _generation_tokens(new.url) > before
    # ... but it serves other weights, which the checksum comparison catches.
    with pytest.raises(FleetOpError, match="different weights") as err:
        client.checksum()
    groups = err.value.report.result["groups"]
    assert len(groups) == 2 and [new.url] in groups.values(), groups
    print(f"\n[refit vllm] checksum groups after the odd restart: {groups}")


def _greedy(engine_url: str) -> list[str]:
    """Each engine's own greedy answer to the same prompts (straight to the engine, with the key)."""
    texts = []
    for prompt in ("the quick brown fox", "one two three four", "hello"):
        status, body = _chat(engine_url, 12, prompt, headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200, body
        texts.append(body["choices"][0]["message"]["content"])
    return texts


def test_refit_from_a_directory_moves_every_engine_to_the_same_new_weights(
    fleet: Any, vllm_python: str, tiny_model_dir: Path
) -> None:
    """Issue 19: one call; every checksum agrees and differs from before, greedy output changes, and the
    responses carry the new version. Runs after the odd restart above, so the engines start apart."""
    client: FleetClient = fleet["client"]
    router: GenerationRouter = fleet["router"]
    engines = fleet["engines"]
    before = client.checksum(check=False).result["groups"]
    assert len(before) == 2  # the restarted engine serves other weights
    greedy_before = [_greedy(e.url) for e in engines]
    step_b = _perturbed_copy(vllm_python, tiny_model_dir, fleet["logdir"] / "tiny-step-b", 2.0)
    t0 = time.perf_counter()
    txn = client.load_weights(step_b, "step-2")
    took = time.perf_counter() - t0
    assert txn["ok"] and txn["phase"] == "done", txn
    assert sorted(txn["verified"]) == sorted(e.url for e in engines)
    after = client.checksum().result["groups"]
    assert list(after) == [txn["checksum"]] and txn["checksum"] not in before, (before, after)
    greedy_after = [_greedy(e.url) for e in engines]
    assert greedy_after[0] == greedy_after[1]  # the same weights give the same greedy answers
    assert greedy_after[0] != greedy_before[0], "engine 0's greedy output did not change"
    assert set(client.weight_version().result["engines"].values()) == {"step-2"}
    url = router.base_url()
    for i in range(4):
        status, headers, _ = _chat_with_headers(url, f"versioned {i}")
        assert status == 200 and headers.get("x-rl-weight-version") == "step-2", headers
    steps = {s["phase"]: s["took_s"] for s in txn["steps"]}
    print(
        f"\n[refit vllm] load_weights from {step_b.name} into 2 real engines: {took * 1000:.0f} ms in all, "
        f"steps (ms) { ({k: round(v * 1000) for k, v in steps.items()}) }, checksum {txn['checksum']}"
    )


def test_a_broken_directory_quarantines_its_engine_and_no_request_fails(
    fleet: Any, tiny_model_dir: Path
) -> None:
    """One engine given a broken copy (its config is right, its weights file is not): vLLM 0.32's reload
    fails and leaves the engine without weights (its next generation step would kill the core); the
    transaction quarantines it with the reason, the other engine moves to the new version, the fleet is
    resumed, and the rollouts in flight all complete; then the fleet restores engine 1 from the directory
    it verified (``router.fleet.restore``), with no trainer call."""
    client: FleetClient = fleet["client"]
    router: GenerationRouter = fleet["router"]
    e0, e1 = fleet["engines"]
    bad = fleet["logdir"] / "tiny-broken"
    shutil.copytree(tiny_model_dir, bad)
    # What the router's check passes (a garbage model.safetensors is now refused before the pause): a
    # torch zip whose directory is whole and whose pickle is not; vLLM falls back to it and fails to load.
    next(bad.glob("*.safetensors")).unlink()
    with zipfile.ZipFile(bad / "pytorch_model.bin", "w") as archive:
        archive.writestr("archive/data.pkl", b"not a pickle")
    url = router.base_url()
    results: dict[int, Any] = {}
    threads = [_in_thread(results, i, url, 64, f"rollout during the refit {i}") for i in range(6)]
    time.sleep(0.3)
    txn = client.load_weights(tiny_model_dir, "step-3", per_engine={e1.url: bad})
    for t in threads:
        t.join(300)
    assert txn["moved"] and not txn["ok"] and txn["verified"] == [e0.url], txn
    why = txn["quarantined"][e1.url]
    assert "reload from" in why and "tiny-broken" in why, why
    assert [results[i][0] for i in range(6)] == [200] * 6, results
    assert not router.gate.paused
    assert _until(lambda: client.stale_engines() == {}, 60), client.stale_engines()
    assert sorted(router.serving_backends()) == sorted([e0.url, e1.url])
    assert len(client.checksum().result["groups"]) == 1 and _weight_version(e1.url) == "step-3"
    req = urllib.request.Request(e0.url + "/is_paused", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert json.loads(resp.read())["is_paused"] is False
    assert all(_chat(url, 4, f"after {i}")[0] == 200 for i in range(4))
    assert client.weight_version(check=False).result["current"] == "step-3"
    print(f"\n[refit vllm] broken directory on one engine: quarantined with {why[:160]!r}")


UNKNOWN_TENSOR = """
import sys, torch
from safetensors.torch import load_file, save_file
tensors = load_file(sys.argv[1])
tensors["model.layers.0.mlp.bogus.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
save_file(tensors, sys.argv[1], metadata={"format": "pt"})
"""


def test_a_cut_checkpoint_is_refused_and_a_failing_canary_costs_one_engine(
    fleet: Any, vllm_python: str, tiny_model_dir: Path
) -> None:
    """Issue 28's finding 1 on real vLLM: refit to B; a copy of B with ``model.safetensors`` cut to half
    its size is refused before the pause (the router reads every header), and so is one with a tensor the
    model has no parameter for (issue 38: the tensors are compared); a copy of B that vLLM's loader
    refuses (a torch file whose pickle is not one) is tried on one canary engine only,
    which is quarantined while the other is never touched; no request fails; and the canary serves B
    again, restored by the fleet from B's directory, with no trainer call."""
    client: FleetClient = fleet["client"]
    router: GenerationRouter = fleet["router"]
    url = router.base_url()
    engines = fleet["engines"]
    step_b = _perturbed_copy(vllm_python, tiny_model_dir, fleet["logdir"] / "tiny-step-b4", 3.0)
    moved = client.load_weights(step_b, "step-4")
    assert moved["ok"], moved
    on_b = moved["checksum"]
    cut = fleet["logdir"] / "tiny-step-b4-cut"
    shutil.copytree(step_b, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    results, threads = _stream(url, 8, "during the cut refit")
    with pytest.raises(ValueError, match="shorter than") as refused:
        client.load_weights(cut, "step-5-cut")
    for t in threads:
        t.join(300)
    assert [results[i][0] for i in range(8)] == [200] * 8, results
    assert client.weight_version().result["current"] == "step-4"
    odd = fleet["logdir"] / "tiny-step-b4-odd"
    shutil.copytree(step_b, odd)
    out = subprocess.run(
        [vllm_python, "-c", UNKNOWN_TENSOR, str(odd / "model.safetensors")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    # A tensor the model has no parameter for is refused before the pause too (issue 38, finding 11:
    # names, dtypes and shapes against the served model's); what only the loader finds is a torch file
    # whose container is whole and whose pickle is not.
    with pytest.raises(
        ValueError, match=r"the served model does not have: model\.layers\.0\.mlp\.bogus\.weight"
    ):
        client.load_weights(odd, "step-5-odd")
    unpicklable = fleet["logdir"] / "tiny-step-b4-unpicklable"
    shutil.copytree(step_b, unpicklable)
    (unpicklable / "model.safetensors").unlink()
    with zipfile.ZipFile(unpicklable / "pytorch_model.bin", "w") as archive:
        archive.writestr("archive/data.pkl", b"not a pickle")
    results, threads = _stream(url, 8, "during the odd refit")
    with pytest.raises(RefitError) as failed:
        client.load_weights(unpicklable, "step-5-odd")
    for t in threads:
        t.join(300)
    txn = failed.value.txn
    canary = txn["canary"]
    other = next(e for e in engines if e.url != canary)
    assert txn["phase"] == "failed" and list(txn["quarantined"]) == [canary], txn
    why = txn["quarantined"][canary]
    assert why.startswith("canary: reload from") and "tiny-step-b4-unpicklable" in why, why
    assert txn["engines"][other.url]["state"] == "pending"  # never touched
    assert [results[i][0] for i in range(8)] == [200] * 8, results
    assert client.weight_version(check=False).result["current"] == "step-4"
    assert _weight_version(other.url) == "step-4"
    # The fleet restores the canary from B's directory by itself.
    assert _until(lambda: client.stale_engines() == {}, 60), client.stale_engines()
    groups = client.checksum().result["groups"]
    assert list(groups) == [on_b] and sorted(groups[on_b]) == sorted(e.url for e in engines), groups
    assert _weight_version(canary) == "step-4"
    assert client.refit_state()["last"]["id"] == txn["id"]  # no refit since: restored, not refit
    before = _generation_tokens(canary)
    for i in range(4):
        status, headers, _ = _chat_with_headers(url, f"after the restore {i}")
        assert status == 200 and headers.get("x-rl-weight-version") == "step-4", headers
    assert _generation_tokens(canary) > before
    print(
        f"\n[refit vllm] cut checkpoint refused before the pause: {str(refused.value)[:200]!r}; "
        f"canary {canary} quarantined with {why[:160]!r}, restored to step-4 ({on_b}); 16/16 rollouts 200"
    )


EDIT_TENSOR = """
import sys, torch
from safetensors.torch import load_file, save_file
path, action, name = sys.argv[1:4]
tensors = load_file(path)
if action == "drop":
    del tensors[name]
else:
    noise = torch.randn(tensors[name].shape, generator=torch.Generator().manual_seed(11)) * 0.5
    tensors[name] = (tensors[name].float() + noise).to(tensors[name].dtype)
save_file(tensors, path, metadata={"format": "pt"})
"""
LINEAR = "model.layers.1.self_attn.o_proj.weight"
"""A linear layer's tensor: on vLLM 0.32 CPU its parameter is emptied once loaded (issue 38, finding 11)."""
EMPTY = hashlib.sha256(b"").hexdigest()


def _edited_copy(vllm_python: str, source: Path, target: Path, action: str, name: str = LINEAR) -> Path:
    """A copy of ``source`` with one tensor perturbed (``"perturb"``) or left out (``"drop"``)."""
    if not target.exists():
        shutil.copytree(source, target)
    weights = target / "model.safetensors"
    out = subprocess.run(
        [vllm_python, "-c", EDIT_TENSOR, str(weights), action, name],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return target


def _post_engine(engine_url: str, path: str, body: Any) -> Any:
    req = urllib.request.Request(
        engine_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _unprefixed(table: dict[str, str]) -> dict[str, str]:
    return {name.rsplit(":", 1)[-1]: digest for name, digest in table.items()}


def test_a_checkpoint_differing_in_one_linear_layer_gets_another_checksum(
    fleet: Any, vllm_python: str, tiny_model_dir: Path
) -> None:
    """Issue 38 finding 11: vLLM's ``/weight_checker`` hashes zero bytes for every linear weight on the CPU
    build, so a checkpoint differing from C in one linear layer got exactly C's checksum. The checksum the
    refit verifies now covers every weight the engine computes with, and equals the table computed from
    the checkpoint's own files (vLLM's fused parameters stacked from their parts)."""
    client: FleetClient = fleet["client"]
    engines = fleet["engines"]
    base = _perturbed_copy(vllm_python, tiny_model_dir, fleet["logdir"] / "tiny-c", 1.5)
    linear = _edited_copy(vllm_python, base, fleet["logdir"] / "tiny-c-linear", "perturb")
    on_c = client.load_weights(base, "step-c")
    assert on_c["ok"], on_c
    checker = _post_engine(engines[0].url, "/weight_checker", {"action": "checksum"})["checksums"]
    blind = sorted(n.rsplit(":", 1)[-1] for n, d in checker.items() if d == EMPTY)
    greedy_c = _greedy(engines[0].url)
    on_linear = client.load_weights(linear, "step-c-linear")
    assert on_linear["ok"], on_linear
    print(
        f"\n[refit vllm] /weight_checker hashes {len(checker) - len(blind)} of {len(checker)} parameters "
        f"(zero bytes for {len(blind)}: {blind}); refit checksum of C {on_c['checksum']}, of C with "
        f"{LINEAR} changed {on_linear['checksum']}"
    )
    assert on_linear["checksum"] != on_c["checksum"], "one linear layer apart, the same checksum"
    assert _greedy(engines[0].url) != greedy_c  # it is other weights the engines serve
    assert on_c["uncovered_parameters"] == [] and on_linear["uncovered_parameters"] == []
    extension = _post_engine(engines[0].url, "/collective_rpc", {"method": "rl_launch_weight_checksums"})
    table = extension["results"][0]["checksums"]
    assert _unprefixed(table) == llama_weight_table(linear)  # every parameter, as the files hold it
    print(
        f"[refit vllm] the launcher's extension hashes {sum(d != EMPTY for d in table.values())} of "
        f"{len(table)}, equal to the table computed from the checkpoint's files"
    )


def test_a_checkpoint_missing_a_linear_tensor_is_refused_before_the_pause(
    fleet: Any, vllm_python: str
) -> None:
    """Issue 38 finding 11: a checkpoint missing one linear tensor refitted with exit 0 (vLLM's reload
    keeps the old layer) and the engines served a hybrid under the new version. Now refused 400 before
    anything pauses, naming the tensor; the engines are untouched."""
    client: FleetClient = fleet["client"]
    router: GenerationRouter = fleet["router"]
    engines = fleet["engines"]
    source = fleet["logdir"] / "tiny-c"
    missing = _edited_copy(vllm_python, source, fleet["logdir"] / "tiny-c-missing", "drop")
    before = client.checksum().result["groups"]
    last = client.refit_state()["last"]["id"]
    version = client.weight_version().result["current"]
    paused_before = router.gate.pauses_total
    with pytest.raises(ValueError) as refused:
        client.load_weights(missing, "step-hybrid")
    why = str(refused.value)
    assert "lacks 1 of the served model" in why and LINEAR in why, why
    assert client.refit_state()["last"]["id"] == last  # no transaction began: nothing paused
    assert router.gate.pauses_total == paused_before
    assert client.weight_version().result["current"] == version
    assert set(client.weight_version().result["engines"].values()) == {version}
    assert client.checksum().result["groups"] == before
    assert all(_weight_version(e.url) == version for e in engines)
    print(f"\n[refit vllm] a checkpoint missing {LINEAR}: refused before the pause: {why[:300]!r}")


def test_a_directory_rewritten_after_its_refit_is_refused_on_restore(
    fleet: Any, vllm_python: str, tiny_model_dir: Path
) -> None:
    """Issue 38 finding 11: a checkpoint directory rewritten after its refit was reloaded into a restarted
    engine under the old version, and the fleet served two weights under one version. Now the restore
    refuses files changed since their version was verified: the restarted engine stays out, with the
    reason, and serves nothing until a refit; a refit from the rewritten directory then brings it in."""
    client: FleetClient = fleet["client"]
    router: GenerationRouter = fleet["router"]
    d = _perturbed_copy(vllm_python, tiny_model_dir, fleet["logdir"] / "tiny-d", 2.5)
    moved = client.load_weights(d, "step-d")
    assert moved["ok"], moved
    time.sleep(0.05)  # a distinct mtime even on a coarse clock
    _edited_copy(vllm_python, d, d, "perturb")  # the next step saved over it
    old = fleet["engines"][1]
    old.stop()
    cpus = fleet["cpus"]
    new = _engine(
        vllm_python,
        tiny_model_dir,
        fleet["logdir"] / "engine1-rewritten.log",
        cpus[1] if len(cpus) >= 2 else None,
    )
    fleet["engines"][1] = new
    _start([new])
    e0 = fleet["engines"][0]
    router.set_serving_backends([e0.api_url, new.api_url])
    assert _until(lambda: "changed since version 'step-d'" in client.stale_engines().get(new.url, ""), 120), (
        client.stale_engines()
    )
    why = client.stale_engines()[new.url]
    assert "model.safetensors" in why, why
    assert router.serving_backends() == [e0.url]
    assert _weight_version(new.url) != "step-d"
    before = _generation_tokens(new.url)
    url = router.base_url()
    assert all(_chat(url, 4, f"while refused {i}")[0] == 200 for i in range(4))
    assert _generation_tokens(new.url) == before, "the engine refused a restore served"
    again = client.load_weights(d, "step-d2")  # the trainer refits from what the directory holds now
    assert again["ok"] and sorted(again["verified"]) == sorted([e0.url, new.url]), again
    assert again["checksum"] != moved["checksum"]
    print(f"\n[refit vllm] restore of a restarted engine from a rewritten directory refused: {why[:300]!r}")
