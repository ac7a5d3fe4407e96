"""The request record (``router.record``): one JSONL line per generation request, written off the request
path by every process that proxies (the router's, each worker's), read back by ``read_records``.

Real routers on 127.0.0.1 (OS-chosen ports) in front of the simulated engines, as one process and with two
worker processes: the record must say what the engines themselves counted (tokens per engine, from their
``/sim/stats``), keep a session's hash and no prompt text, show a retry as two attempts and a pause as
time held. The writer alone for what needs exact control: rotation under the size cap, a line cut by a
kill, a full queue. Every loop is bounded; files are written under ``tmp_path`` only.
"""

from __future__ import annotations

import asyncio
import json
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from click.testing import CliRunner

from router import GenerationRouter
from router.record.draft import RecordDraft, record_json
from router.record.format import RequestRecord, read_records, record_files
from router.record.writer import RecordWriter
from tests.support.http_backends import (
    router_factory,
    workers_fixture,  # noqa: F401 (the fixture)
)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TOKEN = "admin-token-" + "z" * 20
MODEL = "sim"
SECRET = "the-prompt-text-nobody-else-may-read"


@pytest.fixture
def routers(workers: int) -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(probe_interval_s=0, admin_token=TOKEN, workers=workers) as make:
        yield make


@pytest.fixture
def one_process() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(probe_interval_s=0, admin_token=TOKEN, workers=1) as make:
        yield make


def chat(session: int, turn: int, max_tokens: int = 6) -> dict[str, Any]:
    """A multi-turn body: turn k resends turns 0..k-1."""
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a coding agent. " * 8},
        {"role": "user", "content": f"{SECRET} task {session}"},
    ]
    for t in range(turn):
        messages += [
            {"role": "assistant", "content": f"step {t} of {session}"},
            {"role": "user", "content": f"tool output {t}"},
        ]
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens}


