"""A generation whose engine is killed mid-stream (SIGKILL) is continued on another engine: the client's
answer is the uninterrupted one, token for token (issue 41, ``router.continuation``).

Two simulator engines, each its own process (greedy decoding that is a function of the context, as a real
model's: a continuation from the prompt's ids plus the tokens produced makes the very tokens and logprobs
the uninterrupted run makes), behind a real router on 127.0.0.1 (OS-chosen ports). The reference answer is
the same request served whole through the same router; then the request again, and the engine serving it
killed with SIGKILL once the client has part of the answer (streamed) or once the engine has produced part
of it (not streamed). Completions and chat, streamed and not, token ids and logprobs asked. With
``continuation_max_moves: 0`` the router behaves as before: the stream ends with an error event. The
fleet's own move (``EngineWatch.move_off``, what a drain or a quarantine calls) moves a stream the same
way, and the record shows each move. Every wait is bounded; files only under ``tmp_path``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from launcher.engines.sim import SimEngine
from router import GenerationRouter
from router.continuation.spans import parse_header
from router.record.format import read_records
from tests.support.http_backends import router_factory
from tests.support.sim_processes import sim_processes

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_TOKENS = 300  # ~2 s per answer at the simulator's default 6 ms a step
KILL_AFTER = 40  # tokens the client (or the engine) has before the kill


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(continuation_max_moves=3) as make:  # the default, named
        yield make


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[list[SimEngine]]:
    with sim_processes(tmp_path) as made:
        yield made


def _body(path: str, stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "return_token_ids": True,
    }
    if path == CHAT:
        body |= {
            "messages": [{"role": "user", "content": "tell me a long story"}],
            "logprobs": True,
            "top_logprobs": 1,
        }
    else:
        body |= {"prompt": "a long story begins", "logprobs": 1}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body | extra


async def _running(http: aiohttp.ClientSession, engine: SimEngine) -> int:
    try:
        async with http.get(engine.url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
            text = await r.text()
    except aiohttp.ClientError:
        return 0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def _serving(http: aiohttp.ClientSession, engines: list[SimEngine]) -> SimEngine:
    """The engine that runs the one request in flight (bounded wait)."""
    for _ in range(200):
        for engine in engines:
            if await _running(http, engine):
                return engine
        await asyncio.sleep(0.01)
    raise AssertionError("no engine runs the request")


def _kill(engine: SimEngine) -> None:
    assert engine.pid is not None
    os.killpg(engine.pid, signal.SIGKILL)


class Streamed:
    """A streamed answer as the client reads it."""

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.errors: list[bytes] = []
        self.done = 0
        self.headers: dict[str, str] = {}

    def tokens(self) -> list[int]:
        return [t for c in self.chunks for ch in c["choices"] for t in ch.get("token_ids") or ()]

    def text(self, chat: bool) -> str:
        key = (lambda ch: ch["delta"].get("content") or "") if chat else (lambda ch: ch["text"])
        return "".join(key(ch) for c in self.chunks for ch in c["choices"])

    def logprobs(self, chat: bool) -> list[Any]:
        out: list[Any] = []
        for c in self.chunks:
            for ch in c["choices"]:
                lp = ch.get("logprobs")
                if lp:
                    if chat:
                        out += lp["content"]
                    else:
                        out += list(zip(lp["tokens"], lp["token_logprobs"], lp["text_offset"], strict=True))
        return out

    def usage(self) -> list[dict[str, Any]]:
        return [c["usage"] for c in self.chunks if c.get("usage")]


async def _stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], on_tokens: Callable[[int], Any] | None = None
) -> Streamed:
    out = Streamed()
    fired = False
    async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
        assert r.status == 200, await r.text()
        out.headers = dict(r.headers)
        buf = b""
        async for data in r.content.iter_any():
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"event: error"):
                    out.errors.append(event)
                    continue
                payload = event.removeprefix(b"data: ")
                if payload == b"[DONE]":
                    out.done += 1
                    continue
                out.chunks.append(orjson.loads(payload))
            if on_tokens is not None and not fired and len(out.tokens()) >= KILL_AFTER:
                fired = True
                await on_tokens(len(out.tokens()))
    return out


def _comparable(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer less its id and time, and the usage's cache figure (the first part's, lost with it)."""
    usage = {k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"}
    return {k: v for k, v in answer.items() if k not in ("id", "created")} | {"usage": usage}


@pytest.mark.parametrize(("path", "workers"), [(COMPLETIONS, 1), (CHAT, 1), (COMPLETIONS, 2)])
async def test_a_stream_goes_on_after_its_engine_is_killed(
    path: str,
    workers: int,
    engines: list[SimEngine],
    routers: Callable[..., GenerationRouter],
    http: aiohttp.ClientSession,
) -> None:
    """Also with two worker processes: each forwards (and continues) the requests it accepted."""
    router = routers([e.url for e in engines], workers=workers)
    url = router.base_url() + path
    chat = path == CHAT
    whole = await _stream(http, url, _body(path, True))
    assert len(whole.tokens()) == MAX_TOKENS and whole.done == 1 and not whole.errors

    killed: list[SimEngine] = []

    async def kill(_: int) -> None:
        engine = await _serving(http, engines)
        _kill(engine)
        killed.append(engine)

    cut = await _stream(http, url, _body(path, True), kill)
    assert killed, "the engine was not killed mid-stream"
    assert not cut.errors and cut.done == 1
    assert cut.tokens() == whole.tokens()
    assert cut.text(chat) == whole.text(chat)
    assert cut.logprobs(chat) == whole.logprobs(chat)
    assert len({c["id"] for c in cut.chunks}) == 1 and len({c["created"] for c in cut.chunks}) == 1
    (usage,) = cut.usage()  # counted once, the original prompt's
    (reference,) = whole.usage()
    assert {k: v for k, v in usage.items() if k != "prompt_tokens_details"} == {
        "prompt_tokens": reference["prompt_tokens"],
        "completion_tokens": MAX_TOKENS,
        "total_tokens": reference["prompt_tokens"] + MAX_TOKENS,
    }
    finish = [ch["finish_reason"] for c in cut.chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finish == ["length"]
    assert cut.chunks[0].get("prompt_token_ids") or cut.chunks[0]["choices"][0].get("prompt_token_ids")
    spans = cut.chunks[-1]["weight_versions"]
    assert [s[1:] for s in spans] == [[0, MAX_TOKENS - 1]]  # nothing stamped: one span, version unknown
    # a client that did not ask for token ids gets none (the router asked the engine for them)
    plain = await _stream(http, url, _body(path, True, return_token_ids=False))
    assert plain.text(chat) == whole.text(chat) and plain.done == 1
    assert not any("token_ids" in c or "prompt_token_ids" in c for c in plain.chunks)
    assert not any("token_ids" in ch or "prompt_token_ids" in ch for c in plain.chunks for ch in c["choices"])


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_a_whole_answer_goes_on_after_its_engine_is_killed(
    path: str,
    tmp_path: Path,
    engines: list[SimEngine],
    routers: Callable[..., GenerationRouter],
    http: aiohttp.ClientSession,
) -> None:
    record = tmp_path / "record"
    router = routers([e.url for e in engines], record_dir=str(record))
    url = router.base_url() + path
    async with http.post(url, json=_body(path, False)) as r:
        assert r.status == 200
        whole = orjson.loads(await r.read())
        assert parse_header(r.headers["x-rl-weight-versions"]) == [[None, 0, MAX_TOKENS - 1]]

    async def kill_later() -> SimEngine:
        engine = await _serving(http, engines)
        await asyncio.sleep(0.006 * KILL_AFTER * 2)  # part of the answer made
        _kill(engine)
        return engine

    killer = asyncio.ensure_future(kill_later())
    t0 = time.perf_counter()
    async with http.post(url, json=_body(path, False), timeout=aiohttp.ClientTimeout(total=60)) as r:
        assert r.status == 200, await r.text()
        cut = orjson.loads(await r.read())
    killed = await killer
    assert time.perf_counter() - t0 < 30
    assert _comparable(cut) == _comparable(whole)
    assert cut["usage"]["completion_tokens"] == MAX_TOKENS
    assert len(cut["choices"][0]["token_ids"]) == MAX_TOKENS
    router.stop()
    (move,) = _last_line(record)["moves"]  # continued from where it was, not retried from its start
    assert move["from"] == killed.url and move["reason"] == "reset" and 0 < move["at_token"] < MAX_TOKENS


async def test_without_continuation_a_killed_stream_ends_with_an_error(
    engines: list[SimEngine], routers: Callable[..., GenerationRouter], http: aiohttp.ClientSession
) -> None:
    """The behaviour before issue 41 (and with ``continuation_max_moves: 0``): the tokens are lost."""
    router = routers([e.url for e in engines], continuation_max_moves=0)

    async def kill(_: int) -> None:
        _kill(await _serving(http, engines))

    cut = await _stream(http, router.base_url() + COMPLETIONS, _body(COMPLETIONS, True), kill)
    assert cut.errors and not cut.done and len(cut.tokens()) < MAX_TOKENS


async def test_the_fleet_moves_a_stream_and_the_record_shows_it(
    tmp_path: Path,
    engines: list[SimEngine],
    routers: Callable[..., GenerationRouter],
    http: aiohttp.ClientSession,
) -> None:
    """``move_off`` (what a drain or a quarantine calls) moves the stream at once; the engine lives on."""
    record = tmp_path / "record"
    router = routers([e.url for e in engines], record_dir=str(record))
    url = router.base_url() + CHAT
    whole = await _stream(http, url, _body(CHAT, True))
    moved: list[str] = []

    async def drain(_: int) -> None:
        engine = await _serving(http, engines)
        loop = router._loop
        assert loop is not None
        done = asyncio.run_coroutine_threadsafe(_move_off(router, engine.url), loop)
        assert await asyncio.wrap_future(done) == 1
        moved.append(engine.url)

    cut = await _stream(http, url, _body(CHAT, True), drain)
    assert moved and not cut.errors and cut.done == 1
    assert cut.tokens() == whole.tokens() and cut.logprobs(True) == whole.logprobs(True)
    assert all(e.is_alive() for e in engines)
    router.stop()
    records = [r for r in read_records(str(record)).records if r.path == CHAT]
    assert len(records) == 2
    line = _last_line(record)
    (move,) = line["moves"]
    assert move["from"] == moved[0] and move["to"] != moved[0] and move["reason"] == "drained"
    assert KILL_AFTER <= move["at_token"] < MAX_TOKENS
    assert [s[1:] for s in line["weight_versions"]] == [[0, MAX_TOKENS - 1]]
    assert [a["engine"] for a in line["attempts"]] == [moved[0], move["to"]]


async def _move_off(router: GenerationRouter, url: str) -> int:
    return router.forwarder.engine_watch.move_off(url, "drained")


def _last_line(record: Path) -> dict[str, Any]:
    lines = [ln for f in sorted(record.glob("requests*.jsonl")) for ln in f.read_bytes().splitlines() if ln]
    return orjson.loads(lines[-1])  # type: ignore[no-any-return]


async def test_spans_start_where_a_refit_stamped_the_engine(
    engines: list[SimEngine], routers: Callable[..., GenerationRouter], http: aiohttp.ClientSession
) -> None:
    """A stamp while a stream runs (what a keep-mode refit ends with) starts a span at the token the
    router had then: the stream's last chunk, and a whole answer's header, say which version made which."""
    token = "admin-token-" + "c" * 24
    router = routers([e.url for e in engines], admin_token=token)
    base = router.base_url()
    auth = {"Authorization": f"Bearer {token}"}

    async def stamp(version: str) -> None:
        async with http.post(base + "/fleet/weight_version", json={"version": version}, headers=auth) as r:
            assert r.status == 200, await r.text()

    await stamp("v1")
    seen: list[int] = []

    async def refit(n: int) -> None:
        seen.append(n)
        await stamp("v2")
        seen.append(n)

    answer = await _stream(http, base + COMPLETIONS, _body(COMPLETIONS, True), refit)
    assert answer.done == 1 and not answer.errors and len(answer.tokens()) == MAX_TOKENS
    (v1, v2) = answer.chunks[-1]["weight_versions"]
    assert v1[0] == "v1" and v2[0] == "v2" and v1[1] == 0 and v2[2] == MAX_TOKENS - 1
    assert v1[2] + 1 == v2[1] and seen[0] <= v2[1] < MAX_TOKENS  # at or after what the client had
    async with http.post(base + COMPLETIONS, json=_body(COMPLETIONS, False)) as r:
        assert r.status == 200
        assert r.headers["x-rl-weight-versions"] == f"v2:0-{MAX_TOKENS - 1}"
        assert orjson.loads(await r.read())["weight_versions"] == [["v2", 0, MAX_TOKENS - 1]]


async def test_a_stream_with_no_engine_left_ends_with_an_error_not_a_short_answer(
    engines: list[SimEngine], routers: Callable[..., GenerationRouter], http: aiohttp.ClientSession
) -> None:
    """Both engines killed, one after the other: the second break finds no engine to move to, and the
    client gets the SSE error event after the tokens it had (never a [DONE] that would pass for a whole
    answer)."""
    router = routers([e.url for e in engines])
    killed: list[SimEngine] = []
    out = Streamed()

    async def kill_each(_: int) -> None:
        engine = await _serving(http, [e for e in engines if e not in killed])
        _kill(engine)
        killed.append(engine)

    async with http.post(
        router.base_url() + COMPLETIONS,
        json=_body(COMPLETIONS, True),
        timeout=aiohttp.ClientTimeout(total=60),
    ) as r:
        assert r.status == 200
        raw = b""
        async for data in r.content.iter_any():
            raw += data
            n = raw.count(b'"token_ids":[')
            if len(killed) < 2 and n >= KILL_AFTER * (len(killed) + 1):
                await kill_each(n)
    events = raw.split(b"\n\n")
    assert len(killed) == 2 and b"[DONE]" not in raw
    assert events[-2].startswith(b"event: error") and b"could not be continued" in events[-2]
    out.chunks = [orjson.loads(e.removeprefix(b"data: ")) for e in events[:-2] if e.startswith(b"data: {")]
    assert 2 * KILL_AFTER <= len(out.tokens()) < MAX_TOKENS


async def test_a_move_takes_back_tokens_whose_text_had_not_come(
    routers: Callable[..., GenerationRouter], http: aiohttp.ClientSession
) -> None:
    """vLLM streams ``""`` for the byte tokens of an unfinished character; a continuation cut after them
    would start with a wrong piece (the vLLM probe, 3). Two scripted engines: the first streams two
    settled tokens and one pending one, then dies; the router continues from the settled two, and the
    client never sees the pending one twice (nor the chunk that held it)."""
    from aiohttp import web

    bodies: list[dict[str, Any]] = []

    def chunk(ids: list[int], text: str, finish: str | None = None, prompt: list[int] | None = None) -> bytes:
        choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        choice |= {"stop_reason": None, "token_ids": ids}
        if prompt is not None:
            choice["prompt_token_ids"] = prompt
        event = {"id": f"cmpl-{len(bodies)}", "object": "text_completion", "created": 1, "model": "m"}
        return b"data: " + orjson.dumps(event | {"choices": [choice]}) + b"\n\n"

    async def generate(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if len(bodies) == 1:  # the first engine: dies after a pending token
            await resp.write(chunk([10], "ab", prompt=[1, 2]) + chunk([11], "cd") + chunk([12], ""))
            await asyncio.sleep(0.2)
            assert request.transport is not None
            request.transport.abort()
            return resp
        await resp.write(chunk([12, 13], "é", prompt=bodies[-1]["prompt"]) + chunk([14], "ef", "length"))
        usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
        await resp.write(b"data: " + orjson.dumps({"id": "x", "choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    runners = []
    urls = []
    for _ in range(2):
        app = web.Application()
        app.router.add_post(COMPLETIONS, generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    try:
        router = routers(urls, policy="round_robin")
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 5, "stream": True, "return_token_ids": True}
        got = await _stream(http, router.base_url() + COMPLETIONS, body)
    finally:
        for runner in runners:
            await runner.cleanup()
    assert bodies[1]["prompt"] == [1, 2, 10, 11] and bodies[1]["max_tokens"] == 3  # after the settled two
    assert got.tokens() == [10, 11, 12, 13, 14] and got.text(False) == "abcdéef"
    assert got.done == 1 and not got.errors
    assert all(ch["text"] for c in got.chunks for ch in c["choices"])  # the pending chunk never went out


async def test_a_request_that_breaks_a_second_engine_is_not_moved_again(
    tmp_path: Path, routers: Callable[..., GenerationRouter], http: aiohttp.ClientSession
) -> None:
    """Three engines, three moves allowed: the serving engine dies (the request moves), then the engine
    that went on dies too; the request is not moved to the third (a prompt that crashes engines would
    otherwise take ``1 + max_moves`` of them down, where a retry reaches two): the stream ends with the
    error event, the record shows the one move, and the third engine never saw the request."""
    with sim_processes(tmp_path, n=3) as engines:
        record = tmp_path / "record"
        router = routers([e.url for e in engines], record_dir=str(record))
        killed: list[SimEngine] = []

        async def kill_twice(_: int) -> None:
            first = await _serving(http, engines)
            _kill(first)
            second = await _serving(http, [e for e in engines if e is not first])
            await asyncio.sleep(0.1)  # it produces part of the rest
            _kill(second)
            killed.extend((first, second))

        cut = await _stream(http, router.base_url() + COMPLETIONS, _body(COMPLETIONS, True), kill_twice)
        assert len(killed) == 2
        assert cut.errors and b"broke the stream of 2 engines" in cut.errors[0], cut.errors
        assert KILL_AFTER <= len(cut.tokens()) < MAX_TOKENS
        (third,) = [e for e in engines if e not in killed]
        assert await _running(http, third) == 0
        async with http.get(router.base_url() + "/metrics") as r:
            moves = [ln for ln in (await r.text()).splitlines() if ln.startswith("rl_router_moves_total{")]
        assert len(moves) == 1 and moves[0].endswith(" 1.0"), moves  # the one move, by how it broke
        router.stop()
        line = _last_line(record)
        (move,) = line["moves"]
        assert move["from"] == killed[0].url and move["to"] == killed[1].url
        assert [a["engine"] for a in line["attempts"]] == [killed[0].url, killed[1].url]
