"""Streamed weights into real vLLM CPU engines, through the router's fleet routes.

None of vLLM 0.32's weight-transfer backends runs on a CPU engine (``router/fleet/transfer_backends.py``
says why, backend by backend), so the streamed path had never run on real engines here. Two engines start
with rl-launch's gloo backend (``--weight-transfer-config '{"backend": "rl_launch_gloo"}'``, registered by
the launcher's worker extension: ``launcher/engines/vllm/worker_ext/rl_launch_gloo.py``), and a trainer
process (plain torch, the vLLM venv's interpreter, running ``rl_launch_gloo.py send``) streams a
checkpoint of other weights into both, the way a trainer drives vLLM's weight transfer:
``/fleet/weight_transfer/init`` (each engine joins at its rank offset while the trainer joins as rank 0),
then one transaction ``/fleet/refit/begin`` -> ``/fleet/refit/update`` per round (the trainer broadcasts
meanwhile) -> ``/fleet/refit/commit``. Checked: the fleet's checksum moves as one, equals the table
computed from the streamed checkpoint's files, and greedy answers change to the ones the same weights
give when loaded from disk. One fleet for the module (each engine start costs ~90 s on 2 cores)::

    .venv/bin/pytest tests/vllm/test_stream_cpu.py -m vllm -s    # -s prints the figures
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.engines.base import EngineStartError
from launcher.engines.vllm.engine import VllmEngine
from launcher.engines.vllm.worker_ext import WORKER_EXT_DIR
from launcher.fleet.client import FleetClient
from router import GenerationRouter, RouterConfig
from tests.support.checkpoints import llama_weight_table
from tests.support.shared_vllm import start_all
from tests.support.trainer_replays import TrlAsyncGrpo
from tests.support.vllm_calls import dev_engine

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
KEY = "stream-engine-key-1234"
TOKEN = "stream-admin-token-5678"
TRANSFER = json.dumps({"backend": "rl_launch_gloo"})
ROUND_BYTES = 256 * 1024  # the tiny model (~0.9 MB) streams in several rounds
SENDER = str(Path(WORKER_EXT_DIR) / "rl_launch_gloo.py")

SHIFT_ALL = """
import sys, torch
from safetensors.torch import load_file, save_file
path, seed = sys.argv[1], int(sys.argv[2])
tensors = load_file(path)
generator = torch.Generator().manual_seed(seed)
out = {}
for name in sorted(tensors):
    t = tensors[name]
    out[name] = (t.float() + torch.randn(t.shape, generator=generator) * 0.5).to(t.dtype)
save_file(out, path, metadata={"format": "pt"})
"""
"""Every tensor of the copy changes (linear layers too: the CPU build repacks those for its kernels)."""


def _engine(python: str, model: Path, log: Path, cpu: int | None) -> VllmEngine:
    return dev_engine(python, model, log, cpu, KEY, extra_args=["--weight-transfer-config", TRANSFER])


@pytest.fixture(scope="module")
def fleet(vllm_python: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two real CPU engines with the gloo backend, a router in front (admin token), the trainer's client."""
    logdir = tmp_path_factory.mktemp("stream-cpu")
    cpus = sorted(os.sched_getaffinity(0))
    engines = [
        _engine(vllm_python, tiny_model_dir, logdir / f"engine{i}.log", cpus[i] if len(cpus) >= 2 else None)
        for i in range(2)
    ]
    router: GenerationRouter | None = None
    try:
        try:
            start_all(engines)
        except EngineStartError as exc:
            pytest.fail(f"vLLM engine failed to start:\n{exc}", pytrace=False)
        config = RouterConfig(
            host="127.0.0.1", port=0, policy="round_robin", admin_token=TOKEN, backend_api_key=KEY
        )
        router = GenerationRouter(config, [e.api_url for e in engines])
        router.serve_in_background()
        yield {
            "engines": engines,
            "router": router,
            "client": FleetClient(router.base_url(), TOKEN),
            "logdir": logdir,
        }
    finally:
        if router is not None:
            router.stop()
        for e in engines:
            e.stop()


