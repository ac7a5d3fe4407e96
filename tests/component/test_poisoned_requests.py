"""A request that fails wherever it goes is the client's, not the engines' (issue 28, findings 2, 9, 10, 12).

The rule (``router.http.attribution``), then real routers on 127.0.0.1 (OS-chosen ports), as one process and
with two worker processes, in front of simulated engines or small aiohttp engines, with the fleet
controller's own judge (``launcher.fleet.FleetHealth``) fed each tick from the router's drained outcomes, as
the controller feeds it: a poisoned request is answered to its client and condemns no engine, while an
engine that fails what another engine serves is still condemned. Then the request record (every request a
line, bounded text) and the straddler list (bounded bytes). Every loop is bounded in count and time; files
are written under ``tmp_path`` only.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from launcher.fleet import EngineRecord, EngineState, FleetHealth, HealthPolicy, TickInput
from router import GenerationRouter
from router.consumers import add_consumer, new_key
from router.http.attribution import Blame, input_attributed, malformed_headers
from router.http.headers import MAX_REQUEST_ID_CHARS, valid_request_id
from router.prometheus import metric_by_label, parse_metrics
from router.record.draft import RecordDraft, minimal_line, record_line
from router.record.format import MINIMAL_FIELDS, TEXT_SHARE, read_records
from router.record.sink import build_lines
from router.state.versions import MAX_STRADDLER_ID_BYTES, MAX_STRADDLERS_LISTED, WeightVersions
from tests.support.http_backends import (
    FakeEngine,
    engine_factory,
    router_factory,
    workers_fixture,  # noqa: F401 (the fixture)
)

OWNER_KEY = "owner-key-" + "x" * 20
ADMIN_TOKEN = "admin-token-" + "y" * 20
COMPLETIONS = "/v1/completions"
MARKER = "POISON-7731"
# vLLM 0.32's answer to an unclassified exception (error_response.create_error_response), and to input it
# refuses (a VLLMValidationError / ValueError: 400, here sent with a 5xx status as a proxy in front might).
VLLM_500 = {"error": {"message": "boom", "type": "InternalServerError", "param": None, "code": 500}}
VLLM_BAD_INPUT = {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}}
# 6 ms per engine step at speed 20, whatever the batch (as tests/component/test_router_consumers.py)
FIXED_STEPS = {"step_base_s": 0.12, "decode_seq_s": 0.0, "context_token_s": 0.0, "prefill_token_s": 0.0}


# -- the rule alone ------------------------------------------------------------------------------------------
def test_held_failures_are_charged_only_once_another_engine_served() -> None:
    served = Blame()
    assert served.failed("a", "connect", False) is True  # the transport's: charged at once
    assert served.failed("b", "status", False) is False  # held
    assert served.answered(200) == [("b", "status")] and not served.poisoned()
    twice = Blame()
    assert not twice.failed("a", "status", False) and not twice.failed("b", "timeout", False)
    assert twice.poisoned()  # failed on two engines: the request's
    bad_input = Blame()
    assert not bad_input.failed("a", "status", False)
    assert bad_input.answered(400) == [] and not bad_input.poisoned()  # the next engine said the input is bad
    alone = Blame()
    assert not alone.failed("a", "timeout", False) and not alone.poisoned()  # no engine left: nobody's
    assert Blame().failed("a", "status", False, retried=False)  # retries configured off: one engine judges
    last = Blame()
    assert not last.failed("a", "status", False) and not last.failed("b", "status", False, retried=False)
    assert last.poisoned()  # the last attempt allowed failed too: still the request's
    blamed = Blame()
    assert not blamed.failed("a", "status", True) and blamed.poisoned()  # the engine blamed the input
    assert blamed.answered(200) == []


def test_what_an_engine_attributes_to_the_input() -> None:
    assert not input_attributed(500, orjson.dumps(VLLM_500))
    assert input_attributed(500, orjson.dumps(VLLM_BAD_INPUT))
    assert input_attributed(500, orjson.dumps({"error": {"type": "Unprocessable Entity", "code": 422}}))
    assert input_attributed(502, b'{"object": "error", "type": "BadRequestError", "code": 400}')  # older vLLM
    assert input_attributed(501, b"")  # NotImplementedError: the request asks what the engine lacks
    for body in (b"", b"<html>500</html>", b'{"error": "x"}', b"[1]", b'{"error": {"type": "BadReq'):
        assert not input_attributed(500, body)
    assert malformed_headers([(b"X-A", b"p\xff1")]) and malformed_headers([(b"X-A", b"a\x00b")])
    assert not malformed_headers([(b"X-A", b"plain\tvalue ~!")])


def test_request_ids_are_bounded_printable_ascii() -> None:
    assert valid_request_id("a" * MAX_REQUEST_ID_CHARS) and valid_request_id("rid-7 with space")
    for bad in ("", "a" * (MAX_REQUEST_ID_CHARS + 1), "p\udcff1", "é", "a\tb", "a\x7fb"):
        assert not valid_request_id(bad), bad


def test_straddler_ids_are_bounded_by_bytes_and_the_count_goes_on() -> None:
    v = WeightVersions()
    v.stamped("http://e:1", "v1")
    n = MAX_STRADDLERS_LISTED + 50
    for i in range(n):
        v.ended("http://e:1", "v0", f"{i:0128d}")  # the longest id the router keeps
    step = v.straddlers_since(0)
    ids = step["request_ids"]
    assert isinstance(ids, list) and step["count"] == n
    assert sum(map(len, ids)) <= MAX_STRADDLER_ID_BYTES < MAX_STRADDLERS_LISTED * 128
    assert len(ids) == MAX_STRADDLER_ID_BYTES // 128 and ids[-1] == f"{n - 1:0128d}"  # the latest kept
    mark = v.step_mark()
    v.ended("http://e:1", "v0", "again")
    assert v.straddlers_since(mark) == {"count": 1, "request_ids": ["again"]}


# -- the record: every request a line ----------------------------------------------------------------------
def _draft(**fields: Any) -> dict[str, Any]:
    d = RecordDraft("/v1/completions", time.perf_counter())
    d.read_body(b'{"prompt": "x", "max_tokens": 4}', None)
    d.id, d.status = "rid", 200
    for k, v in fields.items():
        setattr(d, k, v)
    return d.__dict__


def test_a_client_chosen_value_never_keeps_a_request_out_of_the_record() -> None:
    line = record_line(_draft(id="rid-\udcff\udcfe-nonutf8", consumer="plain"), 0.0)
    rec = orjson.loads(line)
    assert rec["id"] == "rid-??-nonutf8" and rec["consumer"] == "plain" and rec["status"] == 200
    big = _draft(id="rid-bigmax", status=400)
    big["end_bytes"] = b'{"prompt": "x", "max_tokens": ' + str(10**30).encode() + b"}"
    rec = orjson.loads(record_line(big, 0.0))
    assert rec["id"] == "rid-bigmax" and rec["max_tokens"] is None and rec["status"] == 400


def test_a_record_that_cannot_be_built_is_a_minimal_line_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broken = [_draft(id=f"broken-{i}", consumer="plain", tail=12345) for i in range(3)]  # a tail not bytes
    with caplog.at_level(logging.WARNING, logger="router.record"):
        lines, failed = build_lines(0.0, [*broken, _draft(id="fine")])
    assert failed == 0 and len(lines) == 4
    minimal = [orjson.loads(x) for x in lines[:3]]
    assert [m["id"] for m in minimal] == ["broken-0", "broken-1", "broken-2"]
    assert all(set(m) == {"v", *MINIMAL_FIELDS} and m["consumer"] == "plain" for m in minimal)
    assert orjson.loads(lines[3])["prompt_bytes"] > 0  # the good one is whole
    warned = [r for r in caplog.records if "could not build a record" in r.getMessage()]
    assert len(warned) <= 1 and not any(r.exc_info for r in caplog.records)  # once per kind, no traceback
    assert orjson.loads(minimal_line({"id": "\udcff", "status": "x"}, 0.0))["status"] == 0


def test_recorded_text_is_cut_to_a_share_of_a_file_and_marked(tmp_path: Path) -> None:
    prompt = b'{"prompt": "' + b"p" * 50_000 + b'", "max_tokens": 4}'
    answer = orjson.dumps({"choices": [{"text": "c" * 10_000}]})
    file_bytes = 64 * 1024
    limit = file_bytes // TEXT_SHARE
    rec = orjson.loads(record_line(_draft(prompt=prompt, answer=answer), 0.0, limit))
    text = rec["text"]
    assert text["truncated"] is True and len(text["prompt"]) == limit and text["completion"] == ""
    assert len(record_line(_draft(prompt=prompt, answer=answer), 0.0, limit)) < file_bytes
    short = orjson.loads(record_line(_draft(prompt=b"{}", answer=answer), 0.0, limit))["text"]
    assert short["truncated"] is True and short["completion"] == "c" * (limit - 2)  # the prompt took 2
    whole = orjson.loads(record_line(_draft(prompt=b"{}", answer=answer), 0.0, None))["text"]
    assert "truncated" not in whole and whole["completion"] == "c" * 10_000


# -- through the router --------------------------------------------------------------------------------------
class PoisonableEngine(FakeEngine):
    """A FakeEngine that answers a body holding ``MARKER`` with ``poison_status`` and ``poison_body`` (an
    engine that fails one request, whatever engine gets it), and every other like FakeEngine."""

    poison_status = 500
    poison_body: dict[str, Any] = VLLM_500

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if MARKER.encode() in body:
            self.requests.append((request.method, request.path, dict(request.headers)))
            return web.json_response(self.poison_body, status=self.poison_status)
        return await super().handle(request)


@pytest.fixture
async def poisonable() -> AsyncIterator[Callable[..., Any]]:
    async with engine_factory(PoisonableEngine, default_n=2) as make:
        yield make


@pytest.fixture
def routers(workers: int) -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(
        policy="round_robin",
        probe_interval_s=0,
        api_key=OWNER_KEY,
        admin_token=ADMIN_TOKEN,
        workers=workers,
        health_managed=True,
    ) as make:
        yield make


class Judge:
    """The fleet controller's judge of a router's engines: each ``tick`` probes pass (the engines are up)
    and the router's drained outcomes are the window, as ``launcher.fleet.controller`` feeds them."""

    def __init__(self, router: GenerationRouter, urls: list[str]) -> None:
        self.router = router
        self.now = 1000.0
        self.n = len(urls)
        engines = [EngineRecord(f"e{i}", "node0", u) for i, u in enumerate(urls)]
        self.fleet = FleetHealth(engines, HealthPolicy(), clock=lambda: self.now)
        self.windows: list[dict[str, tuple[int, int]]] = []
        self.restarted: list[str] = []

    def tick(self) -> None:
        self.now += 1.0
        outcomes = self.router.drain_backend_outcomes()
        self.windows.append(outcomes)
        probes: dict[str, bool] = dict.fromkeys(self.fleet.probe_targets().values(), True)
        self.restarted += self.fleet.observe(TickInput(probes=probes, outcomes=outcomes)).to_restart

    def states(self) -> list[EngineState]:
        return [self.fleet.state(f"e{i}") for i in range(self.n)]

    def failures(self) -> int:
        return sum(f for window in self.windows for _s, f in window.values())


