"""Router hardening (issue 9): one test per finding, each against real servers on 127.0.0.1. This file:
the admin surface, health probing, ``RouterConfig`` and secrets; the HTTP path (exact bodies, the status
contract, limits, affinity) is in ``test_router_hardening_http.py``.

Each test failed on the code before the fix it pins, unless its docstring says it guards a behaviour
that was kept. Routers are real ``GenerationRouter``s or real ``rl-launch router`` processes; backends are
real aiohttp servers on OS-chosen ports.

Every test that runs a router runs it twice (the ``workers`` fixture): as one process and with two worker
processes, the mode ``rl-launch router`` runs in by default (issue 17: the worker relay had lost bounds
the single process enforced, and no test ran there). A test that cannot apply to one mode says why.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import aiohttp
import orjson
import pytest
from aiohttp import web
from click.testing import CliRunner
from pydantic import ValidationError

from router import GenerationRouter
from router.cli import router_command
from router.config import RouterConfig, RouterSettings, describe_errors
from router.policies import LoadTracker, RoundRobin
from router.ports import free_port
from router.state.backends import BackendSet
from router.state.probing import HealthProber
from tests.support.http_backends import (
    FakeEngine,
    engine_factory,
    router_factory,
    workers_fixture,  # noqa: F401 (the fixture)
)

CHAT = "/v1/chat/completions"
ROOT = Path(__file__).resolve().parents[2]


# --- admin surface, health, RouterConfig, secrets ---


@dataclass
class CountingEngine(FakeEngine):
    """A FakeEngine that counts the ``GET /health`` probes it receives."""

    health_hits: int = 0
    wedged: bool = False  # GET /health never answers

    async def health(self, request: web.Request) -> web.Response:
        self.health_hits += 1
        if self.wedged:
            await asyncio.sleep(3600)
        return await super().health(request)


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[list[FakeEngine]]]]:
    async with engine_factory(CountingEngine, 1) as make:
        yield make


@pytest.fixture
def routers(workers: int) -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", workers=workers) as make:
        yield make


async def call(method: str, url: str, token: str | None = None, **kwargs: object) -> tuple[int, object]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, headers=headers, **kwargs) as r:  # type: ignore[arg-type]
            body = await r.read()
            return r.status, orjson.loads(body) if body else None


async def wait_for(check: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> float:
    """Seconds until ``check()`` held; fails the test after ``timeout_s``."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() - t0 < timeout_s, "condition not reached in time"
        await asyncio.sleep(step_s)
    return time.monotonic() - t0


# -- item 1: the admin surface ------------------------------------------------------------------------


