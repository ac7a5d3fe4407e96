"""Tests for ``launcher.engines.vllm``: command building, lifecycle with fake servers, and real vLLM e2e.

The first part needs no vLLM: fake "python" executables stand in for the server so startup failure,
deadline, process-group cleanup and the env the child actually receives are checked in milliseconds.

The e2e part (``-m vllm``) starts two real vLLM CPU engines (needs ``RL_LAUNCH_VLLM_PYTHON``) and puts
the generation router in front of them::

    export RL_LAUNCH_VLLM_PYTHON="$(scripts/install-vllm.sh --cpu)"   # once; prints the venv's python
    .venv/bin/pytest tests/vllm/test_vllm_engine.py -m vllm -s  # -s shows timings and prefix-cache figures
"""

from __future__ import annotations

import io
import json
import os
import re
import stat
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.engines.base import EngineSpec, EngineStartError
from launcher.engines.cores import split_cores, started_on, usable_cores
from launcher.engines.vllm.engine import API_SERVER_MODULE, VllmEngine, group_pids
from router.ports import free_port

SECRET = "sk-test-do-not-leak-4242"


def _spec(**kw: Any) -> EngineSpec:
    base: dict[str, Any] = dict(model="/models/tiny", served_name="tiny", port=8000)
    base.update(kw)
    return EngineSpec(**base)


