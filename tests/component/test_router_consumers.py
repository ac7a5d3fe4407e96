"""A standing fleet shared by several jobs: the consumers file, consumer keys, weighted fair share, and the
per-consumer counts (``router.consumers``, ``router.state.fair_share``).

The file and the fair share alone first, then real routers on 127.0.0.1 (OS-chosen ports) in front of the
simulated engines, as one process and with two worker processes (the ``workers`` fixture): keys are checked
by whichever process accepts the connection, and the fair share and the counts live in the router's one
routing state, so the same figures must hold in both modes. Every loop is bounded in count and time; files
are written under ``tmp_path`` only.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from router import GenerationRouter
from router.consumers import (
    OWNER,
    ConsumerKeys,
    ConsumersFileError,
    add_admin_key,
    add_consumer,
    hash_key,
    new_key,
    read_consumers,
    remove_consumer,
)
from router.http.recording import completion_tokens
from router.prometheus import metric_by_label, parse_metrics
from router.state.fair_share import FairShare, FairShareRefused
from tests.support.http_backends import (
    router_factory,
    workers_fixture,  # noqa: F401 (the fixture)
)

ROOT = Path(__file__).resolve().parents[2]
OWNER_KEY = "owner-key-" + "x" * 20
ADMIN_TOKEN = "admin-token-" + "y" * 20
COMPLETIONS = "/v1/completions"
NO_HEALTHY = 409
# 6 ms per engine step at the fixture's speed 20, whatever the batch: N tokens take ~(N+1) x 6 ms
FIXED_STEPS = {"step_base_s": 0.12, "decode_seq_s": 0.0, "context_token_s": 0.0, "prefill_token_s": 0.0}


# -- the consumers file ----------------------------------------------------------------------------------
def test_file_holds_hashes_only_mode_0600_and_refuses_duplicates(tmp_path: Path) -> None:
    path = tmp_path / "fleet" / "consumers.json"
    key_a, key_b = new_key(), new_key()
    assert len(key_a) >= 43 and key_a != key_b
    add_consumer(path, "train-a", key_a, weight=3, job="job-1")
    add_consumer(path, "eval.b", key_b, admin=True)
    text = path.read_text()
    assert key_a not in text and key_b not in text and hash_key(key_a) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = json.loads(text)
    assert data["version"] == 1 and set(data["consumers"]) == {"train-a", "eval.b"}
    table = read_consumers(path)
    assert table["train-a"].weight == 3.0 and table["train-a"].job == "job-1" and not table["train-a"].admin
    assert table["eval.b"].admin and table["eval.b"].attached_at > 0
    with pytest.raises(ValueError, match="already registered"):
        add_consumer(path, "train-a", new_key())
    add_consumer(path, "train-a", key_b, weight=2, replace=True)
    assert read_consumers(path)["train-a"].key_sha256 == hash_key(key_b)
    for bad in ("", "has space", "owner", "a/b"):
        with pytest.raises(ValueError):
            add_consumer(path, bad, new_key())
    for weight in (0, -1, float("nan"), True):
        with pytest.raises(ValueError, match="weight"):
            add_consumer(path, "w", new_key(), weight=weight)  # type: ignore[arg-type]
    assert remove_consumer(path, "train-a") and not remove_consumer(path, "train-a")
    assert set(read_consumers(path)) == {"eval.b"}
    assert read_consumers(tmp_path / "missing.json") == {}
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # no temporary file left


def test_a_corrupt_or_other_version_file_is_one_line_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "consumers.json"
    for text, what in (
        ("{not json", "not JSON"),
        ('{"version": 2, "consumers": {}}', "not version 1"),
        ('{"version": 1, "consumers": {"a": {"key_sha256": "zz"}}}', "key_sha256"),
        ('{"version": 1, "consumers": {"a b": {}}}', "consumer name"),
    ):
        path.write_text(text)
        with pytest.raises(ConsumersFileError) as err:
            read_consumers(path)
        message = str(err.value)
        assert str(path) in message and what in message and "\n" not in message
        with pytest.raises(ConsumersFileError):  # the launcher must not overwrite what it cannot read
            add_consumer(path, "c", new_key())


def test_concurrent_add_from_several_processes_keeps_every_entry(tmp_path: Path) -> None:
    path = tmp_path / "consumers.json"
    n_procs, per_proc = 6, 5
    code = (
        "import sys\n"
        "from router.consumers import add_consumer, new_key\n"
        "for i in range(int(sys.argv[3])):\n"
        "    add_consumer(sys.argv[1], f'p{sys.argv[2]}-{i}', new_key())\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(path), str(p), str(per_proc)], cwd=ROOT)
        for p in range(n_procs)
    ]
    for proc in procs:
        assert proc.wait(timeout=60) == 0
    names = set(read_consumers(path))
    assert names == {f"p{p}-{i}" for p in range(n_procs) for i in range(per_proc)}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_consumer_keys_follow_the_file_and_keep_the_last_good_table(tmp_path: Path) -> None:
    path = tmp_path / "consumers.json"
    key = new_key()
    add_consumer(path, "a", key)
    keys = ConsumerKeys(path, reload_every_s=0.0)
    found = keys.lookup(key)
    assert found is not None and found.name == "a"
    assert keys.lookup("wrong") is None and keys.lookup(None) is None and keys.lookup("\udcff") is None
    other = new_key()
    add_consumer(path, "b", other)
    assert keys.lookup(other) is not None
    path.write_text("{broken")  # damaged: the last good table stays
    assert keys.lookup(key) is not None and keys.lookup(other) is not None
    path.unlink()  # gone: no consumers
    assert keys.lookup(key) is None
    add_consumer(path, "a", key)
    assert keys.lookup(key) is not None
    remove_consumer(path, "a")
    assert keys.lookup(key) is None
    # Checked at most every reload_every_s: a slow view sees the change only after its interval.
    slow = ConsumerKeys(path, reload_every_s=30.0)
    add_consumer(path, "late", key)
    assert slow.lookup(key) is None
    slow.refresh(force=True)
    assert slow.lookup(key) is not None
    path.write_text('{"version": 9}')
    with pytest.raises(ConsumersFileError, match="not version 1"):
        ConsumerKeys(path)  # at a router's start, a bad file is an error


# -- the fair share alone ------------------------------------------------------------------------------------
async def test_freed_slots_go_to_the_lowest_in_flight_per_weight() -> None:
    fair = FairShare(capacity=4, max_wait_s=5)
    for _ in range(4):
        assert fair.try_enter("a", 3.0)
    waiters = [
        asyncio.create_task(fair.enter(name, w)) for name, w in (("a", 3.0), ("b", 1.0)) for _ in range(4)
    ]
    await asyncio.sleep(0.01)
    assert fair.waiting == 8 and fair.in_flight == 4 and not any(t.done() for t in waiters)
    assert not fair.try_enter("c", 1.0)  # a newcomer never overtakes the waiters
    order = []
    for _ in range(4):  # a's requests end one by one; each slot goes to the lowest in in_flight / weight
        fair.finish("a", 5)
        order.append((fair.accounts["a"].in_flight, fair.accounts["b"].in_flight))
    # a 3/3 vs b 0/1: b; then a 2/3 vs b 1/1: a, each time
    assert order == [(3, 1)] * 4
    rows = fair.rows()
    assert rows["a"]["requests"] == 4 and rows["a"]["completion_tokens"] == 20 and rows["b"]["requests"] == 0
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in waiters) == 4
    # A cancelled waiter leaves the queue at once and holds nothing.
    pending = [t for t in waiters if not t.done()]
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    assert fair.waiting == 0 and fair.in_flight == 4
    # One not served in time is refused, naming the capacity.
    quick = FairShare(capacity=1, max_wait_s=0.05)
    assert quick.try_enter(OWNER, 1.0)
    with pytest.raises(FairShareRefused, match="capacity of 1"):
        await quick.enter("x", 1.0)
    assert quick.waiting == 0 and quick.rows()["x"]["refused"] == 1
    quick.finish(OWNER)
    assert quick.try_enter("x", 1.0)  # a free slot and nobody waiting: at once
    # Without a capacity: the ledger only, everything admitted at once.
    ledger = FairShare(capacity=None)
    assert all(ledger.try_enter("y", 1.0) for _ in range(1000)) and ledger.in_flight == 1000


def test_usage_is_read_from_the_end_of_an_answer() -> None:
    body = b'{"choices":[{"text":"\\"completion_tokens\\": 99"}],'
    body += b'"usage":{"prompt_tokens":3,"completion_tokens": 17}}'
    assert completion_tokens(body) == 17
    sse = b'data: {"choices":[],"usage":{"completion_tokens":9}}\n\ndata: [DONE]\n\n'
    assert completion_tokens(sse) == 9
    assert completion_tokens(b'data: {"text": "completion_tokens"}\n\n') == 0
    assert completion_tokens(b"") == 0


# -- through the router --------------------------------------------------------------------------------------
@pytest.fixture
def routers(workers: int) -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(
        policy="round_robin", probe_interval_s=0, api_key=OWNER_KEY, admin_token=ADMIN_TOKEN, workers=workers
    ) as make:
        yield make


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completion(max_tokens: int = 4, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "sim", "prompt": "hello fleet", "max_tokens": max_tokens}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


async def call(
    base: str, method: str, path: str, key: str | None, body: Any = None, timeout_s: float = 20
) -> tuple[int, Any]:
    """One request on a connection of its own (any worker may accept it): status and parsed body."""
    headers = bearer(key) if key is not None else {}
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True), timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as s:
        async with s.request(method, base + path, json=body, headers=headers) as r:
            raw = await r.read()
            return r.status, (orjson.loads(raw) if raw[:1] in (b"{", b"[") else raw)


async def until(check: Callable[[], Awaitable[bool]], what: str, within_s: float = 10.0) -> float:
    """Poll ``check`` until true; the seconds it took."""
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < within_s, f"not within {within_s:g} s: {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def consumers_view(base: str) -> dict[str, Any]:
    status, view = await call(base, "GET", "/fleet/consumers", ADMIN_TOKEN)
    assert status == 200, view
    return view  # type: ignore[no-any-return]


@pytest.fixture
async def keyed_sims(sims) -> list[Any]:  # type: ignore[no-untyped-def]
    """Two simulated engines that require the fleet owner's key, as a fleet's engines do: a consumer's key
    must never reach them (they would answer 401)."""
    return await sims(2, api_key=OWNER_KEY)  # type: ignore[no-any-return]


async def test_consumer_owner_and_admin_keys(keyed_sims, routers, tmp_path: Path) -> None:
    es = keyed_sims
    path = tmp_path / "consumers.json"
    plain, admin = new_key(), new_key()
    add_consumer(path, "plain", plain)
    add_consumer(path, "ops", admin, admin=True)
    base = routers([e.url + "/v1" for e in es], consumers_file=str(path)).base_url()

    for key in (plain, admin, OWNER_KEY):
        status, body = await call(base, "POST", COMPLETIONS, key, completion())
        assert status == 200 and body["usage"]["completion_tokens"] == 4, body
    for key in (None, "not-a-key", ADMIN_TOKEN + "x"):
        status, _ = await call(base, "POST", COMPLETIONS, key, completion())
        assert status == 401

    # A plain consumer on an admin route: 403 with what to do, and the fleet is not paused.
    status, body = await call(base, "POST", "/fleet/pause?mode=keep", plain)
    assert status == 403, body
    message = body["error"]["message"]
    assert "consumer plain may not call POST /fleet/pause" in message and "admin consumers" in message
    assert "\n" not in message and plain not in message
    status, body = await call(base, "GET", "/fleet/is_paused", ADMIN_TOKEN)
    assert status == 200 and body["result"]["router_paused"] is False, body
    status, _ = await call(base, "POST", "/fleet/pause?mode=keep", "not-a-key")
    assert status == 401
    # An admin consumer may pause and resume.
    status, body = await call(base, "POST", "/fleet/pause?mode=keep", admin)
    assert status == 200 and body["ok"], body
    status, body = await call(base, "GET", "/fleet/is_paused", admin)
    assert status == 200 and body["result"]["paused"] is True, body
    status, body = await call(base, "POST", "/fleet/resume", admin)
    assert status == 200 and body["ok"], body
    status, body = await call(base, "POST", COMPLETIONS, plain, completion())
    assert status == 200

    # Revoked: the key stops working within ~1 s in every process (each re-reads within 0.5 s). Timed by
    # when each request started, so a slow answer on a busy machine does not count against the router.
    assert remove_consumer(path, "plain")
    t0 = time.monotonic()
    refused_in_a_row = 0
    # Bounded by time, not only count: on a fast machine 200 unpaced requests finished inside the 1 s window
    # (CI, stop 26), before either worker's next re-read was due.
    for _ in range(1000):  # bounded; 4 refusals in a row on fresh connections (either worker) end it
        await asyncio.sleep(0.01)
        started = time.monotonic() - t0
        status, _ = await call(base, "POST", COMPLETIONS, plain, completion(1))
        if status == 200:
            assert started < 1.0, f"a request started {started:.2f} s after the removal was served"
            refused_in_a_row = 0
        else:
            assert status == 401
            refused_in_a_row += 1
            if refused_in_a_row == 4:
                break
        assert time.monotonic() - t0 < 10, "the removed consumer's key still works"
    assert refused_in_a_row == 4
    status, _ = await call(base, "POST", COMPLETIONS, admin, completion())
    assert status == 200  # the others keep working


async def run_consumers(
    base: str, clients: dict[str, tuple[str, int]], total: int, max_tokens: int, within_s: float = 30.0
) -> dict[str, int]:
    """Each consumer ``name: (key, concurrency)`` sends requests from ``concurrency`` loops at once until
    ``total`` requests have completed in all (or ``within_s``); returns completions per consumer."""
    done = {name: 0 for name in clients}
    stop = asyncio.Event()
    deadline = time.monotonic() + within_s

    async def loop(session: aiohttp.ClientSession, name: str, key: str) -> None:
        while not stop.is_set() and time.monotonic() < deadline:
            async with session.post(
                base + COMPLETIONS, json=completion(max_tokens), headers=bearer(key)
            ) as r:
                await r.read()
                assert r.status == 200, (r.status, await r.text())
            if stop.is_set():
                return  # completed after the window closed: not counted
            done[name] += 1
            if sum(done.values()) >= total:
                stop.set()

    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=within_s)
    ) as session:
        await asyncio.gather(
            *(loop(session, name, key) for name, (key, n) in clients.items() for _ in range(n))
        )
    assert sum(done.values()) >= total, f"only {done} completed within {within_s:g} s"
    return done


async def engines_busy(es: list[Any]) -> int:
    return sum(len(e.scheduler.running) + len(e.scheduler.waiting) for e in es)


@pytest.mark.parametrize(
    ("weights", "capacity", "low", "high"),
    [((1.0, 1.0), 4, 0.40, 0.60), ((3.0, 1.0), 4, 0.65, 0.85), ((1.0, 1.0), None, 0.70, 0.90)],
    ids=["equal-weights", "weights-3-1", "no-capacity"],
)
async def test_contending_consumers_share_by_weight(
    sims, routers, tmp_path: Path, weights, capacity, low, high
) -> None:
    """A has 4x B's concurrency (B's alone exceeds its share of the capacity, so it always has a request
    waiting); with the capacity shared by weight A's share of the completions is near
    weight_a / (weight_a + weight_b) whatever its concurrency, exact across worker processes, and the
    engines never hold more than the capacity. Without a capacity (the control) A gets its 4/5."""
    es = await sims(2, **FIXED_STEPS)  # ~55 ms per 8-token request: the slots, not the router, bound it
    path = tmp_path / "consumers.json"
    key_a, key_b = new_key(), new_key()
    add_consumer(path, "a", key_a, weight=weights[0])
    add_consumer(path, "b", key_b, weight=weights[1])
    base = routers(
        [e.url + "/v1" for e in es], consumers_file=str(path), fair_share_capacity=capacity
    ).base_url()
    peak = 0
    sampling = True

    async def sample() -> None:
        nonlocal peak
        while sampling:
            peak = max(peak, await engines_busy(es))
            await asyncio.sleep(0.002)

    sampler = asyncio.create_task(sample())
    try:
        done = await run_consumers(base, {"a": (key_a, 16), "b": (key_b, 4)}, total=200, max_tokens=8)
    finally:
        sampling = False
        await sampler
    share_a = done["a"] / (done["a"] + done["b"])
    print(f"weights {weights}: completions {done}, share of a {share_a:.3f}, peak engine load {peak}")
    assert low <= share_a <= high, (done, share_a)
    assert 0 < peak <= (capacity or 20)
    view = await consumers_view(base)
    assert view["capacity"] == capacity
    rows = view["consumers"]
    assert rows["a"]["requests"] >= done["a"] and rows["b"]["requests"] >= done["b"]
    assert rows["a"]["weight"] == weights[0] and rows["b"]["weight"] == weights[1]
    await until(lambda: _idle(base), "every slot given back")


async def _idle(base: str) -> bool:
    view = await consumers_view(base)
    return view["in_flight"] == 0 and view["waiting"] == 0


async def test_an_uncontended_consumer_uses_the_whole_capacity(sims, routers, tmp_path: Path) -> None:
    es = await sims(2, **FIXED_STEPS)
    path = tmp_path / "consumers.json"
    key = new_key()
    add_consumer(path, "alone", key, weight=0.5)
    base = routers([e.url + "/v1" for e in es], consumers_file=str(path), fair_share_capacity=6).base_url()
    peak = 0

    async def sample() -> None:
        nonlocal peak
        for _ in range(2000):  # bounded: ~4 s at most (each request holds its slot ~0.25 s)
            peak = max(peak, await engines_busy(es))
            await asyncio.sleep(0.002)
            if peak >= 6:
                return

    sampler = asyncio.create_task(sample())
    done = await run_consumers(base, {"alone": (key, 12)}, total=36, max_tokens=40)
    await sampler
    assert done["alone"] >= 36 and peak == 6


async def test_a_wait_past_the_bound_is_refused_and_a_gone_client_leaves_the_queue(
    sims, routers, tmp_path: Path
) -> None:
    es = await sims(1, **FIXED_STEPS)
    path = tmp_path / "consumers.json"
    key = new_key()
    add_consumer(path, "c", key)
    r = routers(
        [e.url + "/v1" for e in es],
        consumers_file=str(path),
        fair_share_capacity=1,
        fair_share_max_wait_s=0.3,
    )
    base = r.base_url()
    long = asyncio.create_task(call(base, "POST", COMPLETIONS, OWNER_KEY, completion(400)))  # ~2.5 s
    await until(lambda: _in_flight(base, 1), "the long request in flight")
    status, body = await call(base, "POST", COMPLETIONS, key, completion())
    assert status == NO_HEALTHY, body
    assert (
        "fair-share capacity of 1" in body["error"]["message"]
        and body["error"]["type"] == "fleet_at_capacity"
    )
    # A client that gives up while waiting leaves the queue at once (it holds no slot afterwards).
    with pytest.raises(TimeoutError):
        await call(base, "POST", COMPLETIONS, key, completion(), timeout_s=0.15)
    await until(lambda: _waiting(base, 0), "the gone client out of the queue", within_s=2)
    status, body = await long
    assert status == 200
    await until(lambda: _idle(base), "every slot given back")
    status, _ = await call(base, "POST", COMPLETIONS, key, completion())
    assert status == 200
    view = await consumers_view(base)
    assert view["consumers"]["c"]["refused"] == 1 and view["refused"] == 1


async def test_a_slot_granted_during_a_pause_waits_for_the_resume(sims, routers, tmp_path: Path) -> None:
    """The slot a waiting request gets while the fleet pauses (here: a pause that waits for the request in
    flight) is given back, and the request waits at the pause gate: nothing reaches an engine between a
    pause and its resume."""
    es = await sims(1, **FIXED_STEPS)
    path = tmp_path / "consumers.json"
    key = new_key()
    add_consumer(path, "c", key)
    base = routers([e.url + "/v1" for e in es], consumers_file=str(path), fair_share_capacity=1).base_url()
    first = asyncio.create_task(call(base, "POST", COMPLETIONS, key, completion(200)))  # ~1.2 s
    await until(lambda: _in_flight(base, 1), "the first request in flight")
    second = asyncio.create_task(call(base, "POST", COMPLETIONS, OWNER_KEY, completion()))
    await until(lambda: _waiting(base, 1), "the second waiting for a slot")
    status, body = await call(base, "POST", "/fleet/pause?mode=wait", ADMIN_TOKEN)
    assert status == 200 and body["ok"], body
    assert (await first)[0] == 200

    async def held_at_the_gate() -> bool:
        view = await consumers_view(base)
        _, paused = await call(base, "GET", "/fleet/is_paused", ADMIN_TOKEN)
        return view["in_flight"] == 0 and view["waiting"] == 0 and paused["result"]["held"] == 1

    await until(held_at_the_gate, "the second held at the pause gate, its slot given back", within_s=3)
    assert not second.done() and await engines_busy(es) == 0
    status, body = await call(base, "POST", "/fleet/resume", ADMIN_TOKEN)
    assert status == 200 and body["ok"], body
    assert (await second)[0] == 200
    await until(lambda: _idle(base), "every slot given back")
    rows = (await consumers_view(base))["consumers"]
    assert rows["c"]["requests"] == 1 and rows[OWNER]["requests"] == 1


async def _in_flight(base: str, n: int) -> bool:
    return int((await consumers_view(base))["in_flight"]) == n


async def _waiting(base: str, n: int) -> bool:
    return int((await consumers_view(base))["waiting"]) == n


async def test_metrics_and_the_consumers_view_count_requests_and_tokens(
    sims, routers, tmp_path: Path
) -> None:
    es = await sims(2)
    path = tmp_path / "consumers.json"
    key_a, key_b = new_key(), new_key()
    add_consumer(path, "team-a.train", key_a, weight=2)
    add_consumer(path, "b", key_b, admin=True)
    add_consumer(path, "idle", new_key())
    base = routers([e.url + "/v1" for e in es], consumers_file=str(path)).base_url()
    tokens = {"team-a.train": 0, "b": 0, OWNER: 0}
    sent = {"team-a.train": 0, "b": 0, OWNER: 0}
    plan = [("team-a.train", key_a, 5, False), ("team-a.train", key_a, 7, True), ("b", key_b, 3, True)]
    plan += [("b", key_b, 2, False), (OWNER, OWNER_KEY, 6, False)]
    for name, key, max_tokens, stream in plan * 2:
        status, body = await call(base, "POST", COMPLETIONS, key, completion(max_tokens, stream))
        assert status == 200
        if stream:  # the engine's own figure, from its last data chunk with usage
            chunks = [orjson.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: {")]
            reported = chunks[-1]["usage"]["completion_tokens"]
        else:
            reported = body["usage"]["completion_tokens"]
        assert reported == max_tokens
        tokens[name] += reported
        sent[name] += 1
    status, _ = await call(base, "POST", "/tokenize", key_a, {"model": "sim", "prompt": "x"})
    assert status == 200  # not a generation request: not counted

    view = await consumers_view(base)
    assert view["capacity"] is None
    rows = view["consumers"]
    for name in tokens:
        assert rows[name]["requests"] == sent[name] and rows[name]["completion_tokens"] == tokens[name], rows
        assert rows[name]["in_flight"] == 0 and rows[name]["waiting"] == 0
    assert rows["team-a.train"]["weight"] == 2 and rows["b"]["admin"] and not rows["team-a.train"]["admin"]
    assert rows["idle"]["requests"] == 0 and rows["idle"]["registered"]
    assert abs(sum(r["share"] for r in rows.values()) - 1.0) < 0.01
    assert abs(rows["team-a.train"]["share"] - 4 / 10) < 0.01
    status, _ = await call(base, "GET", "/fleet/consumers", key_a)
    assert status == 403  # an admin route: a plain consumer may not read it
    status, by_b = await call(base, "GET", "/fleet/consumers", key_b)
    assert status == 200 and by_b["consumers"]["b"]["requests"] == sent["b"]

    status, text = await call(base, "GET", "/fleet/metrics", ADMIN_TOKEN)  # the owner's (issue 38)
    assert status == 200
    m = parse_metrics(text.decode(), ("rl_router_consumer_",))
    assert metric_by_label(m, "rl_router_consumer_requests_total", "consumer") == {**sent, "idle": 0}
    assert metric_by_label(m, "rl_router_consumer_completion_tokens_total", "consumer") == {
        **tokens,
        "idle": 0,
    }
    assert set(metric_by_label(m, "rl_router_consumer_in_flight", "consumer").values()) == {0}
    assert set(metric_by_label(m, "rl_router_consumer_waiting", "consumer").values()) == {0}
    assert abs(metric_by_label(m, "rl_router_consumer_share", "consumer")["b"] - 4 / 10) < 0.01


async def test_without_a_consumers_file_nothing_changes(sims, routers, tmp_path: Path) -> None:
    es = await sims(1)
    r = routers([e.url + "/v1" for e in es])
    base = r.base_url()
    status, _ = await call(base, "POST", COMPLETIONS, OWNER_KEY, completion())
    assert status == 200
    status, _ = await call(base, "POST", COMPLETIONS, new_key(), completion())
    assert status == 401
    assert await consumers_view(base) == {"capacity": None, "consumers": {}}
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/metrics") as resp:
            assert "rl_router_consumer_" not in await resp.text()
    status, text = await call(base, "GET", "/fleet/metrics", ADMIN_TOKEN)
    assert status == 200 and "rl_router_consumer_" not in text.decode()
    assert r.fair is None and r.consumer_keys is None


def test_a_corrupt_consumers_file_stops_the_router_at_its_start(tmp_path: Path) -> None:
    path = tmp_path / "consumers.json"
    path.write_text('{"version": 1, "consumers": []}')
    with router_factory(probe_interval_s=0, api_key=OWNER_KEY) as make:
        with pytest.raises(ConsumersFileError, match=str(path)):
            make([], consumers_file=str(path))
    assert os.path.exists(path)


# -- who sees which consumer (issue 38, finding 7) ---------------------------------------------------------
async def test_a_tenants_admin_key_sees_its_own_consumer_row_only(sims, routers, tmp_path: Path) -> None:
    """Two tenants, each a client key and an admin key (as ``rl-launch`` registers an admin job): tenant
    B's admin key on ``GET /fleet/consumers`` gets B's row alone, with neither A's name nor its job
    path; the owner's admin token gets every row."""
    es = await sims(1)
    path = tmp_path / "consumers.json"
    keys = {name: (new_key(), new_key()) for name in ("lora-a", "lora-b")}
    for name, (client, admin) in keys.items():
        add_consumer(path, name, client, admin=True, job=f"/jobs/{name}-local-1")
        add_admin_key(path, name, admin, job=f"/jobs/{name}-local-1")
    base = routers([e.url + "/v1" for e in es], consumers_file=str(path)).base_url()
    for client, _ in keys.values():
        assert (await call(base, "POST", COMPLETIONS, client, completion()))[0] == 200
    status, by_b = await call(base, "GET", "/fleet/consumers", keys["lora-b"][1])
    print(f"\ntenant B's admin key on /fleet/consumers: {status} rows {sorted(by_b['consumers'])}")
    assert status == 200 and set(by_b["consumers"]) == {"lora-b"}, by_b
    assert by_b["consumers"]["lora-b"]["requests"] == 1
    assert "lora-a" not in orjson.dumps(by_b).decode()
    owner = await consumers_view(base)
    assert {"lora-a", "lora-b"} <= set(owner["consumers"])
    assert owner["consumers"]["lora-a"]["job"] == "/jobs/lora-a-local-1"