def consumers(tmp_path: Path) -> tuple[str, str, str]:
    path = tmp_path / "consumers.json"
    plain, other = new_key(), new_key()
    add_consumer(path, "plain", plain)
    add_consumer(path, "other", other)
    return str(path), plain, other


async def call(
    base: str, key: str, body: Any, headers: dict[str, str] | None = None, timeout_s: float = 20
) -> tuple[int, Any, dict[str, str]]:
    """One request on a connection of its own (any worker may accept it)."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as s:
        sent = {"Authorization": f"Bearer {key}", **(headers or {})}
        async with s.post(base + COMPLETIONS, json=body, headers=sent) as r:
            raw = await r.read()
            return r.status, (orjson.loads(raw) if raw[:1] == b"{" else raw), dict(r.headers)


def raw_call(port: int, path: str, key: str | None, request_id: bytes) -> tuple[int, bytes, dict[str, str]]:
    """A POST whose ``X-Request-Id`` is exactly ``request_id``'s bytes (http.client sends a str header value
    as latin-1: one byte per character)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id.decode("latin-1")}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        conn.request("POST", path, body=orjson.dumps({"prompt": "hi", "max_tokens": 2}), headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


async def poisoned_counts(router: GenerationRouter) -> dict[str, float]:
    """``rl_router_consumer_poisoned_total`` by consumer. In worker mode read through the workers' own
    counts, which each worker sends after the failures it reported (one ordered channel): once a count
    is seen, the failures that came before it have reached the routing state."""
    headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}  # the per-consumer families are the owner's
    async with (
        aiohttp.ClientSession() as s,
        s.get(router.base_url() + "/fleet/metrics", headers=headers) as r,
    ):
        text = await r.text()
    return metric_by_label(parse_metrics(text), "rl_router_consumer_poisoned_total", "consumer")