def _post(url: str, path: str, body: Any) -> Any:
    req = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _greedy(engine_url: str) -> list[str]:
    """An engine's own greedy answers to fixed prompts (straight to the engine, with the key)."""
    texts = []
    for prompt in ("the quick brown fox", "one two three four", "hello"):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        texts.append(_post(engine_url, "/v1/completions", body)["choices"][0]["text"])
    return texts


def _weight_table(engine_url: str) -> dict[str, str]:
    """The engine's checksum table from the launcher's worker extension, names unprefixed."""
    answer = _post(engine_url, "/collective_rpc", {"method": "rl_launch_weight_checksums"})
    return {name.rsplit(":", 1)[-1]: d for name, d in answer["results"][0]["checksums"].items()}


def _shifted_copy(vllm_python: str, source: Path, target: Path, seed: int) -> Path:
    """A copy of ``source`` whose every tensor is moved by noise drawn with ``seed``."""
    shutil.copytree(source, target)
    weights = next(target.glob("*.safetensors"))
    argv = [vllm_python, "-c", SHIFT_ALL, str(weights), str(seed)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return target


class Sender:
    """The trainer's data plane: ``rl_launch_gloo.py send`` in the vLLM venv (a plain torch process)."""

    def __init__(
        self,
        vllm_python: str,
        weights: Path,
        world_size: int,
        round_bytes: int = ROUND_BYTES,
        keyed: bool = True,
    ) -> None:
        argv = [vllm_python, SENDER, "send", "--world-size", str(world_size), "--weights", str(weights)]
        argv += ["--round-bytes", str(round_bytes), "--timeout-s", "120"] + (
            [] if keyed else ["--no-group-key"]
        )
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first:
            pytest.fail(f"the sender ended before it listened: {self.proc.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        opened = json.loads(first)
        self.port: int = opened["port"]
        self.rounds: list[dict[str, Any]] = opened["rounds"]
        self.init_info: dict[str, Any] = opened["init_info"]

    def finish(self) -> dict[str, Any]:
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err[-2000:]
        return json.loads(out.strip().splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=10)


def test_a_trainer_streams_new_weights_into_two_cpu_engines_through_the_fleet_routes(
    fleet: Any, vllm_python: str, tiny_model_dir: Path
) -> None:
    client: FleetClient = fleet["client"]
    engines = fleet["engines"]
    urls = [e.url for e in engines]
    before = client.checksum().result["groups"]
    greedy_before = [_greedy(u) for u in urls]
    assert len(before) == 1 and greedy_before[0] == greedy_before[1]
    new = _shifted_copy(vllm_python, tiny_model_dir, fleet["logdir"] / "tiny-streamed", 7)

    plan = client.weight_transfer_plan()
    assert plan["world_size"] == 3 and [e["rank_offset"] for e in plan["engines"]] == [1, 2], plan
    sender = Sender(vllm_python, next(new.glob("*.safetensors")), plan["world_size"])
    try:
        assert len(sender.rounds) >= 2, sender.rounds  # several rounds, each its own broadcast
        t0 = time.perf_counter()
        assert len(sender.init_info["group_key"]) == 32  # the rendezvous keys are the trainer's secret
        joined = client.init_weight_transfer("127.0.0.1", sender.port, sender.init_info)
        t_init = time.perf_counter() - t0
        assert joined.ok, joined.result
        t1 = time.perf_counter()
        with client.refit(version="streamed-1", source="stream") as handle:
            for info in sender.rounds:
                txn = handle.update_weights(**info)
                states = [e["state"] for e in txn["engines"].values()]
                assert states == ["loaded", "loaded"] and not txn["quarantined"], txn
        t_refit = time.perf_counter() - t1
        sent = sender.finish()
    finally:
        sender.kill()
    result = handle.result or {}
    assert result.get("moved") and result.get("phase") == "done", result

    after = client.checksum().result["groups"]
    assert list(after) == [result["checksum"]] and result["checksum"] not in before, (before, after)
    want = llama_weight_table(new)
    for u in urls:  # every weight the engines compute with is the streamed checkpoint's, byte for byte
        assert _weight_table(u) == want
    greedy_streamed = [_greedy(u) for u in urls]
    assert greedy_streamed[0] == greedy_streamed[1] and greedy_streamed[0] != greedy_before[0]
    assert set(client.weight_version().result["engines"].values()) == {"streamed-1"}

    # The same weights loaded from disk give the same checksum and the same greedy answers.
    from_disk = client.load_weights(new, "from-disk-1")
    assert from_disk["ok"] and from_disk["checksum"] == result["checksum"], from_disk
    assert [_greedy(u) for u in urls] == greedy_streamed
    steps: dict[str, int] = {}
    for step in result["steps"]:  # "receiving" once per round
        steps[step["phase"]] = steps.get(step["phase"], 0) + round(step["took_s"] * 1000)
    print(
        f"\n[stream cpu] {sent['bytes']} bytes in {len(sender.rounds)} rounds into 2 CPU engines over gloo: "
        f"init (group of 3) {t_init * 1000:.0f} ms; refit begin -> {len(sender.rounds)} x update -> commit "
        f"{t_refit * 1000:.0f} ms (trainer's broadcasts {sent['rounds_s']} s; steps ms {steps}); "
        f"load of the same weights from disk {sum(s['took_s'] for s in from_disk['steps']) * 1000:.0f} ms"
    )


def test_trl_streams_through_the_control_url_as_it_would_into_one_vllm(
    fleet: Any, vllm_python: str, tiny_model_dir: Path
) -> None:
    """TRL 1.16's ``AsyncGRPOTrainer`` calls (``tests/support/trainer_replays.TrlAsyncGrpo``: ``/health``,
    ``/server_info``, ``/get_world_size``, ``/init_weight_transfer_engine`` with ``"packed": true``, then
    ``/pause?mode=keep`` -> ``/start_weight_update`` -> one ``/update_weights`` with every tensor ->
    ``/finish_weight_update`` -> ``/resume``) against the fleet's control URL, with the trainer's broadcast
    over gloo instead of NCCL: the fleet moves as one, to the streamed weights."""
    client: FleetClient = fleet["client"]
    urls = [e.url for e in fleet["engines"]]
    version_before = client.weight_version().result["current"]
    greedy_before = _greedy(urls[0])
    new = _shifted_copy(vllm_python, tiny_model_dir, fleet["logdir"] / "tiny-trl", 11)
    trl = TrlAsyncGrpo(fleet["router"].base_url() + "/control", api_key=TOKEN)
    # TRL's client sends nccl's init fields only: no group key
    sender = Sender(vllm_python, next(new.glob("*.safetensors")), 3, round_bytes=1 << 30, keyed=False)
    try:
        assert len(sender.rounds) == 1  # TRL sends every tensor in one /update_weights
        t0 = time.perf_counter()
        init_info = trl.init_weight_transfer("127.0.0.1", sender.port)
        t_init = time.perf_counter() - t0
        assert init_info["world_size"] == 3, init_info
        t1 = time.perf_counter()
        calls = trl.sync(sender.rounds[0])
        t_sync = time.perf_counter() - t1
        sent = sender.finish()
    finally:
        sender.kill()
    assert [c.status for c in calls] == [200] * 5, [c.brief() for c in calls]
    versions = client.weight_version().result
    assert len(set(versions["engines"].values())) == 1 and versions["current"] != version_before, versions
    groups = client.checksum().result["groups"]
    assert len(groups) == 1, groups
    want = llama_weight_table(new)
    for u in urls:
        assert _weight_table(u) == want
    greedy = [_greedy(u) for u in urls]
    assert greedy[0] == greedy[1] and greedy[0] != greedy_before
    print(
        f"\n[stream cpu] TRL's calls on /control: init (preflight + group of 3) {t_init * 1000:.0f} ms; "
        f"pause -> start -> update ({sent['bytes']} bytes, 1 round) -> finish -> resume "
        f"{t_sync * 1000:.0f} ms; "
        f"the fleet on {versions['current']!r}"
    )