def _script(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


# ------------------------------------------------------------------------------ command building


def test_module_form_command() -> None:
    spec = _spec(
        tensor_parallel_size=4,
        api_key=SECRET,
        extra_args=["--max-model-len", "4096", "--dtype=bfloat16", "--gpu-memory-utilization", "0.9"],
    )
    e = VllmEngine(spec, python="/opt/venv/bin/python")
    argv = e.command()
    assert e.launch == "module"
    assert argv[:5] == ["/opt/venv/bin/python", "-m", API_SERVER_MODULE, "--model", "/models/tiny"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4"
    assert argv[argv.index("--served-model-name") + 1] == "tiny"
    assert argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--enable-prefix-caching" in argv
    # Extra args verbatim and last, so they can override ours (argparse: last one wins).
    assert argv[-5:] == spec.extra_args
    assert not any(SECRET in a for a in argv)
    assert "--api-key" not in argv
    assert e.environment({})["VLLM_API_KEY"] == SECRET


def test_console_form_command_is_default_without_python() -> None:
    e = VllmEngine(_spec(served_name=None), vllm_bin="/usr/bin/vllm")
    argv = e.command()
    assert e.launch == "console"
    assert argv[:3] == ["/usr/bin/vllm", "serve", "/models/tiny"]
    assert "--model" not in argv
    assert "--served-model-name" not in argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "1"


def test_explicit_module_form_uses_current_python() -> None:
    e = VllmEngine(_spec(), launch="module")
    assert e.command()[0] == sys.executable


def test_bad_launch_form() -> None:
    with pytest.raises(ValueError):
        VllmEngine(_spec(), launch="docker")  # type: ignore[arg-type]


def test_environment() -> None:
    base = {"PATH": "/bin", "VLLM_API_KEY": "inherited-key"}
    env = VllmEngine(_spec(env={"CUDA_VISIBLE_DEVICES": "2,3"})).environment(base)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["PATH"] == "/bin"
    assert "VLLM_API_KEY" not in env  # the spec (no key) decides, not the launcher's environment

    # An explicit HF_HUB_OFFLINE in the environment is respected; hf_offline=False sets nothing.
    assert VllmEngine(_spec()).environment({"HF_HUB_OFFLINE": "0"})["HF_HUB_OFFLINE"] == "0"
    assert "HF_HUB_OFFLINE" not in VllmEngine(_spec(), hf_offline=False).environment({})

    # Non-loopback hosts: vLLM picks its own internal address.
    assert "VLLM_HOST_IP" not in VllmEngine(_spec(host="0.0.0.0")).environment({})
    assert VllmEngine(_spec(host="localhost")).environment({})["VLLM_HOST_IP"] == "127.0.0.1"
    # spec.env wins over our defaults.
    assert VllmEngine(_spec(env={"VLLM_HOST_IP": "10.0.0.5"})).environment({})["VLLM_HOST_IP"] == "10.0.0.5"


def test_port_zero_is_resolved_only_at_start() -> None:
    e = VllmEngine(_spec(port=0))
    with pytest.raises(RuntimeError):
        _ = e.port
    assert 0 < free_port("127.0.0.1") < 65536


# ------------------------------------------------------------------------------ lifecycle with fakes

FAKE_PORT = """import http.server, json, os, sys
argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
"""
"""The start of a fake vLLM server: the port it was given, as vLLM's ``--port``."""

FAKE_HEALTH = """class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""
"""The end of a fake vLLM server: ``/health`` answers 200 on that port until it is stopped."""

FAKE_SERVER = (
    """#!{python}
# Stand-in for `python -m vllm.entrypoints.openai.api_server`: records what it got, serves /health.
"""
    + FAKE_PORT
    + """with open(os.environ["FAKE_RECORD"], "w") as f:
    json.dump({{"argv": argv, "env": dict(os.environ)}}, f)
print("fake vllm: listening on", port, flush=True)
"""
    + FAKE_HEALTH
)


def test_start_wait_stop_with_fake_server(tmp_path: Path) -> None:
    from rich.console import Console

    fake = _script(tmp_path / "python", FAKE_SERVER.format(python=sys.executable))
    record = tmp_path / "record.json"
    out = io.StringIO()
    spec = _spec(
        port=0,
        api_key=SECRET,
        extra_args=["--max-model-len", "4096"],
        env={"FAKE_RECORD": str(record), "CUDA_VISIBLE_DEVICES": "1"},
        log_path=str(tmp_path / "engine.log"),
        startup_timeout_s=30,
    )
    e = VllmEngine(spec, python=fake, console=Console(file=out, force_terminal=False), health_poll_s=0.1)
    try:
        e.start_and_wait()
        assert e.is_alive()
        assert e.port > 0 and e.url == f"http://127.0.0.1:{e.port}"
        assert e.api_url.endswith("/v1")
        got = json.loads(record.read_text())
        assert got["argv"][got["argv"].index("--port") + 1] == str(e.port)
        assert got["env"]["VLLM_API_KEY"] == SECRET
        assert got["env"]["CUDA_VISIBLE_DEVICES"] == "1"
        assert got["env"]["HF_HUB_OFFLINE"] == "1"
        assert not any(SECRET in a for a in got["argv"])
        assert "ready" in out.getvalue()
        log = (tmp_path / "engine.log").read_text()
        assert "fake vllm: listening" in log and SECRET not in log
        assert "rl-launch: starting vLLM" in e.log_tail()
    finally:
        e.stop()
    assert not e.is_alive()
    e.stop()  # idempotent


def test_startup_failure_raises_with_log_tail(tmp_path: Path) -> None:
    fake = _script(
        tmp_path / "python",
        '#!/bin/sh\necho "fake vllm: loading model"\necho "RuntimeError: pretend the model is broken" >&2\n'
        "exit 1\n",
    )
    e = VllmEngine(_spec(port=0, api_key=SECRET, log_path=str(tmp_path / "e.log")), python=fake)
    with pytest.raises(EngineStartError) as info:
        e.start_and_wait()
    msg = str(info.value)
    assert "exited with code 1" in msg
    assert "fake vllm: loading model" in msg
    assert "pretend the model is broken" in msg  # stderr goes to the same log
    assert SECRET not in msg
    assert not e.is_alive()


def test_missing_executable_is_a_start_error(tmp_path: Path) -> None:
    e = VllmEngine(_spec(port=0, log_path=str(tmp_path / "e.log")), vllm_bin=str(tmp_path / "no-vllm"))
    with pytest.raises(EngineStartError, match="cannot run"):
        e.start_and_wait()
    assert not e.is_alive()


def test_deadline_stops_whole_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    fake = _script(tmp_path / "python", f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nexec sleep 300\n")
    e = VllmEngine(_spec(port=0, log_path=str(tmp_path / "e.log")), python=fake, health_poll_s=0.05)
    e.start()
    with pytest.raises(EngineStartError, match="deadline"):
        e.wait_ready(time.monotonic() + 0.5)
    assert not e.is_alive()
    assert pidfile.exists()
    assert e.pid is not None and group_pids(e.pid) == []  # the backgrounded grandchild is gone too


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    fake = _script(tmp_path / "python", "#!/bin/sh\ntrap '' TERM\nsleep 300 &\nexec sleep 300\n")
    e = VllmEngine(_spec(port=0, log_path=str(tmp_path / "e.log")), python=fake)
    e.start()
    time.sleep(0.3)  # let the shell install the trap and fork
    t0 = time.monotonic()
    e.stop(grace_s=0.5)
    assert time.monotonic() - t0 >= 0.5
    assert not e.is_alive()
    assert e.pid is not None and group_pids(e.pid) == []


# ------------------------------------------------------------------------------ real vLLM e2e

CORE_RECORDER = (
    """#!{python}
# Stand-in for the vLLM server: records the cores it may run on and its OpenMP binding, serves /health.
"""
    + FAKE_PORT
    + """with open(os.environ["FAKE_RECORD"] + "." + str(port), "w") as f:
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    json.dump({{"cores": sorted(os.sched_getaffinity(0)), "bind": bind}}, f)
"""
    + FAKE_HEALTH
)


def test_host_starts_each_cpu_engine_on_its_own_cores_and_restarts_it_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine host's side of the pinning (the real engines' is tests/vllm/test_cpu_cores.py): each
    vLLM engine without a GPU starts on a disjoint share of the host's cores with its OpenMP threads bound
    inside it, its log says so, and a restart puts it back on the same share."""
    from launcher.engines.host import EngineHost, start_all
    from launcher.engines.host_config import EngineHostConfig

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"one core here ({cores}): two engines cannot have cores of their own")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    fake = _script(tmp_path / "python", CORE_RECORDER.format(python=sys.executable))
    record = tmp_path / "record"
    cfg = EngineHostConfig(
        kind="vllm",
        count=2,
        host="127.0.0.1",
        model="/models/tiny",
        vllm_python=fake,
        env={"FAKE_RECORD": str(record)},
        job_dir=str(tmp_path / "job"),
        log_dir=str(tmp_path / "job" / "logs"),
        startup_timeout_s=30,
    )
    host = EngineHost(cfg)

    def seen(i: int) -> dict[str, Any]:
        return json.loads(Path(f"{record}.{host.engines[i].port}").read_text())

    try:
        start_all(host.engines, 30, host.cores)
        first, second = seen(0), seen(1)
        assert first["cores"] and second["cores"] and not set(first["cores"]) & set(second["cores"])
        assert set(first["cores"]) | set(second["cores"]) == set(cores)
        for got in (first, second):
            assert got["bind"] and set(map(int, got["bind"].replace("-", ",").split(","))) <= set(
                got["cores"]
            )
        assert f"rl-launch: cores {first['cores'][0]}" in host.engines[0].log_tail(50)
        assert os.sched_getaffinity(0) == set(cores)  # the host's own thread is back on every core
        host.restart(1, 1)
        assert host.errors[1] is None and seen(1)["cores"] == second["cores"]
    finally:
        host.stop()


N_ENGINES = 2
STARTUP_TIMEOUT_S = 600.0  # ~70-150 s seen on a busy 2-core box; generous for slow CI runners
REQUEST_TIMEOUT_S = 60.0  # client side; a tiny-model request takes well under a second
ROUTER_BACKEND_TIMEOUT_S = 120.0
MAX_TOKENS = 8


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
        return json.loads(raw) if r.headers.get_content_type() == "application/json" else raw.decode()


def _sse(url: str, body: dict[str, Any]) -> list[str]:
    """POST with ``stream: true``; return the ``data:`` payloads in order (``[DONE]`` included)."""
    req = urllib.request.Request(
        url, data=json.dumps({**body, "stream": True}).encode(), headers={"Content-Type": "application/json"}
    )
    out = []
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
        assert r.headers.get_content_type() == "text/event-stream"
        for line in r:
            line = line.strip()
            if line.startswith(b"data:"):
                out.append(line[5:].strip().decode())
    return out


_METRIC_RE = re.compile(r"^(vllm:prefix_cache_(?:hits|queries)_total)\{[^}]*\} ([0-9.eE+-]+)$", re.M)


def _cache_counters(engine: VllmEngine) -> tuple[float, float]:
    """(hits, queries) in tokens, from the engine's own /metrics."""
    text = _http(f"{engine.url}/metrics")
    vals = {"vllm:prefix_cache_hits_total": 0.0, "vllm:prefix_cache_queries_total": 0.0}
    for name, v in _METRIC_RE.findall(text):
        vals[name] += float(v)
    return vals["vllm:prefix_cache_hits_total"], vals["vllm:prefix_cache_queries_total"]


Counters = list[tuple[float, float]]


def _counters_after(engines: list[VllmEngine], before: Counters) -> Counters:
    """Counters once the last request shows up in some engine's query count (stats can lag a little)."""
    end = time.monotonic() + 10
    while True:
        now = [_cache_counters(e) for e in engines]
        if sum(q for _, q in now) > sum(q for _, q in before) or time.monotonic() > end:
            return now
        time.sleep(0.1)


def _system_prompt(tag: str, size: int = 2048) -> str:
    words = "rollout reward policy token cache prefix engine router batch sample gradient value".split()
    text = f"You are session {tag}. "
    i = 0
    while len(text) < size:
        text += words[(i * 7 + len(tag)) % len(words)] + " "
        i += 1
    return text[:size]


def _user_turn(t: int) -> str:
    """~900 chars (>128 tokens, one vLLM CPU KV block), so every turn adds whole cacheable blocks."""
    return f"turn {t}: " + "what happens next in this rollout? " * 25


def _chat_body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0,
    }


