"""The live dashboard (``rl-launch status``) at 80x24, 120x40 and 160x50: what the terminal shows keeps
the engine table (its header and rows with every id whole) and the last events, within the screen.

Before, at 80x24 the rollouts' "slowest sessions" list (8 rows) took the room and ``rich.live`` cut the
frame at the bottom to a "...": no engine row and no event was on screen. The frame is drawn here the way
the live view draws it (``launcher.cli.status._live``: the same call, then ``rich.live``'s cut).
"""

from __future__ import annotations

import io
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.live_render import LiveRender

from launcher.cli.status import live_frame

ENGINE_IDS = [f"node{n}-{i}" for n in range(3) for i in range(4)] + [
    "trainer-registered-gpu-node-017-rank-3",
    "trainer-registered-gpu-node-018-rank-11",
]


def snapshot() -> dict[str, Any]:
    """A running GRPO job on 14 engines (two registered by the trainer, with long ids), its rollouts'
    view with 8 slowest sessions, and 8 events: what a short terminal must still show the engines of."""
    now = time.time()
    engines = [
        {
            "id": eid,
            "node": f"gpu-node-{k // 4:03d}",
            "url": f"http://10.1.0.{k + 10}:8000",
            "state": "DEAD" if k == 5 else "HEALTHY",
            "restarts": 1 if k == 5 else 0,
            "last_reason": "3 failures in a row" if k == 5 else "",
            "reachable": k != 5,
            "error": "cannot connect (Connection refused)" if k == 5 else None,
            "in_rotation": k != 5,
            "in_flight": float(k % 5),
            "req_per_s": 2.5 + k,
            "error_rate": 0.0,
            "p50_s": 0.4,
            "prefix_hit_pct": 61.0,
            "kv_usage_pct": 33.0,
            "running": 3.0,
            "waiting": 0.0,
        }
        for k, eid in enumerate(ENGINE_IDS)
    ]
    slowest = [
        {
            "session": f"session-{i:04d}-of-the-step",
            "span_s": 40.0 - i,
            "turns": 6,
            "phases_s": {"held": 0.1, "first_byte": 1.2, "decode": 30.0, "between_turns": 2.0},
            "engines": ["http://10.1.0.10:8000/v1", "http://10.1.0.11:8000/v1"],
            "versions": ["3"],
            "failed": 0,
        }
        for i in range(8)
    ]
    return {
        "version": 1,
        "t": now,
        "job": {
            "name": "grpo-qwen3-8b-math-reasoning-local-20261205-030127-25329",
            "slurm_state": "local",
            "phase": "training",
            "nodes": {"training": ["gpu-node-000"], "generation": ["gpu-node-000", "gpu-node-001"]},
            "elapsed_s": 4000.0,
            "router_url": "http://127.0.0.1:20447",
            "policy": "cache_aware",
            "front": "router (cache_aware)",
            "engines": "14 vllm TP2",
        },
        "condition": "running",
        "message": "",
        "problems": [],
        "result": None,
        "router": {
            "reachable": True,
            "req_per_s": 30.0,
            "in_flight": 40.0,
            "p50_s": 0.5,
            "p99_s": 3.0,
            "latency_window": "interval",
            "http_500": 0.0,
            "no_backend": 0.0,
            "serving_backends": 13.0,
        },
        "engines": engines,
        "engine_source": "fleet",
        "summary": {"HEALTHY": 13, "DEAD": 1},
        "history": [20.0 + i % 7 for i in range(60)],
        "rollouts": {
            "start": now - 60,
            "end": now,
            "requests": 512,
            "sessions": 64,
            "slowest": slowest,
            "timeline": {
                "t90_s": 31.0,
                "tail_share": 0.4,
                "in_flight": [i % 13 for i in range(40)],
                "sessions_finished": list(range(40)),
            },
        },
        "events": [
            {"t": now - 100 + i, "phase": "engine_dead" if i == 7 else "refit", "detail": f"step {i}"}
            for i in range(8)
        ],
    }