async def test_forty_poisoned_requests_restart_no_engine(poisonable, routers, tmp_path: Path) -> None:
    """The finding's attack, with an engine 5xx that follows the request (as vLLM's 500 for an unclassified
    exception would): the consumer gets its 500s, no engine is charged, condemned or restarted, the other
    consumer keeps its 200s, and the poisoned requests are counted against the consumer that sent them."""
    es = await poisonable(2)
    path, plain, other = consumers(tmp_path)
    r = routers([e.api_url for e in es], consumers_file=path)
    judge = Judge(r, [e.api_url for e in es])
    base = r.base_url()
    statuses: dict[str, list[int]] = {"plain": [], "other": []}
    for i in range(40):
        status, body, _ = await call(base, plain, {"prompt": f"{MARKER} {i}", "max_tokens": 4})
        statuses["plain"].append(status)
        assert status != 500 or body["error"]["type"] == "backend_status", body
        if i % 4 == 3:
            status, _, _ = await call(base, other, {"prompt": f"fine {i}", "max_tokens": 4})
            statuses["other"].append(status)
            judge.tick()
    assert statuses == {"plain": [500] * 40, "other": [200] * 10}
    assert all(len(e.requests) >= 40 for e in es)  # every poisoned request met both engines
    deadline = time.monotonic() + 10
    while (counts := await poisoned_counts(r)) != {"plain": 40.0}:
        assert time.monotonic() < deadline, counts
        await asyncio.sleep(0.05)
    judge.tick()
    assert judge.failures() == 0, judge.windows
    assert judge.states() == [EngineState.HEALTHY] * 2 and judge.restarted == []
    assert sorted(r.serving_backends()) == sorted(e.url for e in es)