def _diagnose(engines: list[VllmEngine], progress: list[str]) -> str:
    """What a failure message needs: the turns done so far and each engine's state and log tail."""
    out = ["turns so far:", *progress]
    for i, e in enumerate(engines):
        out += [f"--- engine{i} {e.url} alive={e.is_alive()} log {e.log_path} ---", e.log_tail(15)]
    return "\n".join(out)


@pytest.fixture(scope="module")
def vllm_engines(
    vllm_python: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmEngine]]:
    """Two real vLLM CPU engines on OS-chosen loopback ports, started in parallel."""
    logdir = tmp_path_factory.mktemp("vllm-logs")
    # As the engine host does: a disjoint share of this process's cores per engine, each started on its
    # share and binding its OpenMP threads there (vLLM's "auto" binding put both on the same core).
    shares, _ = split_cores(usable_cores(), N_ENGINES)
    engines = []
    for i in range(N_ENGINES):
        env = {"VLLM_CPU_KVCACHE_SPACE": "1"}  # GiB; the default would reserve far more RAM
        spec = EngineSpec(
            model=str(tiny_model_dir),
            served_name="tiny",
            port=0,
            extra_args=["--max-model-len", "4096", "--enforce-eager"],  # as tests.support.vllm_calls: why
            env=env,
            log_path=str(logdir / f"engine{i}.log"),
            startup_timeout_s=STARTUP_TIMEOUT_S,
        )
        engines.append(VllmEngine(spec, python=vllm_python, cpu_workers=1))
    t0 = time.monotonic()
    try:
        for e, share in zip(engines, shares, strict=True):
            with started_on(share):
                e.start()
        for e in engines:
            try:
                e.wait_ready(t0 + STARTUP_TIMEOUT_S)
            except EngineStartError as exc:
                pytest.fail(f"vLLM engine failed to start:\n{exc}", pytrace=False)
        for i, e in enumerate(engines):
            took = (e.ready_at or 0) - (e.started_at or 0)
            rss = e.rss_bytes() / 2**30
            print(f"\n[vllm e2e] engine{i} {e.url} ready after {took:.1f}s, RSS {rss:.2f} GiB (group)")
        yield engines
    finally:
        for e in engines:
            e.stop()


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_engines_serve_and_reuse_prefix_directly(vllm_engines: list[VllmEngine]) -> None:
    """Each engine on its own: models, chat, /tokenize, and prefix-cache hits on a resent context."""
    for i, e in enumerate(vllm_engines):
        assert [m["id"] for m in _http(f"{e.api_url}/models")["data"]] == ["tiny"]
        messages = [
            {"role": "system", "content": _system_prompt(f"direct-{i}")},
            {"role": "user", "content": _user_turn(0)},
        ]
        before = _cache_counters(e)
        first = _http(f"{e.api_url}/chat/completions", _chat_body(messages))
        assert first["usage"]["completion_tokens"] == MAX_TOKENS
        mid = _counters_after([e], [before])[0]
        messages += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": _user_turn(1)},
        ]
        second = _http(f"{e.api_url}/chat/completions", _chat_body(messages))
        after = _counters_after([e], [mid])[0]
        assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
        hits = after[0] - mid[0]
        queried = after[1] - mid[1]
        print(f"\n[vllm e2e] engine{i} direct: 2nd turn hit {hits:.0f} of {queried:.0f} prompt tokens")
        assert hits > 0, f"engine{i}: no prefix-cache hits on a resent context\n{e.log_tail()}"
        tok = _http(f"{e.url}/tokenize", {"model": "tiny", "prompt": "hello world"})
        assert tok["count"] == len(tok["tokens"]) > 0


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_router_over_two_engines(vllm_engines: list[VllmEngine]) -> None:
    """Multi-turn chat through the cache-aware router: streaming and not, /tokenize, cache reuse."""
    from router import GenerationRouter, RouterConfig

    config = RouterConfig(
        host="127.0.0.1",
        port=0,
        policy="cache_aware",
        insecure_admin=True,
        backend_timeout_s=ROUTER_BACKEND_TIMEOUT_S,
        connect_timeout_s=5,
    )
    router = GenerationRouter(config, [e.api_url for e in vllm_engines])
    router.serve_in_background()
    try:
        url = router.base_url()
        api = f"{url}/v1"
        per_turn: list[str] = []

        def turn(session: str, messages: list[dict[str, str]], stream: bool) -> tuple[str, int, float]:
            """One request; returns the reply text, which engine served it and that engine's new hits."""
            before = [_cache_counters(e) for e in vllm_engines]
            where = f"{session} turn {len(messages) // 2} ({'streaming' if stream else 'non-streaming'})"
            try:
                if stream:
                    chunks = _sse(f"{api}/chat/completions", _chat_body(messages))
                else:
                    resp = _http(f"{api}/chat/completions", _chat_body(messages))
            except OSError as exc:  # URLError, HTTPError, timeouts
                diag = _diagnose(vllm_engines, per_turn)
                pytest.fail(f"{where} through the router failed: {exc!r}\n{diag}")
            if stream:
                assert len(chunks) >= 2, chunks
                assert chunks[-1] == "[DONE]", chunks[-3:]
                parsed = [json.loads(c) for c in chunks[:-1]]
                text = "".join(p["choices"][0]["delta"].get("content") or "" for p in parsed if p["choices"])
            else:
                assert resp["usage"]["completion_tokens"] == MAX_TOKENS
                text = resp["choices"][0]["message"]["content"]
            after = _counters_after(vllm_engines, before)
            deltas = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
            queries = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
            per_turn.append(
                f"{session} turn {len(messages) // 2}: hits/engine {[int(d) for d in deltas]}"
                f" of prompt tokens/engine {[int(q) for q in queries]}"
            )
            served = [i for i, q in enumerate(queries) if q > 0]
            assert len(served) == 1, "\n".join(per_turn)
            return text, served[0], deltas[served[0]]

        for session, stream in (("A", False), ("B", True)):
            messages = [{"role": "system", "content": _system_prompt(f"router-{session}")}]
            home, prev_hits = None, 0.0
            for t in range(4 if not stream else 3):
                messages.append({"role": "user", "content": _user_turn(t)})
                text, engine, hits = turn(session, messages, stream)
                messages.append({"role": "assistant", "content": text})
                if home is None:
                    home = engine  # the first turn is cold: any engine (ties are broken at random)
                else:
                    # The whole context is resent each turn: a cache-aware router keeps the session on the
                    # engine that already holds its prefix, and that engine's own counter shows the hits,
                    # growing with the context (earlier replies included) since each turn adds full blocks.
                    assert engine == home, "\n".join(per_turn)
                    assert hits > prev_hits, "\n".join(per_turn)
                prev_hits = hits

        tok = _http(f"{url}/tokenize", {"model": "tiny", "messages": messages})
        direct = _http(f"{vllm_engines[0].url}/tokenize", {"model": "tiny", "messages": messages})
        assert tok["count"] > 0 and tok["count"] == direct["count"]

        totals = [_cache_counters(e) for e in vllm_engines]
        print("\n[vllm e2e] router: " + "\n[vllm e2e] router: ".join(per_turn))
        print(f"[vllm e2e] totals (hits, queries) per engine: {totals}")
    finally:
        router.stop()
