"""Splitting a node's cores between its CPU engines, and the OpenMP binding each vLLM CPU engine gets.

The real engines' side (vLLM's log and the workers' affinity) is ``tests/vllm/test_cpu_cores.py``.
"""

from __future__ import annotations

import os

import pytest

from launcher.engines.cores import format_cores, parse_cores, split_cores, started_on
from launcher.engines.vllm.cpu import BIND_ENV, check_user_binding, omp_binding


def test_engines_get_disjoint_consecutive_shares() -> None:
    assert split_cores([0, 1], 2) == ([[0], [1]], None)
    shares, note = split_cores(list(range(8)), 3)
    assert shares == [[0, 1, 2], [3, 4, 5], [6, 7]] and note is None
    shares, _ = split_cores([4, 5, 9, 10], 2)  # a Slurm step's cpuset need not start at 0 or be contiguous
    assert shares == [[4, 5], [9, 10]]


def test_more_engines_than_cores_share_them_evenly_and_say_so() -> None:
    shares, note = split_cores([0, 1], 3)
    assert shares == [[0], [1], [0]]
    assert note is not None and "3 CPU engines on 2 core(s)" in note and "--cpus-per-task" in note


def test_one_core_per_worker_is_kept_for_the_server_when_there_are_two_per_worker() -> None:
    alone = omp_binding([0], 1)
    assert alone.env_value == "0" and alone.reserved == ()  # no core to spare: threads and server share it
    two = omp_binding([0, 1], 1)
    assert two.env_value == "0" and two.reserved == (1,)  # what vLLM's auto mode would keep
    assert omp_binding([0, 1, 2, 3], 1).env_value == "0-2"
    tp2 = omp_binding([4, 5, 6, 7, 8, 9], 2)  # TP 2: a list per worker, split by "|"
    assert tp2.env_value == "4-5|6-7" and tp2.reserved == (8, 9)
    assert omp_binding([0, 1, 2], 2).env_value == "0-1|2"
    assert omp_binding([3], 2).env_value == "3|3"  # more workers than cores: they share
    assert "OpenMP threads rank 0: 0" in two.describe([0, 1]) and "1 kept" in two.describe([0, 1])


def test_a_binding_the_user_set_must_fit_the_engine() -> None:
    assert check_user_binding({}, [0, 1], 1) is None
    assert check_user_binding({BIND_ENV: "auto"}, [0], 1) is None
    assert check_user_binding({BIND_ENV: "1"}, [0, 1], 1) is None
    outside = check_user_binding({BIND_ENV: "0-3"}, [0, 1], 1)
    assert outside is not None and "2-3 outside this engine's cores 0-1" in outside
    count = check_user_binding({BIND_ENV: "0|1"}, [0, 1], 1)
    assert count is not None and "2 core list(s) for 1 worker(s)" in count
    assert "not a cpulist" in (check_user_binding({BIND_ENV: "zero"}, [0], 1) or "")


def test_cpulists_round_trip() -> None:
    assert format_cores([0, 1, 2, 3, 6, 8, 9]) == "0-3,6,8-9"
    assert parse_cores("0-3,6,8-9") == [0, 1, 2, 3, 6, 8, 9]
    with pytest.raises(ValueError):
        parse_cores("3-1")


def test_started_on_moves_only_this_thread_and_puts_it_back() -> None:
    before = os.sched_getaffinity(0)
    one = min(before)
    with started_on([one]):
        assert os.sched_getaffinity(0) == {one}
    assert os.sched_getaffinity(0) == before
    with started_on(None):
        assert os.sched_getaffinity(0) == before


def test_the_host_splits_the_cores_it_may_use_and_only_for_cpu_engines() -> None:
    """On Slurm the engine host's affinity is the step's cpuset: the shares come from it, never from the
    node's other cores; GPU engines and simulated ones are not pinned."""
    from launcher.engines.host import core_groups
    from launcher.engines.host_config import EngineHostConfig

    mine = max(os.sched_getaffinity(0))
    vllm = EngineHostConfig(kind="vllm", count=2, host="127.0.0.1", model="/m")
    with started_on([mine]):  # a step given one core
        shares, note = core_groups(vllm, [[], []])
    assert shares == [[mine], [mine]] and note is not None and "2 CPU engines on 1 core(s)" in note
    assert core_groups(vllm, [["0"], ["1"]]) == ([[], []], None)  # engines with GPUs: not pinned
    sim = EngineHostConfig(kind="sim", count=2, host="127.0.0.1", model="m")
    assert core_groups(sim, [[], []]) == ([[], []], None)