async def test_a_5xx_the_engine_blames_on_the_input_is_not_charged(
    poisonable, routers, tmp_path: Path
) -> None:
    """One engine answers the marked request 500 with vLLM's BadRequestError body; the other serves it.
    The client gets 200 (the retry), and the engine that blamed the input is not charged."""
    blaming, serving = await poisonable(2)
    blaming.poison_body = VLLM_BAD_INPUT
    serving.poison_status, serving.poison_body = 200, {"choices": [{"text": "ok"}]}
    path, plain, _ = consumers(tmp_path)
    r = routers([blaming.api_url, serving.api_url], consumers_file=path)
    judge = Judge(r, [blaming.api_url, serving.api_url])
    for i in range(12):
        status, _, _ = await call(r.base_url(), plain, {"prompt": f"{MARKER} {i}"})
        assert status == 200
    assert len(blaming.requests) >= 6  # round robin: it met about half of them first
    deadline = time.monotonic() + 10
    while sum(w.get(serving.url, (0, 0))[0] for w in judge.windows) < 12:  # every answer reached the state
        judge.tick()
        assert time.monotonic() < deadline, judge.windows
        await asyncio.sleep(0.05)
    assert judge.failures() == 0 and judge.states() == [EngineState.HEALTHY] * 2, judge.windows