async def test_the_open_metrics_name_no_consumer(sims, routers, tmp_path: Path) -> None:
    """Any local user reads ``/metrics``: it names no consumer (no ``rl_router_consumer_*`` family); the
    per-consumer families are on ``GET /fleet/metrics``, the fleet owner's alone (an admin consumer's key
    is 403 there, no key 401)."""
    es = await sims(1)
    path = tmp_path / "consumers.json"
    plain, admin = new_key(), new_key()
    add_consumer(path, "sec-plain-local-1", plain)
    add_consumer(path, "sec-admin-local-2", admin, admin=True)
    base = routers([e.url + "/v1" for e in es], consumers_file=str(path)).base_url()
    for key in (plain, admin, OWNER_KEY):
        assert (await call(base, "POST", COMPLETIONS, key, completion()))[0] == 200
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    named = [line for line in text.splitlines() if "sec-plain" in line or "sec-admin" in line]
    print(f"\nopen /metrics lines naming a consumer: {len(named)} {named[:2]}")
    assert named == [] and "rl_router_consumer_" not in text
    assert "rl_router_requests_total" in text  # the rest is still there
    status, owners = await call(base, "GET", "/fleet/metrics", ADMIN_TOKEN)
    assert status == 200
    m = parse_metrics(owners.decode(), ("rl_router_",))
    assert metric_by_label(m, "rl_router_consumer_requests_total", "consumer") == {
        "sec-plain-local-1": 1,
        "sec-admin-local-2": 1,
        OWNER: 1,
    }
    assert "rl_router_requests_total" not in m  # the per-consumer families only
    assert (await call(base, "GET", "/fleet/metrics", admin))[0] == 403
    assert (await call(base, "GET", "/fleet/metrics", None))[0] == 401