async def test_workers_take_the_api_key_when_no_admin_token(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([], api_key="client-key")
    base = r.base_url()
    body = {"url": e.api_url}
    assert (await call("GET", base + "/workers"))[0] == 401
    assert (await call("POST", base + "/workers", json=body))[0] == 401
    assert (await call("DELETE", base + "/workers/" + quote(e.url, safe="")))[0] == 401
    assert r.serving_backends() == []
    assert (await call("POST", base + "/workers", "client-key", json=body))[0] == 200
    assert r.serving_backends() == [e.url]
    assert (await call("DELETE", base + "/workers/" + quote(e.url, safe=""), "client-key"))[0] == 200
    assert r.serving_backends() == []


async def test_admin_token_set_means_the_client_key_is_not_enough(engines, routers) -> None:
    """Kept behaviour, the counterpart of the API-key fallback: with an admin token, the client key
    (which every rollout worker holds) cannot touch /workers."""
    (e,) = await engines(1)
    r = routers([e.api_url], api_key="client-key", admin_token="admin-key")
    assert (await call("DELETE", r.base_url() + "/workers/" + quote(e.url, safe=""), "client-key"))[0] == 401
    assert r.serving_backends() == [e.url]


def test_open_admin_is_refused_on_every_address_unless_insecure_admin(caplog) -> None:
    """Issue 17 reversed the loopback exception: 127.0.0.1 is every local user of a shared node, so a
    router with neither an admin token nor an API key refuses to start there too (it used to start
    with /workers and /fleet/* open and a warning)."""
    with pytest.raises(ValidationError, match="--insecure-admin"):
        RouterConfig(host="0.0.0.0")
    with pytest.raises(ValidationError, match="--insecure-admin"):
        RouterConfig(host="10.1.2.3", backend_api_key="engine-key")  # an engine key guards nothing here
    assert RouterConfig(host="0.0.0.0", api_key="k").admin_secret == "k"
    assert RouterConfig(host="0.0.0.0", insecure_admin=True).admin_secret is None
    result = CliRunner().invoke(router_command, ["--host", "0.0.0.0", "--port", "0"])
    assert result.exit_code == 1 and "--insecure-admin" in result.output
    # Loopback without any token: refused as well, in one line naming the three flags.
    for host in ("127.0.0.1", "localhost", "::1"):
        with pytest.raises(ValidationError, match="--admin-token-file or --api-key-file"):
            RouterConfig(host=host)
    result = CliRunner().invoke(router_command, ["--host", "127.0.0.1", "--port", "0"])
    assert result.exit_code == 1
    (line,) = [ln for ln in result.output.splitlines() if "--insecure-admin" in ln]
    assert "--admin-token-file" in line and "--api-key-file" in line and "127.0.0.1" in line
    assert RouterConfig(host="127.0.0.1", admin_token="a").admin_secret == "a"
    # With --insecure-admin it starts, and says in the log that the admin routes are open.
    with caplog.at_level(logging.WARNING, logger="router.server"):
        r = GenerationRouter(RouterConfig(host="127.0.0.1", insecure_admin=True))
        r.stop()
    assert any("admin routes" in m and "open" in m for m in caplog.messages)


async def test_registration_stops_probing_when_its_caller_disconnects(engines, routers) -> None:
    (e,) = await engines(1)
    e.healthy = False  # never becomes healthy: POST /workers would wait worker_health_timeout_s
    r = routers([], probe_interval_s=0)
    port = int(r.base_url().rsplit(":", 1)[1])
    body = orjson.dumps({"url": e.api_url})
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /workers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    await wait_for(lambda: e.health_hits >= 2, 5)  # the registration is probing
    writer.close()
    await writer.wait_closed()
    await asyncio.sleep(1.0)  # disconnect noticed (poll 0.2 s) and the loop cancelled
    hits = e.health_hits
    await asyncio.sleep(1.5)  # three probe intervals (0.5 s) later: not one more probe
    assert e.health_hits == hits
    assert (await call("GET", r.base_url() + "/workers"))[1]["workers"] == []  # type: ignore[index]


async def test_pending_registrations_are_capped_and_shared_per_url(engines, routers) -> None:
    a, b = await engines(2)
    a.healthy = b.healthy = False
    r = routers([], probe_interval_s=0, max_pending_registrations=1)
    url = r.base_url() + "/workers"
    first = asyncio.create_task(call("POST", url, json={"url": a.api_url}))
    await wait_for(lambda: a.health_hits >= 1, 5)
    # Another URL while one is pending: refused at the cap (no new outbound probe loop).
    status, payload = await call("POST", url, json={"url": b.api_url})
    assert status == 429 and payload["code"] == "ADD_WORKER_FAILED"  # type: ignore[index]
    assert b.health_hits == 0
    # The same URL joins the pending registration instead of starting a second loop.
    second = asyncio.create_task(call("POST", url, json={"url": a.url}))
    await asyncio.sleep(0.3)
    before = a.health_hits
    await asyncio.sleep(1.5)
    assert a.health_hits - before <= 4  # one loop at 0.5 s (3 probes), not two (6)
    a.healthy = True
    (s1, p1), (s2, p2) = await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert (s1, s2) == (200, 200), (p1, p2)
    assert r.serving_backends() == [a.url]


async def test_delete_worker_decodes_the_url_exactly_once(routers) -> None:
    registered = "http://127.0.0.1:9/prefix%41"  # a literal %41 in the path, not the letter A
    r = routers([registered], probe_interval_s=0)
    status, _ = await call("DELETE", r.base_url() + "/workers/" + quote(registered, safe=""))
    assert status == 200  # decoded twice it became .../prefixA and was "not registered"
    assert r.serving_backends() == []


async def test_non_utf8_authorization_is_401_not_500(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url], api_key="client-key", admin_token="admin-key")
    port = int(r.base_url().rsplit(":", 1)[1])
    for path in (b"/v1/models", b"/workers"):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\x80k\r\n\r\n")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        writer.close()
        assert status_line.split()[1] == b"401", status_line