async def test_a_broken_engine_is_still_condemned(sims, routers, tmp_path: Path) -> None:
    """An engine that 500s every request while the other serves them: the retries succeed, so its failures
    are its own, charged, and the judge condemns it (and only it)."""
    bad, good = await sims(2)
    await bad.set_fault({"mode": "error", "error_rate": 1.0})
    path, plain, _ = consumers(tmp_path)
    r = routers([bad.url + "/v1", good.url + "/v1"], consumers_file=path)
    judge = Judge(r, [bad.url + "/v1", good.url + "/v1"])
    for _tick in range(8):
        for i in range(8):
            status, _, _ = await call(r.base_url(), plain, {"prompt": f"hello {i}", "max_tokens": 2})
            assert status == 200
        await asyncio.sleep(0.1)  # worker mode: the last failures' frames reach the routing state
        judge.tick()
        if judge.restarted:
            break
    assert judge.restarted == ["e0"], judge.windows
    assert judge.fleet.state("e1") is EngineState.HEALTHY
    assert await poisoned_counts(r) == {}


async def test_requests_past_the_backend_timeout_on_every_engine_are_the_clients(
    sims, routers, tmp_path: Path
) -> None:
    """A request that outlives ``backend_timeout_s`` on both engines (real simulated engines, a long
    generation): answered 500 to its client, counted as poisoned, and the timeouts neither take a
    health-managed engine out of rotation nor reach the judge."""
    es = await sims(2, **FIXED_STEPS)
    path, plain, other = consumers(tmp_path)
    r = routers([e.url + "/v1" for e in es], consumers_file=path, backend_timeout_s=0.6)
    judge = Judge(r, [e.url + "/v1" for e in es])
    for _ in range(3):
        status, body, _ = await call(r.base_url(), plain, {"prompt": "long", "max_tokens": 400})
        assert status == 500 and body["error"]["type"] == "backend_timeout", body
        assert sorted(r.serving_backends()) == sorted(e.url for e in es)
    status, _, _ = await call(r.base_url(), other, {"prompt": "short", "max_tokens": 2})
    assert status == 200
    deadline = time.monotonic() + 10
    while (counts := await poisoned_counts(r)) != {"plain": 3.0}:
        assert time.monotonic() < deadline, counts
        await asyncio.sleep(0.05)
    judge.tick()
    assert judge.failures() == 0 and judge.states() == [EngineState.HEALTHY] * 2, judge.windows


async def test_non_utf8_request_ids_are_replaced_and_never_reach_the_engines(
    sims, routers, tmp_path: Path
) -> None:
    """The finding's own trigger (``X-Request-Id: p\\xff<n>``): the simulator refuses such an id with 400 as a
    careful engine would, and the router replaces it with its own id, so the 40 requests are served, listed
    and recorded under the router's id, and no engine is charged."""
    es = await sims(2)
    status, body, _ = await asyncio.to_thread(raw_call, es[0].port, COMPLETIONS, None, b"p\xff0")
    assert status == 400 and b"X-Request-Id" in body, body
    path, plain, _ = consumers(tmp_path)
    record = tmp_path / "record"
    r = routers([e.url + "/v1" for e in es], consumers_file=path, record_dir=str(record))
    judge = Judge(r, [e.url + "/v1" for e in es])
    ids = set()
    for i in range(40):
        status, body, headers = await asyncio.to_thread(raw_call, r.port, COMPLETIONS, plain, b"p\xff%d" % i)
        assert status == 200, body
        ids.add(headers["x-rl-request-id"])
        # Not forwarded: the engine named the request itself (vLLM's own id), not after the client's bytes.
        engine_id = orjson.loads(body)["id"]
        assert engine_id.startswith("cmpl-") and int(engine_id.removeprefix("cmpl-"), 16) >= 0, engine_id
    long_id = "L" * (MAX_REQUEST_ID_CHARS + 1)
    status, _, headers = await call(
        r.base_url(), plain, {"prompt": "x", "max_tokens": 2}, {"X-Request-Id": long_id}
    )
    assert status == 200 and headers["x-rl-request-id"] != long_id
    status, _, headers = await call(
        r.base_url(), plain, {"prompt": "x", "max_tokens": 2}, {"X-Request-Id": "mine-1"}
    )
    assert status == 200 and headers["x-rl-request-id"] == "mine-1"  # a valid one is kept
    assert len(ids) == 40 and all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
    judge.tick()
    assert judge.failures() == 0 and judge.states() == [EngineState.HEALTHY] * 2
    await asyncio.get_running_loop().run_in_executor(None, r.stop)  # its record flushed
    recorded = {rec.id for rec in read_records(record).records}
    assert ids | {headers["x-rl-request-id"]} <= recorded
