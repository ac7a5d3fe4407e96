"""Plain-HTTP calls the real-vLLM refit tests make of a router and its engines (chats with and without
their headers, a bounded stream of rollouts in threads, polling, a perturbed copy of the tiny model as
another step's checkpoint): shared by tests/vllm/test_refit_vllm.py and test_control_api_vllm.py, which
drive the same fleet two ways (``FleetClient`` and vLLM's control API), and the engines the refit and
stream tests start (``dev_engine``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from launcher.engines.base import EngineSpec
from launcher.engines.vllm.engine import VllmEngine, group_pids

STARTUP_TIMEOUT_S = 600.0

PERTURB = """
import sys, torch
from safetensors.torch import load_file, save_file
path = sys.argv[1]
shift = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
tensors = load_file(path)
name = next(k for k in sorted(tensors) if k.startswith("lm_head"))
generator = torch.Generator().manual_seed(int(shift * 1000))
noise = torch.randn(tensors[name].shape, generator=generator) * shift
tensors[name] = (tensors[name].float() + noise).to(tensors[name].dtype)
save_file(tensors, path, metadata={"format": "pt"})
print(name)
"""


def _chat(url: str, max_tokens: int, content: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _in_thread(results: dict[int, Any], key: int, *args: Any, **kw: Any) -> threading.Thread:
    def run() -> None:
        t0 = time.monotonic()
        results[key] = (*_chat(*args, **kw), time.monotonic() - t0, time.monotonic())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _perturbed_copy(vllm_python: str, source: Path, target: Path, shift: float) -> Path:
    """A copy of the tiny model whose ``lm_head`` differs (another step's checkpoint)."""
    shutil.copytree(source, target)
    weights = next(target.glob("*.safetensors"))
    out = subprocess.run(
        [vllm_python, "-c", PERTURB, str(weights), str(shift)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return target


def _until(check: Any, timeout_s: float) -> bool:
    """Poll ``check()`` every 0.1 s for at most ``timeout_s``; whether it held."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _chat_with_headers(url: str, content: str) -> tuple[int, dict[str, str], Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}, json.loads(resp.read())


def _stream(url: str, n: int, tag: str) -> tuple[dict[int, Any], list[threading.Thread]]:
    """``n`` rollouts sent 0.1 s apart, each in a thread (a bounded stream during a refit)."""
    results: dict[int, Any] = {}
    threads = []
    for i in range(n):
        threads.append(_in_thread(results, i, url, 32, f"{tag} {i}"))
        time.sleep(0.1)
    return results, threads


def dev_engine(
    python: str,
    model: Path,
    log: Path,
    cpu: int | None,
    key: str,
    key_guard: bool = True,
    extra_args: Sequence[str] = (),
) -> VllmEngine:
    """A real vLLM CPU engine serving the tiny model as ``tiny`` with vLLM's dev routes on (the refit's
    reload and reset need them), taking ``key``, on core ``cpu`` when given. ``--enforce-eager`` as the
    CPU examples run it: without it each start compiles the model with torch.compile (measured on an idle
    2-core machine: 48 s to ready against 24 s), CPU the other lane's tests wait for in CI."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    spec = EngineSpec(
        model=str(model),
        served_name="tiny",
        port=0,
        api_key=key,
        key_guard=key_guard,
        extra_args=["--max-model-len", "4096", "--enforce-eager", *extra_args],
        env=env,
        log_path=str(log),
        startup_timeout_s=STARTUP_TIMEOUT_S,
    )
    return VllmEngine(spec, python=python)


def generation_behind_serving(engine: VllmEngine, nice: int = 10) -> list[int]:
    """Lower the scheduling priority of ``engine``'s generating processes (every thread of every process
    below its API server: the engine core and its OpenMP threads) to ``nice``; the API server stays as
    it is. A test that acts after the router has read part of an answer needs the router to have read
    what the engine made: on a busy 2-core machine the engine core, pinned and always runnable, ran
    seconds ahead of its API server and the router, which then got the answer in bursts, its end before
    the test could act. Behind them, the engine makes a token only when the API server, the router and
    the clients have nothing left to do. Returns the process ids reniced."""
    assert engine.pid is not None
    below = [pid for pid in group_pids(engine.pid) if pid != engine.pid]  # its own process group
    for pid in below:
        try:
            for tid in (Path("/proc") / str(pid) / "task").iterdir():
                os.setpriority(os.PRIO_PROCESS, int(tid.name), nice)
        except (OSError, ValueError):
            continue  # it ended meanwhile
    return below
