"""``rl-launch check``'s login-node verdicts from what Slurm prints (``launcher.check.site``): no Slurm here,
the text is what ``sinfo``/``sacctmgr``/``srun --help`` print on real clusters."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.check.site import (
    Need,
    NodeRow,
    check_gpus,
    check_partition,
    check_time,
    gres_gpus,
    parse_accounts,
    parse_sinfo,
    prepare_share,
    read_sinfo,
    srun_has_pyxis,
)

SINFO = """\
debug*|node1|gpu:2|idle|infinite
debug*|node2|gpu:2|mixed|infinite
debug*|node3|gpu:2|down*|infinite
gpu|dgx01|gpu:a100:8(S:0-1)|idle|4:00:00
gpu|dgx02|gpu:a100:8(S:0-1),nvme:1|allocated|4:00:00
gpu|dgx03|gpu:a100:8(S:0-1)|drained|4:00:00
cpu|c1|(null)|idle|1-00:00:00
"""


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [
        ("gpu:2", 2),
        ("gpu:a100:8(S:0-1)", 8),
        ("gpu:a100:4,gpu:v100:2", 6),
        ("gpu:a100:8(S:0-1),nvme:1", 8),
        ("gpu:tesla", 1),
        ("(null)", 0),
        ("nvme:1", 0),
        ("", 0),
    ],
)
def test_gres_gpus(gres: str, gpus: int) -> None:
    assert gres_gpus(gres) == gpus


def test_parse_sinfo_reads_default_partition_gpus_and_usable_states() -> None:
    rows = parse_sinfo(SINFO)
    assert rows[0] == NodeRow("debug", True, "node1", 2, "idle", "infinite")
    assert [r.node for r in rows if r.usable] == ["node1", "node2", "dgx01", "dgx02", "c1"]
    assert {r.partition for r in rows if r.default} == {"debug"}


def test_a_missing_partition_names_the_ones_there() -> None:
    rows = parse_sinfo(SINFO)
    mine, verdict = check_partition(rows, Need("job", "h100", 2, 8, "slurm"))
    assert mine == [] and verdict.failed
    assert verdict.line() == (
        "FAIL  job partition: partition 'h100' does not exist (here: cpu, debug*, gpu; * = default); "
        "fix: set slurm.partition to one of them"
    )


def test_no_partition_means_the_default_one() -> None:
    mine, verdict = check_partition(parse_sinfo(SINFO), Need("job", None, 2, 0, "slurm"))
    assert {r.node for r in mine} == {"node1", "node2", "node3"}
    assert (
        verdict.line()
        == "ok    job partition: debug (the default): 2 of 3 node(s) usable, time limit infinite"
    )
    no_default = [r for r in parse_sinfo(SINFO) if not r.default]
    _, verdict = check_partition(no_default, Need("job", None, 1, 0, "slurm"))
    assert verdict.failed and "no default" in verdict.detail and "cpu, gpu" in verdict.fix


def test_gpus_the_nodes_lack_name_the_most_there_is() -> None:
    rows = parse_sinfo(SINFO)
    mine, _ = check_partition(rows, Need("generation", "debug", 1, 4, "generation.slurm"))
    verdict = check_gpus(mine, Need("generation", "debug", 1, 4, "generation.slurm"))
    assert verdict.line() == (
        "FAIL  generation nodes: 1 node(s) with 4 GPU(s) each asked, but the usable nodes of partition debug "
        "have at most 2 GPU(s) (node1, node2); fix: set generation.slurm.gpus_per_node to at most 2 (and the "
        "engines' TP x PP to fit), or use a partition with bigger nodes"
    )


def test_too_few_usable_nodes_fail_and_enough_pass() -> None:
    rows = [r for r in parse_sinfo(SINFO) if r.partition == "gpu"]
    short = check_gpus(rows, Need("job", "gpu", 3, 8, "slurm"))  # dgx03 is drained
    assert short.failed and "has 2 such usable node(s)" in short.detail
    enough = check_gpus(rows, Need("job", "gpu", 2, 8, "slurm"))
    assert not enough.failed and enough.detail.endswith("(dgx01, dgx02)")
    cpus = check_gpus(
        [r for r in parse_sinfo(SINFO) if r.partition == "cpu"], Need("job", "cpu", 1, 0, "slurm")
    )
    assert not cpus.failed and "GPU" not in cpus.detail


def test_accounts_and_pyxis() -> None:
    assert parse_accounts("root\nproj-a\nproj-a\n\n") == {"root", "proj-a"}
    assert srun_has_pyxis("      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH\n")
    # Slurm's own OCI option is not pyxis
    assert not srun_has_pyxis("      --container             Path to OCI container bundle\n")


def test_without_sinfo_the_one_line_says_where_to_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    rows, verdict = read_sinfo()
    assert rows is None
    assert verdict.line() == (
        "FAIL  slurm: `sinfo` is not on PATH; fix: run check on a Slurm login node (or add Slurm's bin "
        "directory to PATH)"
    )


def test_the_share_holds_a_token_and_a_foreign_root_is_refused(tmp_path: Path) -> None:
    share, token, verdict = prepare_share(str(tmp_path / "jobs"))
    assert not verdict.failed and share is not None and (share / "login.token").read_text() == token
    assert (tmp_path / "jobs").stat().st_mode & 0o777 == 0o700
    (tmp_path / "open").mkdir(mode=0o777)
    (tmp_path / "open").chmod(0o777)  # others may rename things in it: refused, as submit refuses it
    share, _, verdict = prepare_share(str(tmp_path / "open"))
    assert share is None and verdict.failed and verdict.name == "job root"


def test_a_time_over_the_partition_limit_fails() -> None:
    rows = parse_sinfo(SINFO)
    gpu = [r for r in rows if r.partition == "gpu"]
    need = Need("job", "gpu", 1, 8, "slurm")
    over = check_time(gpu, need, "04:00:01")
    assert over is not None and over.line() == (
        "FAIL  job time: slurm.time 04:00:01 is over partition gpu's time limit 4:00:00: the job would "
        "wait in the queue for ever (PartitionTimeLimit); fix: set slurm.time to at most 04:00:00, or use "
        "a partition with a longer limit"
    )
    assert check_time(gpu, need, "04:00:00") is None
    assert check_time([r for r in rows if r.partition == "debug"], need, "7-00:00:00") is None  # infinite
    assert check_time([r for r in rows if r.partition == "cpu"], need, "1-00:00:01") is not None