async def post(
    base: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[int, str, bytes]:
    """One request on a fresh connection (any worker may accept it): status, the router's request id,
    the answer."""
    data = orjson.dumps(body)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.post(base + path, data=data, headers=headers or {}) as r:
            return r.status, r.headers.get("x-rl-request-id", ""), await r.read()


async def admin(base: str, method: str, path: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, base + path, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            return r.status, orjson.loads(await r.read())


async def metrics(base: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


async def until(check: Callable[[], Any], what: str, timeout_s: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s:g} s: {what}")
        await asyncio.sleep(0.1)


async def stop(r: GenerationRouter) -> None:
    """Stop the router off the test's loop (which serves the engines); its record is then flushed."""
    await asyncio.get_running_loop().run_in_executor(None, r.stop)


def engine_url(sim: Any) -> str:
    return sim.url.removesuffix("/v1")


# -- through the router --------------------------------------------------------------------------------------
async def test_one_line_per_request_matching_the_engines(sims, routers, workers: int, tmp_path: Path) -> None:
    es = await sims(2)
    record = tmp_path / "record"
    r = routers([e.url for e in es], record_dir=str(record))
    base = r.base_url()
    sent: dict[str, dict[str, Any]] = {}
    for turn in range(3):
        for session in range(4):
            body = chat(session, turn)
            status, rid, _ = await post(base, CHAT, body, {"X-Session-ID": f"session-{session}"})
            assert status == 200 and rid
            sent[rid] = {"body": body, "session": session, "stream": False}
    stream = {"model": MODEL, "prompt": "count to ten", "max_tokens": 5, "stream": True}
    stream["stream_options"] = {"include_usage": True}
    status, rid, answer = await post(base, COMPLETIONS, stream)
    assert status == 200 and answer.endswith(b"data: [DONE]\n\n")
    sent[rid] = {"body": stream, "session": None, "stream": True}

    m = await until(lambda: _written(base, len(sent)), f"rl_router_record_written_total reaches {len(sent)}")
    assert m["rl_router_record_dropped_total"] == 0
    on_disk = sum(f.stat().st_size for f in record_files(record))
    assert m["rl_router_record_bytes"] == on_disk > 0
    await stop(r)

    report = read_records(record)
    assert report.skipped == {}
    assert sorted(rec.id for rec in report.records) == sorted(sent)  # one line per request, no more
    if workers > 1:
        names = {f.name for f in record_files(record)}
        assert names <= {"requests-w0.jsonl", "requests-w1.jsonl"}, names
    else:
        assert [f.name for f in record_files(record)] == ["requests.jsonl"]
    assert stat.S_IMODE(record.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in record_files(record))

    # Tokens per engine: what the engines counted themselves.
    by_engine: dict[str, list[RequestRecord]] = {}
    for rec in report.records:
        by_engine.setdefault(rec.engine or "", []).append(rec)
    assert set(by_engine) <= {engine_url(e) for e in es}
    for e in es:
        mine = by_engine.get(engine_url(e), [])
        stats = e.stats_snapshot()
        assert sum(rec.prompt_tokens or 0 for rec in mine) == stats["prompt_tokens"]
        assert sum(rec.completion_tokens or 0 for rec in mine) == stats["generation_tokens"]
        assert sum(rec.cached_tokens or 0 for rec in mine) == stats["prefix_cache_hits"]

    text = b"".join(f.read_bytes() for f in record_files(record))
    assert SECRET.encode() not in text and b"session-0" not in text  # hashes only, never the text
    hashes: dict[int, set[str | None]] = {}
    for rec in report.records:
        want = sent[rec.id]
        assert rec.status == 200 and rec.text is None
        assert rec.stream is want["stream"]
        assert rec.path == (COMPLETIONS if want["stream"] else CHAT)
        assert rec.prompt_bytes == len(orjson.dumps(want["body"]))
        assert rec.max_tokens == want["body"]["max_tokens"]
        assert rec.finish_reason in ("length", "stop")
        assert rec.completion_tokens and rec.prompt_tokens
        assert [(a.engine, a.outcome, a.status) for a in rec.attempts] == [(rec.engine, "ok", 200)]
        assert rec.held_s == {}
        assert rec.ttfb_s is not None and rec.duration_s is not None and 0 < rec.ttfb_s <= rec.duration_s
        assert abs(rec.t - time.time()) < 120
        if want["session"] is None:
            assert rec.session is None
        else:
            assert rec.prefix and all(len(h) == 16 for h in rec.prefix)
            hashes.setdefault(want["session"], set()).add(rec.session)
    # A session's turns share one hash; no two sessions share one.
    assert all(len(h) == 1 and None not in h for h in hashes.values())
    assert len({next(iter(h)) for h in hashes.values()}) == 4
    # Turn k+1 extends turn k: its prefix starts with the previous turn's blocks, but for the last.
    turns = sorted((rec for rec in report.records if sent[rec.id]["session"] == 0), key=lambda x: x.t)
    assert turns[1].prefix[: len(turns[0].prefix) - 1] == turns[0].prefix[:-1]


async def _written(base: str, n: int) -> dict[str, float] | None:
    m = await metrics(base)
    return m if m.get("rl_router_record_written_total") == n else None


async def test_the_line_is_the_formats_own(tmp_path: Path) -> None:
    """A draft's line has the keys ``RequestRecord.to_json`` writes, in its order, and reads back equal."""
    d = RecordDraft(CHAT, time.perf_counter() - 0.5)
    body = orjson.dumps(chat(1, 2))
    d.read_body(body, [1, -2, 3])
    d.id, d.session_key = "abc", "s1"
    d.begin("http://127.0.0.1:1")
    d.a_status = 500
    d.end("status")
    d.begin("http://127.0.0.1:2")
    d.a_status = 200
    d.tail = (
        b'"finish_reason":"stop"}],"usage":{"prompt_tokens":7,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":4}}}'
    )
    d.end("ok", "v3")
    d.add("pause", 0.25)
    d.finish(200)
    obj = record_json(d.__dict__, time.time() - time.perf_counter())
    rec = RequestRecord.from_json(obj)
    assert list(obj) == list(rec.to_json()) and rec.to_json() == obj
    line = json.loads(d.line())
    assert abs(line.pop("t") - obj.pop("t")) < 0.01 and line == obj
    usage = (rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens, rec.finish_reason)
    assert usage == (7, 4, 2, "stop")
    assert [(a.engine, a.outcome, a.status) for a in rec.attempts] == [
        ("http://127.0.0.1:1", "status_5xx", 500),
        ("http://127.0.0.1:2", "ok", 200),
    ]
    assert rec.engine == "http://127.0.0.1:2" and rec.version == "v3" and rec.held_s == {"pause": 0.25}
    assert rec.prefix == ["0000000000000001", "fffffffffffffffe", "0000000000000003"]
    assert rec.max_tokens == 6 and rec.stream is False and rec.session and rec.session != "s1"


async def test_text_only_when_asked(sims, one_process, tmp_path: Path) -> None:
    es = await sims(1)
    record = tmp_path / "record"
    r = one_process([e.url for e in es], record_dir=str(record), record_text=True)
    body = chat(7, 1)
    status, _, answer = await post(r.base_url(), CHAT, body)
    assert status == 200
    await stop(r)
    (rec,) = read_records(record).records
    assert rec.text is not None
    assert rec.text["prompt"] == orjson.dumps(body).decode()
    assert rec.text["completion"] == orjson.loads(answer)["choices"][0]["message"]["content"] != ""


async def test_a_retry_is_two_attempts(sims, one_process, tmp_path: Path) -> None:
    es = await sims(2)
    bad, good = es
    fault = {"mode": "error", "error_rate": 1.0}
    async with aiohttp.ClientSession() as s, s.post(engine_url(bad) + "/sim/fault", json=fault) as f:
        assert f.status == 200
    record = tmp_path / "record"
    r = one_process([e.url for e in es], record_dir=str(record), policy="round_robin", max_attempts=2)
    for i in range(4):
        status, _, _ = await post(r.base_url(), CHAT, chat(i, 0))
        assert status == 200
    await stop(r)
    records = read_records(record).records
    assert len(records) == 4 and all(rec.engine == engine_url(good) for rec in records)
    retried = [rec for rec in records if len(rec.attempts) == 2]
    assert retried, [rec.attempts for rec in records]
    for rec in retried:
        first, second = rec.attempts
        assert (first.engine, first.outcome, first.status) == (engine_url(bad), "status_5xx", 500)
        assert (second.engine, second.outcome, second.status) == (engine_url(good), "ok", 200)
        assert first.s > 0 and second.s > 0
    assert bad.stats_snapshot()["errors_injected"] == len(retried)


async def test_a_request_held_by_a_pause_says_so(sims, routers, tmp_path: Path) -> None:
    es = await sims(2)
    record = tmp_path / "record"
    r = routers([e.url for e in es], record_dir=str(record))
    base = r.base_url()
    status, _ = await admin(base, "POST", "/fleet/pause?mode=keep")
    assert status == 200
    held = asyncio.create_task(post(base, CHAT, chat(1, 0)))
    await until(lambda: _held(base), "the request is held at the pause gate")
    await asyncio.sleep(0.3)
    status, _ = await admin(base, "POST", "/fleet/resume")
    assert status == 200
    status, _, _ = await held
    assert status == 200
    await stop(r)
    (rec,) = read_records(record).records
    assert set(rec.held_s) == {"pause"} and 0.3 <= rec.held_s["pause"] < 10
    assert rec.duration_s is not None and rec.duration_s >= rec.held_s["pause"]


async def _held(base: str) -> bool:
    _, paused = await admin(base, "GET", "/fleet/is_paused")
    return bool(paused["result"]["held"])


async def test_worker_files_are_per_worker_and_their_union_whole(sims, tmp_path: Path) -> None:
    es = await sims(2)
    record = tmp_path / "record"
    with router_factory(probe_interval_s=0, admin_token=TOKEN, workers=2) as make:
        r = make([e.url for e in es], record_dir=str(record))
        base = r.base_url()
        ids: list[str] = []
        for _round in range(30):  # bounded: until both workers have answered some
            answers = await asyncio.gather(*(post(base, CHAT, chat(len(ids) + i, 0)) for i in range(8)))
            assert all(a[0] == 200 for a in answers)
            ids += [a[1] for a in answers]
            m = await metrics(base)
            served = {k: v for k, v in m.items() if k.startswith("rl_router_worker_requests{")}
            if len(served) == 2 and all(served.values()):
                break
        else:
            pytest.fail("one worker answered nothing")
        await until(lambda: _written(base, len(ids)), f"{len(ids)} records written, summed over the workers")
        await stop(r)
    files = {f.name: f for f in record_files(record)}
    assert set(files) == {"requests-w0.jsonl", "requests-w1.jsonl"}
    per_file = [read_records(f).records for f in files.values()]
    assert all(per_file)
    union = [rec.id for recs in per_file for rec in recs]
    assert sorted(union) == sorted(ids) and len(set(union)) == len(ids)


async def test_a_full_queue_drops_and_counts_and_never_blocks(
    sims, one_process, tmp_path: Path, monkeypatch
) -> None:
    import router.record.writer as writer_module

    monkeypatch.setattr(writer_module, "QUEUE_RECORDS", 2)
    es = await sims(2)
    r = one_process([e.url for e in es], record_dir=str(tmp_path / "record"))
    base = r.base_url()
    n = 40
    answers = await asyncio.gather(*(post(base, CHAT, chat(i, 0, max_tokens=2)) for i in range(n)))
    assert all(a[0] == 200 for a in answers)

    async def accounted() -> dict[str, float] | None:
        m = await metrics(base)
        done = m.get("rl_router_record_written_total", 0) + m.get("rl_router_record_dropped_total", 0)
        return m if done == n else None

    m = await until(accounted, "every request written or counted as dropped")
    await stop(r)
    assert len(read_records(tmp_path / "record").records) == m["rl_router_record_written_total"]


# -- the writer alone ------------------------------------------------------------------------------------
def records(n: int, start: int = 0) -> list[RequestRecord]:
    return [
        RequestRecord(id=f"r{i:06d}", t=1000.0 + i, path=CHAT, status=200, prefix=["ab" * 8] * 4)
        for i in range(start, start + n)
    ]


def test_a_full_queue_refuses_at_once(tmp_path: Path) -> None:
    w = RecordWriter(tmp_path / "record", max_bytes=1 << 20, keep_files=2, queue_records=4)
    w._thread = threading.Thread(target=lambda: None)  # never started: nothing drains the queue
    t0 = time.perf_counter()
    accepted = [w.submit(rec) for rec in records(10)]
    assert time.perf_counter() - t0 < 0.5
    assert accepted == [True] * 4 + [False] * 6
    assert w.dropped == 6 and w.queued == 4
    w._closed = True  # its thread never ran: nothing to stop


def test_rotation_keeps_the_cap_and_every_whole_line_reads_back(tmp_path: Path) -> None:
    record = tmp_path / "record"
    w = RecordWriter(record, max_bytes=64 * 1024, keep_files=4, flush_interval_s=0.05)
    sent = records(2000)
    for i in range(0, len(sent), 100):  # in bursts, as requests end
        assert all(w.submit(rec) for rec in sent[i : i + 100])
        time.sleep(0.02)
    w.close()
    assert w.dropped == 0 and w.written == len(sent) and w.write_errors == 0
    files = record_files(record)
    assert [f.name for f in files] == [f"requests.{n}.jsonl" for n in (3, 2, 1)] + ["requests.jsonl"]
    sizes = [f.stat().st_size for f in files]
    assert all(s <= 16 * 1024 for s in sizes) and sum(sizes) <= 64 * 1024
    assert w.bytes_on_disk() == sum(sizes)
    report = read_records(record)
    assert report.skipped == {}
    kept = [rec.id for rec in report.records]
    lines = sum(f.read_bytes().count(b"\n") for f in files)
    assert len(kept) == lines and kept == [rec.id for rec in sent[-len(kept) :]]  # the newest, in order
    assert kept[-1] == sent[-1].id and 64 * 1024 // 2 < sum(sizes)


def test_a_line_cut_by_a_kill_is_skipped_and_said(tmp_path: Path) -> None:
    record = tmp_path / "record"
    w = RecordWriter(record, max_bytes=1 << 20, keep_files=2, process_tag="w1")
    for rec in records(5):
        w.submit(rec)
    w.close()
    (path,) = record_files(record)
    assert path.name == "requests-w1.jsonl"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 20])  # the last line, cut short mid-write
    report = read_records(record)
    assert [rec.id for rec in report.records] == [rec.id for rec in records(4)]
    assert report.skipped == {"line(s) cut short (the writer was killed mid-line)": 1}
    assert "skipped 1 line(s) cut short" in report.summary()
    # A replaced worker appends to the same file: on a line of its own, after the cut one.
    w = RecordWriter(record, max_bytes=1 << 20, keep_files=2, process_tag="w1")
    w.submit(records(1, start=9)[0])
    w.close()
    report = read_records(record)
    assert [rec.id for rec in report.records] == [*(rec.id for rec in records(4)), "r000009"]
    assert report.skipped == {"malformed line(s)": 1}


def test_a_directory_that_cannot_be_made_is_named(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="request record directory"):
        RecordWriter(blocker / "record", max_bytes=1 << 20, keep_files=2)


def test_cli_flags_reach_the_config(tmp_path: Path, monkeypatch) -> None:
    import router.cli as cli

    seen: list[Any] = []
    monkeypatch.setattr(cli, "_serve", lambda config, backends: seen.append(config))
    args = ["--insecure-admin", "--workers", "1", "--record-dir", str(tmp_path / "rec")]
    args += ["--record-max-bytes", "1048576", "--record-keep-files", "3", "--record-text"]
    result = CliRunner().invoke(cli.router_command, args)
    assert result.exit_code == 0, result.output
    (config,) = seen
    assert (config.record_dir, config.record_max_bytes, config.record_keep_files, config.record_text) == (
        str(tmp_path / "rec"),
        1048576,
        3,
        True,
    )
    assert config.model_dump()["record_dir"] == str(tmp_path / "rec")  # it reaches worker processes
    off = CliRunner().invoke(cli.router_command, ["--insecure-admin", "--workers", "1"])
    assert off.exit_code == 0 and seen[-1].record_dir is None and seen[-1].record_text is False
