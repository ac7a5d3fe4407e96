"""The virtual-time replay: a jumping clock, the real scheduler and policies, deterministic figures."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from click.testing import CliRunner

from launcher.bench.trace import session_work
from launcher.bench.virtual import VirtualClockLoop, compare_virtual, oracle_placement, run_virtual_arm
from launcher.bench.workload import generate
from launcher.cli.main import main
from launcher.engines.sim.config import SimConfig


def test_clock_jumps_instead_of_sleeping() -> None:
    loop = VirtualClockLoop()

    async def nap() -> tuple[float, float]:
        t0 = loop.time()
        await asyncio.gather(asyncio.sleep(3600), asyncio.sleep(10))
        return t0, loop.time()

    try:
        wall0 = time.monotonic()
        t0, t1 = loop.run_until_complete(nap())
        assert time.monotonic() - wall0 < 1.0
        assert abs((t1 - t0) - 3600) < 1e-6
    finally:
        loop.close()


def test_a_second_turn_on_the_same_engine_hits_the_prefix_cache() -> None:
    trace = generate("longtail", seed=1, scale=0.05, turn_scale=0.3)
    direct = run_virtual_arm(trace, "direct", n_engines=2).row(len(trace.sessions))
    assert direct["errors"] == 0
    assert direct["hit_rate"] > 0.5  # sticky sessions reuse their context every turn
    assert direct["moves"] == 0
    assert sum(direct["engine_requests"]) == trace.n_requests
    # a cache-blind policy moves turns between engines and pays for it in hits
    rr = run_virtual_arm(trace, "round_robin", n_engines=2).row(len(trace.sessions))
    assert rr["moves"] > 0
    assert rr["hit_rate"] < direct["hit_rate"]


def test_same_inputs_same_figures_and_every_arm_finishes() -> None:
    trace = generate("longtail", seed=2, scale=0.05, turn_scale=0.3)
    arms = ["direct", "least_outstanding", "cache_aware"]
    a = compare_virtual(trace, arms, n_engines=4, config=SimConfig())
    b = compare_virtual(trace, arms, n_engines=4, config=SimConfig())
    assert a == b
    for row in a:
        assert row["errors"] == 0
        assert row["t50_s"] <= row["t90_s"] <= row["t100_s"] <= row["wall_s"] + 1e-9


def test_cli_prints_per_seed_rows_means_and_margins(tmp_path: Path) -> None:
    out = tmp_path / "v.json"
    args = ["bench", "virtual", "--workload", "longtail", "--scale", "0.05", "--turn-scale", "0.3"]
    args += ["--engines", "2", "--seeds", "1,2", "--compare", "direct", "cache_aware", "--json", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "mean over 2 trace(s)" in res.output
    assert "vs direct: t90" in res.output
    data = json.loads(out.read_text())
    assert [m["arm"] for m in data["means"]] == ["direct", "cache_aware"]
    assert len(data["runs"]["cache_aware"]) == 2
    bad = CliRunner().invoke(main, ["bench", "virtual", "--compare", "direct", "nope"])
    assert bad.exit_code != 0 and "unknown arm" in bad.output
    bad = CliRunner().invoke(main, ["bench", "virtual", "direct", "--sim-opt", "speed=0"])
    assert bad.exit_code != 0 and "--sim-opt" in bad.output
    # a bad policy option is refused before any replay runs, naming the option and the arm
    for opt in ("no_such_knob=1", "byte_load_factor=0.5"):
        bad = CliRunner().invoke(main, ["bench", "virtual", "direct", "cache_aware", "--policy-opt", opt])
        assert bad.exit_code == 2, bad.output
        assert "--policy-opt" in bad.output and "cache_aware" in bad.output
        assert "seed" not in bad.output  # no arm was replayed


def test_oracle_pins_sessions_to_balance_their_work() -> None:
    trace = generate("longtail", seed=3, scale=0.1)
    pins = oracle_placement(trace, 4)
    work = [0, 0, 0, 0]
    for s in trace.sessions:
        work[pins[s.id]] += session_work(trace, s)
    biggest = max(session_work(trace, s) for s in trace.sessions)
    assert max(work) - min(work) <= biggest  # longest-first greedy is within one session of even
    row = run_virtual_arm(trace, "oracle", n_engines=4).row(len(trace.sessions))
    assert row["moves"] == 0 and row["errors"] == 0