# -- item 4: health by default when standalone ---------------------------------------------------------


async def test_standalone_defaults_answer_no_healthy_within_10s_of_the_last_engine_dying(
    engines, workers: int
) -> None:
    a, b = await engines(2)
    # The CLI's defaults: probing on (the admin routes are not what this test is about).
    config = RouterConfig(policy="round_robin", workers=workers, insecure_admin=True)
    assert config.probing
    r = GenerationRouter(config, [a.api_url, b.api_url])
    r.serve_in_background()
    try:
        assert (await call("POST", r.base_url() + CHAT, json={}))[0] == 200
        await a.stop()
        await b.stop()
        t0 = time.monotonic()
        while True:
            status, _ = await call("POST", r.base_url() + CHAT, json={})
            if status == 409:
                break
            assert status == 500
            assert time.monotonic() - t0 < 10.0, "still routing to dead engines after 10 s"
            await asyncio.sleep(0.5)
        assert (await call("GET", r.base_url() + "/readiness"))[0] == 503
    finally:
        r.stop()


async def test_standalone_defaults_eject_a_wedged_engine_within_10s(engines, workers: int) -> None:
    """A wedged engine accepts connections and never answers: only the probe timeout can see it."""
    (e,) = await engines(1)
    r = GenerationRouter(RouterConfig(workers=workers, insecure_admin=True), [e.api_url])
    r.serve_in_background()
    try:
        await wait_for(lambda: e.health_hits >= 1, 5)
        e.wedged = True
        elapsed = await wait_for(lambda: r.serving_backends() == [], 10.0, step_s=0.2)
        assert elapsed > 2.0  # it took failed probes, not one
        assert (await call("POST", r.base_url() + CHAT, json={}))[0] == 409
    finally:
        r.stop()


async def test_passive_failures_eject_before_the_next_probe(engines, routers) -> None:
    good, bad = await engines(2)
    bad.mode, bad.status = "status", 500  # /health says fine, every proxied attempt fails
    r = routers([good.api_url, bad.api_url], probe_interval_s=60, max_attempts=1)
    await wait_for(lambda: bad.health_hits >= 1, 5)  # the first probe round passed
    for _ in range(6):  # round robin: three failures on bad
        await call("POST", r.base_url() + CHAT, json={})
    assert r.serving_backends() == [good.url]
    _, payload = await call("GET", r.base_url() + "/workers")
    assert {w["url"]: w["healthy"] for w in payload["workers"]} == {good.url: True, bad.url: False}  # type: ignore[index]


