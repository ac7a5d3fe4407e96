"""Tests of ``rl-launch bench replay``: workloads, the Gym-like client, arms, reports and the CLI.

The client is tested against tiny aiohttp engines of our own, run on a background thread (so both async
tests and the synchronous CLI can talk to them), on OS-chosen 127.0.0.1 ports. The end-to-end test uses
the real simulator fleet and router and skips while either is missing.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pytest
from click.testing import CliRunner

from launcher.bench.arms import DIRECT, run_direct, run_url, validate_arms
from launcher.bench.client import ClientConfig, ReplayClient, RetryPolicy, gym_pin
from launcher.bench.metrics import parse_prometheus
from launcher.bench.report import (
    REQUIRED_KEYS,
    load_stats,
    summarize,
    time_to_fraction,
    write_csv,
    write_json,
    write_png,
)
from launcher.bench.trace import (
    TEMPLATE_TOKENS_PER_TURN,
    Session,
    Trace,
    Turn,
    load_trace,
    save_trace,
    trace_stats,
)
from launcher.bench.workload import MAX_CONTEXT_TOKENS, generate
from launcher.cli.bench import bench_group
from router.ports import free_port
from tests.support.tiny_engines import TinyEngine, TinyFleet

FAST_RETRY = RetryPolicy(attempts=3, delay_s=0.05)


@pytest.fixture
def one_engine() -> Iterator[TinyEngine]:
    e = TinyEngine("e0")
    with TinyFleet([e]):
        yield e


def tiny_trace(n_sessions: int = 3, turns: int = 3, group_size: int = 1) -> Trace:
    """A hand-made trace: short texts so the client tests are about behaviour, not volume."""
    sessions = [
        Session(
            id=f"s{i}",
            group=i // group_size,
            system="sys0",
            task=f"task {i // group_size}",
            turns=[Turn("" if k == 0 else f"tool out {i}.{k}", 8) for k in range(turns)],
        )
        for i in range(n_sessions)
    ]
    return Trace("tiny", 0, 1.0, group_size, {"sys0": "SYSTEM PROMPT"}, sessions)


def closed_port() -> int:
    """A port nothing listens on (bound by us a moment ago and released): connections are refused."""
    return free_port()


# ----------------------------------------------------------------------------------------------------
# Workloads
# ----------------------------------------------------------------------------------------------------
def test_p30_all_turn_distribution_at_scale_1() -> None:
    trace = generate("p30_all", seed=1, scale=1.0)
    turns = np.array([len(s.turns) for s in trace.sessions])
    assert len(trace.sessions) == 610
    assert turns.min() == 5 and turns.max() == 99
    assert abs(np.percentile(turns, 50) - 29) <= 2
    assert abs(np.percentile(turns, 90) - 56) <= 3
    assert abs(np.percentile(turns, 99) - 85) <= 5


@pytest.mark.parametrize("seed", [1, 7])
def test_longtail_short_sessions_carry_44_percent_of_work(seed: int) -> None:
    trace = generate("longtail", seed=seed, scale=1.0)
    short = [s for s in trace.sessions if s.id.endswith("-short")]
    long_ = [s for s in trace.sessions if s.id.endswith("-long")]
    assert (len(short), len(long_)) == (540, 60)
    assert all(8 <= len(s.turns) <= 20 for s in short)
    assert all(27 <= len(s.turns) <= 95 for s in long_)
    assert {min(len(s.turns) for s in long_), max(len(s.turns) for s in long_)} == {27, 95}
    assert abs(trace_stats(trace)["short_work_share"] - 0.44) < 0.02


def test_generation_is_deterministic_and_scale_shrinks_it() -> None:
    a = generate("longtail", seed=3, scale=0.1, group_size=2)
    b = generate("longtail", seed=3, scale=0.1, group_size=2)
    c = generate("longtail", seed=4, scale=0.1, group_size=2)
    assert a.fingerprint() == b.fingerprint() and a.sessions == b.sessions
    assert a.fingerprint() != c.fingerprint()
    full = trace_stats(generate("longtail", seed=3, scale=1.0))
    small = trace_stats(a)
    assert small["sessions"] == 60 and full["sessions"] == 600
    assert small["system_prompt_tokens"] * 10 == full["system_prompt_tokens"]
    assert small["tool_tokens_p50"] < full["tool_tokens_p50"] / 5


def test_system_prompt_is_several_kb_of_tool_schemas_and_context_fits() -> None:
    trace = generate("p30_all", seed=2, scale=1.0)
    system = trace.system_prompts["sys0"]
    assert len(system) > 4000 and '"type": "function"' in system
    for s in trace.sessions:
        last_prompt = (len(system) + len(s.task) + sum(len(t.tool_output) for t in s.turns)) // 4
        last_prompt += sum(t.max_tokens + TEMPLATE_TOKENS_PER_TURN for t in s.turns)
        assert last_prompt <= MAX_CONTEXT_TOKENS


def test_grpo_groups_share_an_identical_first_turn() -> None:
    trace = generate("p30_all", seed=5, scale=0.1, group_size=4)
    groups: dict[int, list[Session]] = {}
    for s in trace.sessions:
        groups.setdefault(s.group, []).append(s)
    assert all(len(m) == 4 for m in list(groups.values())[:-1])
    for members in groups.values():
        assert len({(m.system, m.task, m.turns[0]) for m in members}) == 1
        assert len({tuple(t.tool_output for t in m.turns[1:3]) for m in members}) == len(members)
    assert len({m[0].task for m in groups.values()}) == len(groups)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_jsonl_round_trip_stores_system_prompt_once(tmp_path: Path, suffix: str) -> None:
    trace = generate("longtail", seed=2, scale=0.05, group_size=3)
    path = save_trace(trace, tmp_path / f"t{suffix}")
    back = load_trace(path)
    assert back.sessions == trace.sessions and back.system_prompts == trace.system_prompts
    assert back.fingerprint() == trace.fingerprint()
    raw = gzip.decompress(path.read_bytes()) if suffix.endswith(".gz") else path.read_bytes()
    assert raw.count(trace.system_prompts["sys0"][:200].encode()) == 1
    assert len(raw.splitlines()) == 1 + len(trace.sessions)


# ----------------------------------------------------------------------------------------------------
# The client
# ----------------------------------------------------------------------------------------------------
async def test_client_resends_growing_context_with_gym_fields(one_engine: TinyEngine) -> None:
    trace = tiny_trace(n_sessions=1, turns=3)
    result = await ReplayClient([one_engine.url + "/v1"], ClientConfig(model="tiny-model")).run(trace)
    assert result.errors == 0 and result.sessions[0].turns_done == 3
    bodies = one_engine.bodies
    assert [len(b["messages"]) for b in bodies] == [2, 4, 6]
    assert bodies[2]["messages"][2] == {"role": "assistant", "content": "e0 reply 1"}
    assert bodies[2]["messages"][3] == {"role": "user", "content": "tool out 0.1"}
    assert bodies[2]["messages"][4] == {"role": "assistant", "content": "e0 reply 2"}
    for b in bodies:
        assert b["logprobs"] is True and b["top_logprobs"] == 0 and b["return_tokens_as_token_ids"] is True
        assert b["max_tokens"] == 8 and b["model"] == "tiny-model"
    assert all("X-Session-ID" not in h for h in one_engine.headers)


async def test_session_header_only_when_asked(one_engine: TinyEngine) -> None:
    cfg = ClientConfig(model="m", session_header=True)
    await ReplayClient([one_engine.url + "/v1"], cfg).run(tiny_trace(n_sessions=2, turns=1))
    assert sorted(h["X-Session-ID"] for h in one_engine.headers) == ["s0", "s1"]


async def test_retry_500_then_200_succeeds(one_engine: TinyEngine) -> None:
    one_engine.statuses = [500, 503]
    cfg = ClientConfig(model="m", retry=FAST_RETRY)
    result = await ReplayClient([one_engine.url + "/v1"], cfg).run(tiny_trace(n_sessions=1, turns=2))
    assert result.errors == 0
    assert [r.attempts for r in result.requests] == [3, 1]
    assert result.retries == 2 and len(one_engine.bodies) == 4


async def test_always_500_fails_after_three_attempts_half_a_second_apart(one_engine: TinyEngine) -> None:
    one_engine.always = 500
    t0 = time.monotonic()
    result = await ReplayClient([one_engine.url + "/v1"], ClientConfig(model="m")).run(tiny_trace(1, 3))
    elapsed = time.monotonic() - t0
    assert len(one_engine.bodies) == 3  # Gym 0.7.0: 3 attempts, then the rollout fails
    assert result.errors == 1 and not result.sessions[0].ok
    assert result.sessions[0].turns_done == 0 and "HTTP 500" in (result.sessions[0].error or "")
    assert 0.95 <= elapsed < 5.0  # two 0.5 s pauses


async def test_non_retryable_status_fails_at_once(one_engine: TinyEngine) -> None:
    one_engine.always = 400
    cfg = ClientConfig(model="m", retry=FAST_RETRY)
    result = await ReplayClient([one_engine.url + "/v1"], cfg).run(tiny_trace(1, 2))
    assert result.errors == 1 and len(one_engine.bodies) == 1


async def test_refused_connection_is_bounded() -> None:
    cfg = ClientConfig(model="m", retry=FAST_RETRY)
    t0 = time.monotonic()
    result = await ReplayClient([f"http://127.0.0.1:{closed_port()}/v1"], cfg).run(tiny_trace(2, 3))
    assert time.monotonic() - t0 < 5.0
    assert result.errors == 2
    assert all(r.attempts == 3 and r.status == 0 for r in result.requests)
    assert time_to_fraction(result.completion_times(), 2, 0.5) is None


async def test_max_concurrent_limits_sessions_in_flight() -> None:
    e = TinyEngine("e0", delay_s=0.02)
    with TinyFleet([e]):
        cfg = ClientConfig(model="m", max_concurrent=2)
        result = await ReplayClient([e.url + "/v1"], cfg).run(tiny_trace(6, 2))
    assert result.errors == 0 and result.peak_in_flight == 2 and e.peak == 2


async def test_all_sessions_start_together_by_default() -> None:
    e = TinyEngine("e0", delay_s=0.05)
    with TinyFleet([e]):
        result = await ReplayClient([e.url + "/v1"], ClientConfig(model="m")).run(tiny_trace(8, 1))
    assert result.peak_in_flight == 8


# ----------------------------------------------------------------------------------------------------
# Direct arm pinning, metrics, report
# ----------------------------------------------------------------------------------------------------
def test_gym_pin_formula() -> None:
    sid = "p30_all-1-00042-all"
    assert gym_pin(sid, 7) == int(hashlib.sha256(sid.encode()).hexdigest()[:8], 16) % 7
    counts = np.bincount([gym_pin(f"s{i}", 4) for i in range(4000)], minlength=4)
    assert counts.min() > 900  # spreads sessions, as Gym's pinning does


def test_direct_arm_pins_each_session_to_its_sha256_engine() -> None:
    engines = [TinyEngine(f"e{i}") for i in range(3)]
    trace = tiny_trace(12, 2)
    with TinyFleet(engines) as fleet:
        outcome = run_direct(trace, fleet.urls, ClientConfig(model="", retry=FAST_RETRY))
    by_engine = {e.name: [b["messages"][1]["content"] for b in e.bodies] for e in engines}
    for s in trace.sessions:
        assert s.task in by_engine[f"e{gym_pin(s.id, 3)}"]
    row = outcome.row
    assert row["arm"] == DIRECT and row["errors"] == 0 and row["sessions_ok"] == 12
    assert row["engine_requests"] == [len(e.bodies) for e in engines]
    assert row["engine_requests_source"] == "metrics" and row["hit_rate"] == 0.75
    assert engines[0].bodies[0]["model"] == "tiny-model"  # discovered from /v1/models


def test_url_arm_reads_engines_given() -> None:
    engines = [TinyEngine("e0"), TinyEngine("e1")]
    with TinyFleet(engines) as fleet:
        # A "router" that is just engine 0: the arm still reads both engines' counters.
        outcome = run_url(
            tiny_trace(3, 2), fleet.urls[0] + "/v1", ClientConfig(model="m"), engine_urls=fleet.urls
        )
    assert outcome.row["engine_requests"] == [6, 0] and outcome.row["load_cv"] == 1.0


def test_parse_prometheus_sums_label_sets_and_ignores_others() -> None:
    text = (
        "# HELP vllm:request_success_total x\n"
        'vllm:request_success_total{finished_reason="length",model_name="a b}"} 3\n'
        'vllm:request_success_total{finished_reason="stop"} 2 1700000000\n'
        'vllm:request_success_created{finished_reason="stop"} 1.7e9\n'
        "vllm:prefix_cache_hits_total 5.5\n"
    )
    assert parse_prometheus(text) == {"vllm:request_success_total": 5.0, "vllm:prefix_cache_hits_total": 5.5}


def test_time_to_fraction_and_load_stats() -> None:
    times = [1.0, 2.0, 3.0, 4.0]
    assert time_to_fraction(times, 4, 0.5) == 2.0
    assert time_to_fraction(times, 4, 0.9) == 4.0
    assert time_to_fraction(times, 5, 1.0) is None  # one session lost: never 100%
    cv, spread = load_stats([10, 10, 10, 30])
    assert spread == 3.0 and cv == pytest.approx(np.std([10, 10, 10, 30]) / 15)


def test_report_files_carry_required_keys(tmp_path: Path) -> None:
    engines = [TinyEngine("e0"), TinyEngine("e1")]
    with TinyFleet(engines) as fleet:
        outcome = run_direct(tiny_trace(4, 2), fleet.urls, ClientConfig(model="m"))
    rows = [outcome.row, {**outcome.row, "arm": "other"}]
    timelines = {"direct": outcome.timeline, "other": [t * 2 for t in outcome.timeline]}
    j = write_json(tmp_path / "r.json", rows, trace_stats={"workload": "tiny"}, timelines=timelines)
    c = write_csv(tmp_path / "r.csv", rows)
    p = write_png(tmp_path / "r.png", timelines, {"direct": 4, "other": 4}, "tiny")
    doc = json.loads(j.read_text())
    for row in doc["rows"]:
        assert set(REQUIRED_KEYS) <= set(row)
    assert doc["timelines"]["direct"] == sorted(doc["timelines"]["direct"])
    with c.open() as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["arm"] for r in csv_rows] == ["direct", "other"] and set(REQUIRED_KEYS) <= set(csv_rows[0])
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summarize_without_metrics_falls_back_to_client_counts() -> None:
    from launcher.bench.client import ReplayResult, SessionRecord

    res = ReplayResult(2.0, [SessionRecord("a", "u", 1, 1, 0.0, 2.0, True)], [], 1, 0.0)
    row = summarize("direct", res, [None, None], client_engine_counts=[3, 1])
    assert row["hit_rate"] is None and row["engine_requests"] == [3, 1]
    assert row["engine_requests_source"] == "client" and row["t100_s"] == 2.0


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------
def test_cli_trace_then_replay_direct_against_engines(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "trace.jsonl"
    res = runner.invoke(
        bench_group,
        ["trace", "--workload", "longtail", "--scale", "0.02", "--turn-scale", "0.2", "--out", str(out)],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["sessions"] == 12
    engines = [TinyEngine("e0"), TinyEngine("e1")]
    with TinyFleet(engines) as fleet:
        args = ["replay", "--trace", str(out), "-q", "--results-dir", str(tmp_path / "res")]
        args += [x for u in fleet.urls for x in ("--engine-url", u)]
        res = runner.invoke(bench_group, args)
    assert res.exit_code == 0, res.output
    files = sorted(p.suffix for p in (tmp_path / "res").iterdir())
    assert files == [".csv", ".json", ".png"]
    doc = json.loads(next((tmp_path / "res").glob("*.json")).read_text())
    assert doc["rows"][0]["arm"] == DIRECT and doc["rows"][0]["errors"] == 0
    assert doc["trace"]["fingerprint"] == load_trace(out).fingerprint()


def test_cli_rejects_unknown_arm_and_url_with_arms() -> None:
    runner = CliRunner()
    res = runner.invoke(bench_group, ["replay", "--compare", "direct", "nonsense", "-q"])
    assert res.exit_code != 0 and "nonsense" in res.output
    res = runner.invoke(bench_group, ["replay", "--url", "http://127.0.0.1:1", "--compare", "direct"])
    assert res.exit_code != 0
    with pytest.raises(ValueError):
        validate_arms(["direct", "bogus"])


def test_bench_is_registered_on_rl_launch() -> None:
    from launcher.cli.main import load_command

    assert load_command("bench") is bench_group  # commands load lazily (launcher.cli.main.COMMANDS)


# ----------------------------------------------------------------------------------------------------
# End to end: the real simulator fleet and router
# ----------------------------------------------------------------------------------------------------
def test_compare_end_to_end_on_sim_fleet_and_router(tmp_path: Path) -> None:
    from launcher.bench.arms import run_compare

    trace = generate("longtail", seed=1, scale=0.02, group_size=2, turn_scale=0.25)
    outcomes = run_compare(
        trace,
        ["direct", "cache_aware"],
        2,
        ClientConfig(max_wall_s=20.0, request_timeout_s=10.0, retry=FAST_RETRY),
        sim_options={"speed": 20.0},
    )
    n_req = trace.n_requests
    for o in outcomes:
        row = o.row
        assert row["errors"] == 0, (row, [s.error for s in o.result.sessions if s.error][:3])
        assert row["requests"] == n_req
        assert sum(row["engine_requests"]) == n_req and len(row["engine_requests"]) == 2
        assert row["hit_rate"] is not None and 0.3 < row["hit_rate"] <= 1.0
        assert row["t50_s"] <= row["t90_s"] <= row["t100_s"] <= row["wall_s"] + 1e-6
    doc = json.loads(write_json(tmp_path / "e2e.json", [o.row for o in outcomes]).read_text())
    assert [r["arm"] for r in doc["rows"]] == ["direct", "cache_aware"]
    assert orjson.dumps(doc)  # plain JSON types only


async def test_max_wall_cancels_and_counts_unfinished_sessions() -> None:
    e = TinyEngine("e0", delay_s=2.0)
    with TinyFleet([e]):
        cfg = ClientConfig(model="m", max_wall_s=0.3)
        t0 = time.monotonic()
        result = await ReplayClient([e.url + "/v1"], cfg).run(tiny_trace(3, 2))
        elapsed = time.monotonic() - t0
    assert elapsed < 3.0
    assert result.errors == 3 and all("max_wall_s" in (s.error or "") for s in result.sessions)


def test_url_arm_finds_engines_through_router_workers() -> None:
    from launcher.engines import sim  # the project's own simulator: a rename fails here, never skips
    from router import GenerationRouter, RouterConfig

    trace = generate("p30_all", seed=2, scale=0.01, turn_scale=0.1)
    with sim.SimFleet(2, speed=20.0) as fleet:
        # /workers open on purpose: the arm finds the engines there without a token
        config = RouterConfig(host="127.0.0.1", port=0, insecure_admin=True)
        router = GenerationRouter(config, [u + "/v1" for u in fleet.urls])
        router.serve_in_background()
        try:
            cfg = ClientConfig(max_wall_s=20.0, request_timeout_s=10.0, retry=FAST_RETRY)
            outcome = run_url(trace, router.base_url(), cfg, arm="mine")
        finally:
            router.stop()
    row = outcome.row
    assert row["arm"] == "mine" and row["errors"] == 0 and row["engines"] == 2
    assert sum(row["engine_requests"]) == trace.n_requests and row["hit_rate"] is not None