def screen(snap: dict[str, Any], width: int, height: int) -> list[str]:
    """The lines a terminal of ``width`` x ``height`` shows of the live view's frame: ``rich.live`` draws
    it through a ``LiveRender``, which cuts a frame taller than the terminal to its first lines and
    "..."."""
    out = io.StringIO()
    console = Console(file=out, width=width, height=height, color_system=None)
    console.print(LiveRender(live_frame(snap, console)))
    lines = [line.rstrip() for line in out.getvalue().split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


@pytest.mark.parametrize(("width", "height"), [(80, 24), (120, 40), (160, 50)])
def test_frame_keeps_engines_and_events_on_screen(width: int, height: int) -> None:
    lines = screen(snapshot(), width, height)
    text = "\n".join(lines)
    assert len(lines) <= height, text
    assert all(len(line) <= width for line in lines), text
    assert "..." not in [line.strip() for line in lines], text  # rich.live's cut of a frame too tall
    header = next((line for line in lines if line.split()[:1] == ["id"]), None)
    assert header is not None and "state" in header.split(), text
    rows = [line for line in lines if line.split() and line.split()[0] in ENGINE_IDS]
    assert len(rows) >= 4, text
    assert any(" DEAD" in row for row in rows), text  # the troubled engine is kept first
    assert "last events" in text and "engine_dead" in text, text  # the newest event is shown


def test_a_tall_terminal_shows_everything() -> None:
    lines = screen(snapshot(), 160, 80)
    words = "\n".join(lines).split()
    assert all(eid in words for eid in ENGINE_IDS), lines
    assert sum("session-" in line for line in lines) == 8
    assert sum("step " in line for line in lines) == 8


def test_long_engine_ids_stay_whole_when_columns_are_dropped() -> None:
    lines = screen(snapshot(), 80, 60)
    rows = [line for line in lines if line.split() and line.split()[0] in ENGINE_IDS]
    assert {row.split()[0] for row in rows} == set(ENGINE_IDS), lines


@pytest.mark.parametrize("width", [80, 160])
def test_every_height_fits_and_uses_the_room(width: int) -> None:
    """The parts' heights are added up, not drawn for every candidate: the frame drawn whole still fits,
    and a terminal one line taller shows no less."""
    snap = snapshot()
    shown = 0
    for height in range(14, 70, 5):
        lines = screen(snap, width, height)
        assert len(lines) <= height and "..." not in [x.strip() for x in lines], (height, lines)
        assert len(lines) >= min(shown, height - 3), (height, lines)
        shown = len(lines)


def test_256_engines_on_a_short_terminal_keep_the_troubled_ones() -> None:
    snap = snapshot()
    engine = snap["engines"][0]
    snap["engines"] = [
        {**engine, "id": f"node{k // 8}-{k % 8}", "state": "DEAD" if k % 15 == 3 else "HEALTHY"}
        for k in range(256)
    ]
    lines = screen(snap, 80, 24)
    assert len(lines) <= 24 and "..." not in [x.strip() for x in lines], lines
    assert any("more engine(s) not shown" in x for x in lines) and "last events" in "\n".join(lines)
    rows = [x for x in lines if x.split() and x.split()[0].startswith("node")]
    assert rows and all(" DEAD " in x for x in rows), lines  # 18 dead ones: more than fit


def test_once_piped_honours_columns(tmp_path: Path) -> None:
    """``status --once | less`` drew 200 columns whatever ``COLUMNS`` said, as ``list`` did."""
    from click.testing import CliRunner

    from launcher.cli.main import main
    from launcher.jobdir import JobDir, JobResult, StateWriter

    job = JobDir(tmp_path / "jobs" / "grpo-qwen3-8b-math-reasoning-long-context-local-20261205-1").create()
    StateWriter(job).event(
        "finished", "training finished", front="router (cache_aware)", engines="14 vllm TP2"
    )
    job.write_result(JobResult(0, "training finished", "finished"))
    out = CliRunner().invoke(main, ["status", str(job.path), "--once"], env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    assert job.path.name in out.output and all(len(line) <= 80 for line in lines), out.output