def test_prober_ejects_after_n_failures_and_readmits_after_m_successes() -> None:
    backends = BackendSet(RoundRobin(), LoadTracker())
    backends.replace(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    p = HealthProber(backends, lambda: None, 1.0, failures_to_eject=3, successes_to_readmit=2)  # type: ignore[arg-type]
    a = "http://127.0.0.1:1"
    p.observe(a, False)
    p.observe(a, False)
    p.observe(a, True)  # a success breaks the streak
    p.observe(a, False)
    p.observe(a, False)
    assert a in backends.serving
    backends.record(a, ok=False)  # a proxied attempt counts as the third
    assert a not in backends.serving and a in backends.members
    p.observe(a, True)
    assert a not in backends.serving  # one lucky probe is not enough
    p.observe(a, False)
    p.observe(a, True)
    assert a not in backends.serving
    p.observe(a, True)
    assert backends.serving == ("http://127.0.0.1:1", "http://127.0.0.1:2")  # back, in member order


async def test_health_managed_router_never_probes(engines, routers) -> None:
    (e,) = await engines(1)
    r = routers([e.api_url], health_managed=True, probe_interval_s=0.1)
    assert not r.config.probing
    await asyncio.sleep(0.6)
    assert e.health_hits == 0
    (e2,) = await engines(1)
    routers([e2.api_url], probe_interval_s=0.1)
    await wait_for(lambda: e2.health_hits >= 3, 3)


def _start_cli_router(
    args: list[str], env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str, list[str]]:
    """``rl-launch router --port 0 ARGS`` in a child process; returns it, its base URL and the stderr
    lines up to "router serving"."""
    full_env = {**os.environ, **(env or {})}
    for var in ("RL_ROUTER_API_KEY", "RL_ROUTER_ADMIN_TOKEN", "RL_ROUTER_BACKEND_API_KEY"):
        if env is None or var not in env:
            full_env.pop(var, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "router", "--port", "0", *args],
        cwd=ROOT,
        env=full_env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: list[str] = []
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("router serving "):
            url = line.split()[2].removesuffix("/v1")
            return proc, url, lines
    proc.kill()
    proc.wait()
    raise AssertionError("router did not start:\n" + "".join(lines))


def _stop(proc: subprocess.Popen[str]) -> str:
    proc.terminate()
    try:
        _, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""


async def test_cli_without_backends_is_unready_and_says_so_loudly(engines, workers: int) -> None:
    (e,) = await engines(1)
    # --insecure-admin: this test registers a worker without a token (the admin surface has its own).
    args = ["--workers", str(workers), "--insecure-admin"]
    proc, url, lines = await asyncio.to_thread(_start_cli_router, args)
    try:
        assert any("WARNING" in ln and "no backends" in ln for ln in lines), lines
        assert (await call("GET", url + "/readiness"))[0] == 503
        assert (await call("POST", url + "/workers", json={"url": e.api_url}))[0] == 200
        assert (await call("GET", url + "/readiness"))[0] == 200
    finally:
        await asyncio.to_thread(_stop, proc)


# -- item 6: one RouterConfig ----------------------------------------------------------------------------


def test_router_config_import_is_light() -> None:
    code = (
        "import sys, router.config, router.policies\n"
        "heavy = sorted(m for m in sys.modules\n"
        "               if m.split('.')[0] in ('aiohttp', 'ray') or m == 'router.server')\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_policy_options_are_checked_against_the_policy_and_name_the_key() -> None:
    cases = {
        "load_slak": (1, "not an option of policy 'cache_aware'"),
        "load_slack": (0, "load_slack must be >= 1"),
        "block_bytes": ("big", "valid integer"),
    }
    for key, (value, words) in cases.items():
        with pytest.raises(ValidationError) as info:
            RouterSettings(policy_options={key: value})
        (err,) = info.value.errors()
        assert err["loc"] == ("policy_options", key)
        line = describe_errors(info.value, "router.")
        assert line.startswith(f"router.policy_options.{key}: ") and words in line, line
    ok = RouterSettings(policy="consistent_hash", policy_options={"session_header": "X-Session"})
    assert ok.policy_options == {"session_header": "X-Session"}
    with pytest.raises(ValidationError, match="session_header"):
        RouterSettings(policy="round_robin", policy_options={"session_header": "X-Session"})


def test_secrets_never_in_dumps_or_repr_but_travel_in_a_pickle() -> None:
    c = RouterConfig(api_key="s3cret-client", admin_token="s3cret-admin", backend_api_key="s3cret-engine")
    for text in (repr(c), str(c), c.model_dump_json(), str(c.model_dump())):
        assert "s3cret" not in text
    with pytest.raises(ValidationError) as info:  # an error's text quotes no input, so no secret
        RouterConfig(host="0.0.0.0", backend_api_key="s3cret-engine", port=-1)
    assert "s3cret" not in str(info.value) and "s3cret" not in describe_errors(info.value)
    again = pickle.loads(pickle.dumps(c))  # what Ray does to the actor's argument
    assert again.secret("api_key") == "s3cret-client"
    assert again.admin_secret == "s3cret-admin"
    assert again.secret("backend_api_key") == "s3cret-engine"


def test_from_settings_builds_the_actor_config_for_a_job() -> None:
    class SpecRouter(RouterSettings):  # how a spec section extends the shared settings
        port_range: tuple[int, int] = (20000, 20999)

    section = SpecRouter(policy="least_outstanding", max_attempts=3, port_range=(21000, 21010))
    c = RouterConfig.from_settings(
        section, host="10.0.0.5", port=21003, api_key="k", admin_token="a", health_managed=True
    )
    assert (c.policy, c.max_attempts, c.host, c.port) == ("least_outstanding", 3, "10.0.0.5", 21003)
    assert c.health_managed and not c.probing
    with pytest.raises(ValidationError, match="insecure-admin"):
        RouterConfig.from_settings(section, host="10.0.0.5", port=21003)


def test_cli_errors_come_from_router_config() -> None:
    runner = CliRunner()
    result = runner.invoke(
        router_command,
        ["--backend-timeout-s", "-1", "--no-healthy-backend-status", "503", "--policy", "fastest"],
    )
    assert result.exit_code == 1
    for words in ("backend_timeout_s", "no_healthy_backend_status=503", "unknown routing policy 'fastest'"):
        assert words in result.output
    result = runner.invoke(router_command, ["--options-json", '{"policy_options": {"load_slak": 4}}'])
    assert result.exit_code == 1 and "policy_options.load_slak" in result.output
    result = runner.invoke(router_command, ["--options-json", '{"api_key": "x"}'])
    assert result.exit_code == 2 and "--api-key-file" in result.output


# -- item 7: secrets from files or the environment --------------------------------------------------------


def test_router_help_shows_the_secret_and_admin_flags() -> None:
    out = CliRunner().invoke(router_command, ["--help"]).output
    for flag in (
        "--api-key-file",
        "--admin-token-file",
        "--backend-api-key-file",
        "--insecure-admin",
        "--probe-interval-s",
        "--probe-timeout-s",
        "RL_ROUTER_API_KEY",
    ):
        assert flag in out, flag


def test_secret_files_that_cannot_be_used_give_one_line_naming_flag_and_file(tmp_path: Path) -> None:
    runner = CliRunner()
    missing = tmp_path / "nope"
    result = runner.invoke(router_command, ["--api-key-file", str(missing)])
    assert result.exit_code == 1
    assert f"--api-key-file {missing}: cannot read it" in result.output
    assert len(result.output.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    result = runner.invoke(router_command, ["--admin-token-file", str(empty)])
    assert result.exit_code == 1 and f"--admin-token-file {empty}: the file is empty" in result.output
    key = tmp_path / "key"
    key.write_text("k\n")
    result = runner.invoke(router_command, ["--api-key-file", str(key)], env={"RL_ROUTER_API_KEY": "k2"})
    assert result.exit_code == 1 and "keep only --api-key-file" in result.output


async def test_secrets_from_file_and_env_work_and_a_flag_warns(engines, tmp_path: Path, workers: int) -> None:
    (e,) = await engines(1)
    admin_file = tmp_path / "admin"
    admin_file.write_text("file-admin-token\n")
    admin_file.chmod(0o644)
    key_file = tmp_path / "key"
    key_file.write_text("file-client-key")
    key_file.chmod(0o600)
    args = ["--host", "127.0.0.1", "--backend", e.api_url, "--admin-token-file", str(admin_file)]
    args += ["--api-key-file", str(key_file), "--workers", str(workers)]
    proc, url, lines = await asyncio.to_thread(
        _start_cli_router, args, {"RL_ROUTER_BACKEND_API_KEY": "env-engine-key"}
    )
    try:
        head = "".join(lines)
        assert "readable by group or others" in head and str(admin_file) in head
        assert "visible" not in head  # nothing came from a flag
        assert (await call("GET", url + "/workers", "file-client-key"))[0] == 401
        assert (await call("GET", url + "/workers", "file-admin-token"))[0] == 200
        assert (await call("POST", url + CHAT, "file-client-key", json={}))[0] == 200
        assert e.requests[-1][2]["Authorization"] == "Bearer env-engine-key"
    finally:
        err = head + await asyncio.to_thread(_stop, proc)
    for secret in ("file-admin-token", "file-client-key", "env-engine-key"):
        assert secret not in err  # never logged

    proc, url, lines = await asyncio.to_thread(
        _start_cli_router, ["--api-key", "flag-key", "--workers", str(workers)]
    )
    try:
        head = "".join(lines)
        assert "--api-key on the command line is visible" in head and "--api-key-file" in head
        assert (await call("GET", url + "/workers", "flag-key"))[0] == 200
    finally:
        err = head + await asyncio.to_thread(_stop, proc)
    assert "flag-key" not in err


def test_actor_takes_one_config_and_keeps_its_port(workers: int) -> None:
    from router.actor import GenerationRouterActor

    port = free_port()
    with pytest.raises(ValueError, match="fixed port"):
        GenerationRouterActor(RouterConfig(admin_token="a"), [])
    config = RouterConfig(port=port, health_managed=True, workers=workers, admin_token="a")
    actor = GenerationRouterActor(config, ["http://127.0.0.1:9/v1"])
    try:
        assert actor.base_url() == f"http://127.0.0.1:{port}"
        assert actor.serving_backends() == ["http://127.0.0.1:9"]
    finally:
        actor.stop()


# -- issue 17: no way in without the job's secrets (the admin surface) --------------------------------------
ADMIN = "admin-key"


async def debug_handler(request: web.Request) -> web.Response:
    return web.json_response({"debug": "served"})


class RouterWithDebugRoutes(GenerationRouter):
    """A router whose author added two routes: one straight on aiohttp's router (no access mark), one
    through the route table as an admin route."""

    def __init__(self, *args: object, unmarked: bool = True, **kwargs: object) -> None:
        self.unmarked = unmarked
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _admin_routes(self, table) -> None:  # type: ignore[no-untyped-def]
        app = getattr(table, "app", table)  # before issue 17 this received the application itself
        if self.unmarked:
            app.router.add_get("/debug/unmarked", debug_handler)
        if hasattr(table, "add"):
            from router.http.auth import Access

            table.add("GET", "/debug/admin", debug_handler, Access.ADMIN)
        super()._admin_routes(table)


async def test_a_route_registered_without_a_mark_is_never_served(engines, workers: int) -> None:
    """Issue 17: admin routes were decided by a path-prefix list, so a route outside it was open. Now a
    route carries its access mark from registration, and the router refuses to start with a route
    registered without one (naming it); the workers relay exactly what the router process marked admin,
    which takes the admin token."""
    (e,) = await engines(1)
    config = RouterConfig(admin_token=ADMIN, probe_interval_s=0, workers=workers)
    r = RouterWithDebugRoutes(config, [e.api_url])
    try:
        r.serve_in_background()
    except RuntimeError as exc:
        assert "GET /debug/unmarked" in str(exc)
    else:
        answer = await call("GET", r.base_url() + "/debug/unmarked")
        r.stop()
        pytest.fail(f"the router started with an unmarked route, which answered {answer} without a token")
    r = RouterWithDebugRoutes(config, [e.api_url], unmarked=False)
    r.serve_in_background()
    try:
        base = r.base_url()
        assert (await call("GET", base + "/debug/admin"))[0] == 401
        assert (await call("GET", base + "/debug/admin", "client-key"))[0] == 401
        assert await call("GET", base + "/debug/admin", ADMIN) == (200, {"debug": "served"})
        assert (await call("GET", base + "/health"))[0] == 200
    finally:
        r.stop()


def test_route_table_takes_only_access_marks() -> None:
    from router.http.auth import RouteTable

    table = RouteTable(web.Application())
    with pytest.raises(TypeError, match="access must be an Access"):
        table.add("GET", "/x", debug_handler, "admin")  # type: ignore[arg-type]


def test_cli_on_loopback_without_any_secret_refuses_to_start() -> None:
    """Issue 17: on 127.0.0.1 the router used to start with /workers and /fleet/* open to every local
    user (and only warn). Now it refuses, in one line naming the flags; bounded: a router that starts is
    stopped and fails the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_ROUTER_")}
    cmd = [sys.executable, "-m", "launcher.cli", "router", "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the router started without any secret on 127.0.0.1:\n{err}") from None
    assert proc.returncode == 1, err
    (line,) = [ln for ln in err.splitlines() if "--insecure-admin" in ln]
    assert "--admin-token-file" in line and "--api-key-file" in line, err
    assert "router serving" not in err


@dataclass
class KeyedEngine(FakeEngine):
    """An engine that takes the job's key on every route but /health (what vLLM and the simulator now
    enforce), serving vLLM counters on /metrics; ``redirect_metrics``: /metrics answers a 302 instead."""

    key: str = "engine-key"
    redirect_metrics: str = ""
    unkeyed: list[str] = field(default_factory=list)
    metrics_reads: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            self.unkeyed.append(f"{request.method} {request.path}")
            return web.Response(status=401)
        if request.path == "/metrics":
            self.metrics_reads += 1
            if self.redirect_metrics:
                return web.Response(status=302, headers={"Location": self.redirect_metrics})
            text = '# TYPE vllm:prompt_tokens counter\nvllm:prompt_tokens_total{model_name="m"} 42.0\n'
            return web.Response(text=text, content_type="text/plain")
        return await super().handle(request)


async def test_every_fleet_call_to_an_engine_carries_the_engine_key(routers) -> None:
    """Issue 17: engines will take the job's key on every route but /health; the step counters were read
    from /metrics without it (so /fleet/counters and /fleet/step would fail). Every /fleet/* call must
    send it, and a redirect is never followed (here one engine redirects /metrics to the other)."""
    async with engine_factory(KeyedEngine, 1) as make:
        (keyed,) = await make(1)
        (redirecting,) = await make(1)
        redirecting.redirect_metrics = keyed.url + "/metrics"
        engines = [keyed.api_url, redirecting.api_url]
        r = routers(engines, admin_token=ADMIN, backend_api_key="engine-key", probe_interval_s=0)
        base = r.base_url()
        status, counters = await call("GET", base + "/fleet/counters", ADMIN)
        assert status == 500, counters
        assert counters["errors"] == {redirecting.url: "HTTP 302"}  # type: ignore[index]
        assert counters["engines"][keyed.url] == {"prompt_tokens": 42}  # type: ignore[index]
        assert keyed.metrics_reads == 1  # the redirect to it was not followed
        for method, path in (
            ("POST", "/fleet/step/begin"),
            ("GET", "/fleet/step"),
            ("POST", "/fleet/pause"),
            ("GET", "/fleet/is_paused"),
            ("POST", "/fleet/resume"),
            ("GET", "/fleet/weight_version"),
            ("POST", "/fleet/checksum"),
            ("POST", "/fleet/abort"),
            ("POST", "/fleet/reset_prefix_cache"),
        ):
            await call(method, base + path, ADMIN)
        seen = {p for e in (keyed, redirecting) for _, p, _ in e.requests}
        assert {"/pause", "/resume", "/is_paused", "/weight_info", "/reset_prefix_cache"} <= seen
        assert keyed.unkeyed == [] and redirecting.unkeyed == []
