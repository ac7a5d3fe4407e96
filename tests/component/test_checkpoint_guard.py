"""The check before a refit pauses anything (``router.fleet.checkpoint``, issue 28 findings 1, 5, 7, 8).

What each input did on bad45c1, and what these tests hold the check to:
* a ``model.safetensors`` truncated to half its size passed (only its name was looked at) and every
  engine that loaded it lost its weights: now refused with 400, naming the file and both byte counts;
* a ``config.json`` FIFO froze the router's event loop (all generation) for as long as its planter
  chose: now refused at once, without being opened for a blocking read, while generation flows; the
  whole check runs in a thread under a deadline;
* another user's or a world-writable directory, and symlinks out of it, were loaded: now refused unless
  the refit says ``allow_foreign_checkpoint``;
* the served model's reference config was read relative to the router's working directory (the
  simulator's ``sim-8b``), so a planted file there decided which checkpoints were refused: now only an
  absolute directory of this user's is read;
* ``lease_s`` / ``deadline_s`` of ``1e9`` were accepted: now bounded.

Unit tests of the parser and the refusals on real files under ``tmp_path`` (the second Unix user of
``tests/support/other_user.py`` owns the planted ones), and through a real router on simulated engines.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.engines.sim.checkpoint import CheckpointError, check_safetensors
from launcher.fleet.client import FleetClient
from router import GenerationRouter
from router.adapters.plan import LoraPlan
from router.fleet.adapter_check import read_adapter
from router.fleet.checkpoint import (
    CHECK_TIMEOUT_S,
    MAX_CONFIG_BYTES,
    CheckpointGuard,
    CheckpointRefused,
    check_directories,
    read_checkpoint,
)
from router.fleet.refit_routes import MAX_DEADLINE_S, MAX_LEASE_S
from router.fleet.safetensors import HeaderError, read_header
from tests.support.adapters import write_adapter
from tests.support.checkpoints import CONFIG, broken, checkpoint, unloadable
from tests.support.http_backends import router_factory
from tests.support.other_user import other_user
from tests.support.refit_calls import TOKEN, admin, chat, in_thread, send
from tests.support.shared_dir import shared_dir

__all__ = ["shared_dir"]  # the fixture


@pytest.fixture
def router_over() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN) as make:
        yield make


def refused(path: Path | str, **kw: Any) -> str:
    with pytest.raises(CheckpointRefused) as info:
        read_checkpoint(str(path), **kw)
    return str(info.value)


def safetensors(tensors: dict[str, Any], data: bytes) -> bytes:
    header = json.dumps(tensors).encode()
    return struct.pack("<Q", len(header)) + header + data


# -- the safetensors header: one parser, the router's and the simulator's ------------------------------
def test_a_file_cut_to_half_its_size_is_refused_naming_it_and_both_sizes(tmp_path: Path) -> None:
    d = checkpoint(tmp_path, "cut")
    f = d / "model.safetensors"
    whole = f.stat().st_size
    os.truncate(f, whole // 2)
    why = refused(d)
    assert f"{f} is {whole // 2} bytes, shorter than the {whole} its header says" in why, why
    assert "incomplete metadata, file not fully covered" in why
    # the simulator's load fails on the same file with the same words: one parser
    with pytest.raises(CheckpointError, match="incomplete metadata, file not fully covered"):
        check_safetensors(str(f))
    # cut inside the header itself: the header's own length is what it says
    os.truncate(f, 20)
    (n,) = struct.unpack("<Q", f.read_bytes()[:8])
    assert f"is 20 bytes, shorter than the {8 + n} its header says" in refused(d)
    # longer than its header says (a copy appended to): refused too
    d2 = checkpoint(tmp_path, "long")
    with (d2 / "model.safetensors").open("ab") as fh:
        fh.write(b"\0" * 10)
    assert "longer than the" in refused(d2)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\x01\x02", "header too small"),
        (b"garbage" * 100, "header too large"),
        (struct.pack("<Q", 3) + b"\xff\xfe\xfd", "invalid UTF-8 in header"),
        (struct.pack("<Q", 2) + b"[]", "expected struct HashMetadata"),
        (
            safetensors({"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
            "unknown variant",
        ),
        (
            safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4),
            "invalid shape",
        ),
        (
            safetensors(
                {
                    "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]},
                },
                b"\0" * 6,
            ),
            "invalid offset for tensor `b`",
        ),
        (safetensors({"w": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "missing field `data_offsets`"),
        (  # a crash (TypeError, unhashable list) before: found by comparing with the library's safe_open
            safetensors({"w": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
            "invalid type: sequence",
        ),
        (struct.pack("<Q", 4000) + b"[" * 2000 + b"]" * 2000, "invalid JSON in header"),
    ],
)
def test_every_header_the_library_refuses_is_refused_before_the_pause(
    tmp_path: Path, raw: bytes, message: str
) -> None:
    d = checkpoint(tmp_path, "bad")
    (d / "model.safetensors").write_bytes(raw)
    why = refused(d)
    assert str(d / "model.safetensors") in why and message in why, why
    with pytest.raises(CheckpointError, match="Error while deserializing header: "):
        check_safetensors(str(d / "model.safetensors"))


def test_the_parser_reads_what_the_writer_writes() -> None:
    import io

    raw = safetensors({"w": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, 12]}}, b"\1" * 12)
    header = read_header(io.BytesIO(raw), len(raw))
    assert header.tensors == 1 and header.size == len(raw)
    with pytest.raises(HeaderError) as info:
        read_header(io.BytesIO(raw), len(raw) + 1)
    assert info.value.size_said == len(raw)


def test_every_shard_the_index_lists_must_be_there_and_whole(tmp_path: Path) -> None:
    d = checkpoint(tmp_path, "sharded")
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "lists shards that are not in the directory: ['model-00002-of-00002.safetensors']" in refused(d)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"garbage" * 100)
    assert "model-00002-of-00002.safetensors is not a safetensors file" in refused(d)
    (d / "model-00002-of-00002.safetensors").write_bytes(
        (d / "model-00001-of-00002.safetensors").read_bytes()
    )
    # a shard the index does not list is not loaded by vLLM: it is not read either
    (d / "consolidated.safetensors").write_bytes(b"garbage")
    assert read_checkpoint(str(d)).files == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]


def test_torch_files_are_checked_as_far_as_their_zip_directory(tmp_path: Path) -> None:
    d = unloadable(tmp_path, "bin")
    assert read_checkpoint(str(d)).files == ["pytorch_model.bin"]  # its pickle is the engine's to read
    f = d / "pytorch_model.bin"
    whole = f.stat().st_size
    os.truncate(f, whole - 10)
    assert "its zip directory does not parse" in refused(d)
    f.write_bytes(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.rest")  # a legacy torch file
    assert read_checkpoint(str(d)).files == ["pytorch_model.bin"]
    f.write_bytes(b"neither zip nor pickle")
    assert "neither a zip-format nor a legacy torch file" in refused(d)
    with zipfile.ZipFile(f, "w") as archive:
        archive.writestr("notes.txt", b"x")
    assert "holds no data.pkl" in refused(d)
    # the trainer's own files beside the weights are not what vLLM loads: not checked
    f.unlink()
    with zipfile.ZipFile(d / "model.bin", "w") as archive:
        archive.writestr("archive/data.pkl", b"x")
    (d / "training_args.bin").write_bytes(b"half-written")
    assert read_checkpoint(str(d)).files == ["model.bin"]


# -- what may be read, and who may have written it -------------------------------------------------------
def test_a_fifo_or_an_oversized_config_is_refused_at_once(tmp_path: Path) -> None:
    d = checkpoint(tmp_path, "fifo")
    (d / "config.json").unlink()
    os.mkfifo(d / "config.json")
    t0 = time.monotonic()
    assert f"{d / 'config.json'} is a FIFO, not a regular file" in refused(d)
    assert time.monotonic() - t0 < 1.0  # nobody writes to it: a blocking open would never return
    d2 = checkpoint(tmp_path, "weights-fifo")
    (d2 / "model.safetensors").unlink()
    os.mkfifo(d2 / "model.safetensors")
    assert "is a FIFO, not a regular file" in refused(d2)
    d3 = checkpoint(tmp_path, "big")
    (d3 / "config.json").write_text(json.dumps({**CONFIG, "pad": "x" * MAX_CONFIG_BYTES}))
    assert f"more than {MAX_CONFIG_BYTES} is no config.json" in refused(d3)


def test_another_users_or_a_writable_checkpoint_is_refused_unless_allowed(tmp_path: Path) -> None:
    probe = other_user()
    theirs = checkpoint(tmp_path, "theirs")
    probe.chown(theirs, theirs / "config.json", theirs / "model.safetensors")
    why = refused(theirs)
    assert f"checkpoint directory {theirs} is owned by uid {probe.uid}" in why, why
    assert '"allow_foreign_checkpoint": true' in why  # says how to opt out
    assert read_checkpoint(str(theirs), allow_foreign=True).files == ["model.safetensors"]
    # one planted file in a directory of ours
    planted = checkpoint(tmp_path, "planted")
    probe.chown(planted / "model.safetensors")
    assert f"{planted / 'model.safetensors'} is owned by uid {probe.uid}" in refused(planted)
    # writable by group or others: the directory, or a file in it
    loose = checkpoint(tmp_path, "loose")
    loose.chmod(0o775)
    assert "is writable by group or others (mode 0775)" in refused(loose)
    loose.chmod(0o755)
    (loose / "config.json").chmod(0o666)
    assert f"{loose / 'config.json'} is writable by group or others (mode 0666)" in refused(loose)


def test_a_path_another_user_can_redirect_is_refused_naming_where(shared_dir: Path, tmp_path: Path) -> None:
    """Issue 38, finding 2: every directory the path is resolved through, and every symlink on the way,
    only this user or root can change; the checkpoint and the adapter check alike. ``shared_dir`` is a
    directory other users can enter (pytest's own temp directory is 0700: out of their reach)."""
    probe = other_user()
    # under a world-writable directory without the sticky bit (with it, like /tmp: fine)
    open_dir = shared_dir / "open"
    open_dir.mkdir()
    under = checkpoint(open_dir, "under")
    open_dir.chmod(0o777)
    assert f"lies under {open_dir}, which every user can write (mode 0777, no sticky bit)" in refused(under)
    open_dir.chmod(0o1777)
    assert read_checkpoint(str(under)).files == ["model.safetensors"]
    team = shared_dir / "team"  # a team scratch the other user made, as /tmp is made
    team.mkdir()
    probe.chown(team)
    team.chmod(0o1777)
    mine = checkpoint(team, "run1-ckpt")
    why = refused(mine)
    assert f"lies under {team}, owned by {probe.name} (uid {probe.uid}): its owner can rename" in why, why
    assert '"allow_foreign_checkpoint": true' in why and "\n" not in why
    assert read_checkpoint(str(mine), allow_foreign=True).files == ["model.safetensors"]
    adapter = write_adapter(team / "a-v1")
    with pytest.raises(CheckpointRefused, match=f"adapter directory {adapter} lies under {team}, owned by"):
        read_adapter(str(adapter), LoraPlan(max_lora_rank=8), None)
    # a directory another user's group can write (no sticky bit), two levels up
    project = shared_dir / "project"
    project.mkdir()
    os.chown(project, 0, probe.gid)
    project.chmod(0o775)
    deep = checkpoint(project / "me" / "runs", "step-9")
    why = refused(deep)
    assert f"lies under {project}, which group {probe.name} (gid {probe.gid}) can write (mode 0775" in why
    project.chmod(0o1775)  # sticky, root's: its group adds names but cannot move ours
    assert read_checkpoint(str(deep)).files == ["model.safetensors"]
    # the same, inside a directory that grants group and others no search (a job directory, 0700):
    # nobody else reaches it (a trainer's mkdir -p under umask 002 makes such folders 0775)
    job = shared_dir / "job"
    job.mkdir(mode=0o700)
    os.chown(project.rename(job / "project"), 0, probe.gid)
    (job / "project").chmod(0o775)
    assert read_checkpoint(str(job / "project" / "me" / "runs" / "step-9")).files == ["model.safetensors"]
    job.chmod(0o701)  # searchable by others again: refused again
    assert f"lies under {job / 'project'}, which group {probe.name}" in refused(
        job / "project/me/runs/step-9"
    )
    deep = job / "project" / "me" / "runs" / "step-9"
    job.chmod(0o700)
    # the path goes through another user's directory, though it leads to ours
    (team / "latest").symlink_to(deep)
    assert f"lies under {team}, owned by {probe.name}" in refused(team / "latest")
    # a symlink another user owns, in a directory of ours
    link = tmp_path / "theirs-latest"
    link.symlink_to(deep)
    probe.chown(link)
    assert f"the path goes through the symlink {link}, owned by {probe.name}" in refused(link)


def test_a_symlink_out_of_the_directory_is_refused_one_inside_is_not(tmp_path: Path) -> None:
    elsewhere = checkpoint(tmp_path, "elsewhere")
    d = checkpoint(tmp_path, "links")
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(elsewhere / "model.safetensors")
    why = refused(d)
    assert f"{d / 'model.safetensors'} is a symlink to {elsewhere / 'model.safetensors'}, outside" in why
    assert read_checkpoint(str(d), allow_foreign=True).files == ["model.safetensors"]
    (d / "model.safetensors").unlink()
    (d / "weights.bin.safetensors").write_bytes((elsewhere / "model.safetensors").read_bytes())
    (d / "model.safetensors").symlink_to("weights.bin.safetensors")  # inside: fine
    assert read_checkpoint(str(d)).files == ["model.safetensors", "weights.bin.safetensors"]
    # the directory itself may be a link (a trainer's "latest"): it is judged where it leads
    (tmp_path / "latest").symlink_to(elsewhere)
    assert read_checkpoint(str(tmp_path / "latest")).config == CONFIG


def test_the_reference_is_an_absolute_directory_of_this_users_or_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = other_user()
    monkeypatch.chdir(tmp_path)
    planted = tmp_path / "sim-8b"
    planted.mkdir()
    (planted / "config.json").write_text(json.dumps({"architectures": ["PlantedByProbe"], "hidden_size": 1}))
    probe.chown(planted, planted / "config.json")
    good = str(checkpoint(tmp_path, "good"))
    checked = check_directories([good], "sim-8b", None)
    assert checked.reference is None and "'sim-8b' is no absolute directory" in checked.note
    # an absolute served directory of another user's is not used either; the last refit's is
    checked = check_directories([good], str(planted), good)
    assert checked.reference == f"{good} (the last refit's)", checked
    other = checkpoint(tmp_path, "other", config={**CONFIG, "hidden_size": 128})
    with pytest.raises(CheckpointRefused, match="hidden_size: served 64, checkpoint 128"):
        check_directories([str(other)], str(planted), good)


async def test_a_check_past_its_deadline_is_refused_and_the_next_waits_for_it() -> None:
    guard = CheckpointGuard(timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(CheckpointRefused, match=r"timed out after 0.2 s: storage not answering\?"):
        await guard.run(time.sleep, 1.0)  # a read on storage that does not answer
    assert time.monotonic() - t0 < 0.6
    with pytest.raises(CheckpointRefused, match="the previous checkpoint check has waited on storage"):
        await guard.run(lambda: "never run")
    await asyncio.sleep(1.0)
    assert await guard.run(lambda: "ran") == "ran"
    assert CHECK_TIMEOUT_S == 10.0


# -- through a real router on simulated engines ----------------------------------------------------------
async def test_a_half_written_checkpoint_is_refused_before_anything_pauses(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    client = FleetClient(url, TOKEN)
    assert (await in_thread(client.load_weights, checkpoint(tmp_path, "b", b"b"), "v-b"))["ok"]
    cut = checkpoint(tmp_path, "cut", b"c")
    f = cut / "model.safetensors"
    whole = f.stat().st_size
    os.truncate(f, whole // 2)
    pauses = r.gate.stats().pauses_total
    status, body = await admin(url, "POST", "/fleet/refit", {"version": "v-cut", "from": str(cut)})
    assert status == 400 and f"{f} is {whole // 2} bytes, shorter than the {whole}" in body["error"], body
    assert r.gate.stats().pauses_total == pauses and not any(e.scheduler.gen_paused for e in engines)
    assert all(e.rl.weight_version == "v-b" for e in engines)
    assert [s for s, _ in [await send(url, chat()) for _ in range(4)]] == [200] * 4
    # the same garbage as one engine's node-local copy: refused too, before the pause
    status, body = await admin(
        url,
        "POST",
        "/fleet/refit",
        {
            "version": "v-x",
            "from": str(tmp_path / "b"),
            "from_by_engine": {engines[1].url: str(broken(tmp_path, "x"))},
        },
    )
    assert status == 400 and "header too large" in body["error"] and r.gate.stats().pauses_total == pauses


async def test_generation_flows_while_a_planted_fifo_is_checked(sims, router_over, tmp_path: Path) -> None:
    probe = other_user()
    engines = await sims(2)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    fifo = checkpoint(tmp_path, "probe-fifo-ckpt")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    probe.chown(fifo, fifo / "config.json", fifo / "model.safetensors")
    body = {"version": "v-fifo", "from": str(fifo), "allow_foreign_checkpoint": True}
    refit = asyncio.create_task(admin(url, "POST", "/fleet/refit", body))
    took = []
    for i in range(10):  # plain generation while the refit's check runs
        t0 = time.monotonic()
        status, _ = await asyncio.wait_for(send(url, chat(content=f"during {i}")), 5.0)
        took.append(time.monotonic() - t0)
        assert status == 200
        await asyncio.sleep(0.05)
    status, answer = await asyncio.wait_for(refit, CHECK_TIMEOUT_S + 5)
    assert status == 400 and "is a FIFO, not a regular file" in answer["error"], answer
    assert max(took) < 1.0, took
    # without the opt-out the owner is what is refused
    status, answer = await admin(url, "POST", "/fleet/refit", {"version": "v-fifo", "from": str(fifo)})
    assert status == 400 and f"owned by uid {probe.uid}" in answer["error"], answer
    assert not r.gate.paused and all(e.rl.weight_version == "default" for e in engines)


async def test_a_config_planted_in_the_routers_working_directory_decides_nothing(
    sims, router_over, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = other_user()
    monkeypatch.chdir(tmp_path)  # the router's working directory; the simulator's /v1/models root is sim-8b
    planted = tmp_path / "sim-8b"
    planted.mkdir()
    (planted / "config.json").write_text(json.dumps({"architectures": ["PlantedByProbe"], "hidden_size": 1}))
    probe.chown(planted, planted / "config.json")
    engines = await sims(2, model_name="sim-8b")  # the name examples/fleet-local.yaml serves
    r = router_over([e.url for e in engines])
    url = r.base_url()
    good = checkpoint(tmp_path, "good")
    status, answer = await admin(url, "POST", "/fleet/refit", {"version": "v1", "from": str(good)})
    assert status == 200 and answer["ok"], answer
    assert "not compared: the served model 'sim-8b' is no absolute directory" in answer["checkpoint_check"]
    # after a refit the last one's directory is the reference
    other = checkpoint(tmp_path, "other", config={**CONFIG, "hidden_size": 128})
    status, answer = await admin(url, "POST", "/fleet/refit", {"version": "v2", "from": str(other)})
    assert status == 400 and f"does not match the served model ({good} (the last refit's))" in answer["error"]
    status, answer = await admin(url, "POST", "/fleet/refit", {"version": "v3", "from": str(good)})
    assert status == 200 and f"config compared with {good} (the last refit's)" in answer["checkpoint_check"]


async def test_lease_and_deadline_are_bounded(sims, router_over, tmp_path: Path) -> None:
    engines = await sims(1)
    r = router_over([e.url for e in engines])
    url = r.base_url()
    begin = {"version": "held-forever", "source": "external"}
    for extra, bound in (({"lease_s": 1e9}, MAX_LEASE_S), ({"deadline_s": 1e9}, MAX_DEADLINE_S)):
        status, answer = await admin(url, "POST", "/fleet/refit/begin", {**begin, **extra})
        key = next(iter(extra))
        assert (
            status == 400
            and f'"{key}" must be a positive number of seconds, at most {bound:g}' in answer["error"]
        )
    status, answer = await admin(
        url,
        "POST",
        "/fleet/refit",
        {"version": "v", "from": str(checkpoint(tmp_path, "a")), "deadline_s": 3601},
    )
    assert status == 400 and "at most 3600" in answer["error"]
    assert not r.gate.paused
    status, answer = await admin(url, "POST", "/fleet/refit/begin", {**begin, "lease_s": MAX_LEASE_S})
    assert status == 200 and answer["lease_left_s"] <= MAX_LEASE_S, answer
    assert (await admin(url, "POST", "/fleet/refit/abort", {"id": answer["id"]}))[0] == 200
