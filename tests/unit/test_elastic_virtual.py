"""launcher.bench.elastic_virtual: the tail policy's trade on a virtual clock (bench/elastic_tail.py
--virtual), drain waiting against drain moving."""

from __future__ import annotations

from launcher.bench.elastic_virtual import TailArm, compare_tail, run_tail_arm
from launcher.bench.workload import generate
from launcher.fleet.elastic.tail import TailSettings

SETTINGS = TailSettings(floor_nodes=1, shrink_below=0.25, for_s=5.0)


def test_a_moving_drain_gives_the_node_back_sooner_and_keeps_the_tokens() -> None:
    trace = generate("longtail", seed=1, scale=0.1)
    static, wait, move = compare_tail(
        trace, [TailArm("static"), TailArm("wait", SETTINGS), TailArm("move", SETTINGS, move=True)]
    )
    assert static["node_s"] == round(2 * static["wall_s"], 2) and static["released_at"] == [None, None]
    for arm in (wait, move):
        (decision,) = arm["decisions"]
        assert "shrink 1" in decision and arm["released_at"][0] is None  # the newest node goes back
    assert wait["moved"] == 0 and move["moved"] > 0 and move["moved_tokens"] > 0
    assert move["released_at"][1] < wait["released_at"][1]
    assert move["node_s"] < wait["node_s"] < static["node_s"]


def test_the_same_arguments_give_the_same_figures() -> None:
    trace = generate("longtail", seed=2, scale=0.05)
    arm = TailArm("move", SETTINGS, move=True)
    assert run_tail_arm(trace, arm).row() == run_tail_arm(trace, arm).row()
