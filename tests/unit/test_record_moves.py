"""A continued request's moves and weight-version spans are part of the request record's format
(``router.record.format``, the one module that owns the line's shape), survive a read, and show in the
rollouts view: the engines a turn moved between and the versions that made its tokens."""

from __future__ import annotations

import json

from launcher.record.view import rollouts_view
from router.record.format import RequestRecord

MOVES = [
    {"from": "http://127.0.0.1:1/v1", "to": "http://127.0.0.1:2/v1", "at_token": 40, "reason": "reset"},
]
SPANS = [["v3", 0, 39], ["v4", 40, 99]]


def _record(rid: str, t: float, **extra: object) -> RequestRecord:
    return RequestRecord(
        id=rid,
        t=t,
        path="/v1/completions",
        status=200,
        session="s1",
        engine="http://127.0.0.1:2/v1",
        duration_s=1.0,
        version="v4",
        **extra,  # type: ignore[arg-type]
    )


def test_moves_and_spans_survive_a_line_and_are_absent_when_not_continued() -> None:
    moved = _record("a", 1.0, moves=MOVES, weight_versions=SPANS)
    back = RequestRecord.from_json(json.loads(moved.line()))
    assert back.moves == MOVES and back.weight_versions == SPANS
    plain = json.loads(_record("b", 2.0).line())
    assert "moves" not in plain and "weight_versions" not in plain
    assert RequestRecord.from_json(plain).moves is None


def test_the_rollouts_view_shows_a_turn_s_move_and_its_versions() -> None:
    view = rollouts_view([_record("a", 1.0, moves=MOVES, weight_versions=SPANS)], now=3.0)
    assert view is not None
    (session,) = view["slowest"]
    assert session["engines"] == ["http://127.0.0.1:1/v1", "http://127.0.0.1:2/v1"]
    assert session["moves"] == 1 and session["continued"] == 1
    assert session["versions"] == ["v3", "v4"]
    plain = rollouts_view([_record("b", 1.0)], now=3.0)
    assert plain is not None and plain["slowest"][0]["engines"] == ["http://127.0.0.1:2/v1"]
    assert plain["slowest"][0]["continued"] == 0 and plain["slowest"][0]["versions"] == ["v4"]
