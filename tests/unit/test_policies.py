"""Routing policies as pure objects: affinity without headers, bounded load, bounded memory, fair ties."""

from __future__ import annotations

import random
import tracemalloc
from collections import Counter

import orjson
import pytest

from router.policies import (
    CacheAware,
    ConsistentHash,
    LeastOutstanding,
    LoadTracker,
    NoBackendAvailable,
    RoundRobin,
    RouteRequest,
    make_policy,
)
from router.policies.prefix_index import block_hashes, prompt_start

BACKENDS = [f"http://10.0.0.{i}:8000" for i in range(8)]
SYSTEM = "You are a coding agent. Tools: " + "".join(
    f'{{"name": "tool_{i}", "parameters": {{"type": "object", "properties": {{"arg": "string"}}}}}}'
    for i in range(60)
)


def chat_body(messages: list[dict[str, str]], **extra: object) -> bytes:
    # Gym's field order: model first, then messages, then sampling options
    return orjson.dumps({"model": "policy", "messages": messages, "max_tokens": 64, **extra})


def request(messages: list[dict[str, str]], **extra: object) -> RouteRequest:
    return RouteRequest(path="/v1/chat/completions", body=chat_body(messages, **extra))


def route(
    policy: CacheAware, req: RouteRequest, load: LoadTracker, exclude: frozenset[str] = frozenset()
) -> str:
    """What the router does per attempt that succeeds: choose, then commit the dispatch."""
    req = policy.prepare(req)
    url = policy.choose(req, load, exclude)
    policy.commit(req, url)
    return url


def test_load_tracker_matches_naive_model() -> None:
    rng = random.Random(1)
    load = LoadTracker(BACKENDS, rng=rng)
    naive = dict.fromkeys(BACKENDS, 0)
    for _ in range(5000):
        url = rng.choice(BACKENDS)
        if rng.random() < 0.55:
            load.acquire(url)
            naive[url] += 1
        elif naive[url]:
            load.release(url)
            naive[url] -= 1
        assert load.total_in_flight == sum(naive.values())
        assert load.min_in_flight == min(naive.values())
        assert naive[load.least_loaded()] == min(naive.values())
    load.set_backends([*BACKENDS[:3], "http://new:1"])
    assert load.backends == (*BACKENDS[:3], "http://new:1")
    assert load.total_in_flight == sum(naive[u] for u in BACKENDS[:3])
    with pytest.raises(NoBackendAvailable):
        LoadTracker([]).least_loaded()


def test_load_tracker_counts_bytes_in_flight() -> None:
    rng = random.Random(2)
    load = LoadTracker(BACKENDS, rng=rng)
    naive = {u: [] for u in BACKENDS}
    for _ in range(3000):
        url = rng.choice(BACKENDS)
        if rng.random() < 0.55:
            w = rng.randrange(1, 50_000)
            load.acquire(url, w)
            naive[url].append(w)
        elif naive[url]:
            load.release(url, naive[url].pop(rng.randrange(len(naive[url]))))
        assert load.bytes_in_flight(url) == sum(naive[url])
    assert load.total_bytes_in_flight == sum(sum(v) for v in naive.values())
    load.set_backends(BACKENDS[:2])  # bytes of backends that left leave the total
    assert load.total_bytes_in_flight == sum(naive[BACKENDS[0]]) + sum(naive[BACKENDS[1]])


def test_round_robin_cycles_and_skips_excluded() -> None:
    load = LoadTracker(BACKENDS[:3])
    rr = RoundRobin()
    req = RouteRequest("/v1/chat/completions")
    assert [rr.choose(req, load) for _ in range(6)] == BACKENDS[:3] * 2
    assert rr.choose(req, load, frozenset({BACKENDS[0]})) != BACKENDS[0]
    with pytest.raises(NoBackendAvailable):
        rr.choose(req, load, frozenset(BACKENDS[:3]))


def test_least_outstanding_breaks_ties_randomly() -> None:
    load = LoadTracker(BACKENDS, rng=random.Random(7))
    policy = LeastOutstanding()
    firsts = Counter(policy.choose(RouteRequest("/x"), load) for _ in range(400))
    assert len(firsts) == len(BACKENDS)  # not always the first in list order
    load.acquire(BACKENDS[0])
    assert all(policy.choose(RouteRequest("/x"), load) != BACKENDS[0] for _ in range(50))


def test_consistent_hash_sticks_and_moves_little_on_replacement() -> None:
    load = LoadTracker(BACKENDS)
    policy = ConsistentHash()
    sessions = [f"s{i}" for i in range(2000)]

    def place() -> dict[str, str]:
        return {
            s: policy.choose(RouteRequest("/v1/chat/completions", headers={"X-Session-ID": s}), load)
            for s in sessions
        }

    before = place()
    assert before == place()
    load.set_backends([*BACKENDS[:7], "http://10.0.0.99:9000"])  # one engine restarted on a new port
    after = place()
    moved = sum(before[s] != after[s] for s in sessions)
    # the retired engine's sessions move, and the newcomer takes its share: ~2/8, not a reshuffle
    assert moved < len(sessions) * 0.35
    kept = set(BACKENDS[:7])
    assert all(after[s] == before[s] for s in sessions if before[s] in kept and after[s] in kept)
    # no header: falls back to least loaded instead of one fixed engine
    spread = Counter(policy.choose(RouteRequest("/v1/chat/completions"), load) for _ in range(200))
    assert len(spread) > 4


def test_consistent_hash_header_is_configurable() -> None:
    policy = make_policy("consistent_hash", session_header="X-Episode")
    load = LoadTracker(BACKENDS)
    req = RouteRequest("/v1/chat/completions", headers={"x-episode": "ep-1"})
    assert len({policy.choose(req, load) for _ in range(20)}) == 1


def test_prompt_start_skips_fields_before_messages() -> None:
    a = orjson.dumps({"model": "m", "seed": 1, "messages": [{"role": "user", "content": "hi" * 300}]})
    b = orjson.dumps({"model": "m", "seed": 2, "messages": [{"role": "user", "content": "hi" * 300}]})
    assert block_hashes(a, 64, prompt_start(a)) == block_hashes(b, 64, prompt_start(b))
    escaped = orjson.dumps({"note": 'say "messages" here', "messages": []})
    assert escaped[prompt_start(escaped) - 1 : prompt_start(escaped)] == b","


def run_sessions(
    policy: CacheAware, n_sessions: int, turns: int, backends: list[str], seed: int = 0
) -> tuple[list[list[str]], list[int]]:
    """Sessions that resend their whole context each turn, all in flight together (RL rollouts).

    Returns the backend of every turn per session and the peak in-flight per backend.
    """
    rng = random.Random(seed)
    load = LoadTracker(backends, rng=random.Random(seed + 1))
    contexts = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"task {i}: {rng.random()}"}]
        for i in range(n_sessions)
    ]
    placement: list[list[str]] = [[] for _ in range(n_sessions)]
    peak = dict.fromkeys(backends, 0)
    for _turn in range(turns):
        order = list(range(n_sessions))
        rng.shuffle(order)
        chosen = {}
        for i in order:  # every session's turn is in flight at once
            url = route(policy, request(contexts[i]), load)
            load.acquire(url)
            peak[url] = max(peak[url], load.in_flight(url))
            chosen[i] = url
        for i in order:
            load.release(chosen[i])
            placement[i].append(chosen[i])
            contexts[i].append({"role": "assistant", "content": f"call tool {rng.random()}"})
            contexts[i].append({"role": "tool", "content": "output " * rng.randint(5, 200)})
    return placement, [peak[u] for u in backends]


def test_cache_aware_keeps_sessions_without_a_header() -> None:
    placement, _ = run_sessions(CacheAware(), n_sessions=64, turns=8, backends=BACKENDS)
    stays = sum(p[t] == p[t - 1] for p in placement for t in range(1, len(p)))
    total = sum(len(p) - 1 for p in placement)
    # lockstep turns are the worst case for a load bound (every engine refills from zero each turn)
    assert stays / total >= 0.9, f"only {stays}/{total} turns stayed on their engine"
    per_engine = Counter(u for p in placement for u in p)
    assert len(per_engine) == len(BACKENDS)


def test_cache_aware_shared_prefix_flood_does_not_pile_on_one_engine() -> None:
    policy = CacheAware()
    load = LoadTracker(BACKENDS, rng=random.Random(3))
    for i in range(1000):  # identical long system prompt, distinct short task, nothing completes
        url = route(
            policy,
            request([{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(i)}]),
            load,
        )
        load.acquire(url)
        cap = policy.load_cap(load)
        assert load.in_flight(url) <= cap
    counts = load.snapshot().values()
    assert max(counts) <= 1.25 * 1000 / len(BACKENDS) + policy.load_slack + 1
    assert min(counts) >= 0.75 * 1000 / len(BACKENDS)


def test_cache_aware_groups_identical_first_turns_within_the_bound() -> None:
    policy = CacheAware()
    load = LoadTracker(BACKENDS, rng=random.Random(5))
    for _ in range(40):  # 40 background requests spread the load
        load.acquire(load.least_loaded())
    group = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "the same GRPO prompt"}]
    placed = Counter()
    for _ in range(8):
        url = route(policy, request(group), load)
        load.acquire(url)
        placed[url] += 1
    assert placed.most_common(1)[0][1] >= 3  # the group shares one engine's cache...
    assert max(load.snapshot().values()) <= policy.load_cap(load)  # ...but never past the bound


def test_cache_aware_ties_are_not_list_order() -> None:
    firsts = Counter()
    for seed in range(40):
        policy = CacheAware()
        load = LoadTracker(BACKENDS, rng=random.Random(seed))
        firsts[route(policy, request([{"role": "user", "content": "x" * 2000}]), load)] += 1
    assert len(firsts) >= 5


def test_cache_aware_ignores_backends_that_left() -> None:
    policy = CacheAware()
    load = LoadTracker(BACKENDS)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task"}]
    first = route(policy, request(msgs), load)
    load.set_backends([u for u in BACKENDS if u != first])
    policy.on_backends_changed(load.backends)
    assert route(policy, request(msgs), load) != first
    assert route(policy, request(msgs), load, frozenset(load.backends[:3])) not in load.backends[:3]


def test_cache_aware_index_memory_is_capped_under_100k_sessions() -> None:
    cap_bytes = 8 * 1024 * 1024
    policy = CacheAware(max_index_bytes=cap_bytes)
    load = LoadTracker(BACKENDS)
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    for i in range(100_000):
        body = chat_body([{"role": "user", "content": f"session {i} " + "w" * 600}])
        route(policy, RouteRequest("/v1/chat/completions", body=body), load)
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert policy.index.approx_bytes <= cap_bytes
    assert policy.index.evictions > 0
    assert used - base <= cap_bytes * 1.5, f"index grew to {(used - base) / 2**20:.1f} MiB"


@pytest.mark.parametrize("byte_load_factor", [1.5, 0.0])
def test_cache_aware_byte_bound_moves_a_session_off_a_context_heavy_engine(byte_load_factor: float) -> None:
    # Equal request counts hide that one engine holds far more context than the others: a count bound
    # alone keeps the session there; the byte bound sends it to an engine with room.
    policy = CacheAware(byte_load_factor=byte_load_factor)
    load = LoadTracker(BACKENDS, rng=random.Random(7))
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "task 1"}]
    home = route(policy, request(turn1), load)
    for u in BACKENDS:  # the same count everywhere; the home engine's requests carry huge contexts
        for _ in range(3):
            load.acquire(u, 700_000 if u == home else 20_000)
    turn2 = [*turn1, {"role": "assistant", "content": "reply"}, {"role": "user", "content": "tool output"}]
    chosen = route(policy, request(turn2), load)
    if byte_load_factor:
        assert chosen != home
        assert load.bytes_in_flight(chosen) == 60_000
    else:
        assert chosen == home


def test_cache_aware_rejects_bad_options() -> None:
    with pytest.raises(ValueError, match="load_slack"):
        CacheAware(load_slack=0)
    with pytest.raises(ValueError, match="load_factor"):
        CacheAware(load_factor=0.5)
    with pytest.raises(ValueError, match="max_bytes"):
        CacheAware(max_index_bytes=10)
    with pytest.raises(ValueError, match="byte_load_factor"):
        CacheAware(byte_load_factor=0.5)


def test_cache_aware_spreads_new_sessions_that_share_only_the_system_prompt() -> None:
    # the peers' failure: every new session matches the system prompt on the first engine that saw it
    placement, _ = run_sessions(CacheAware(), n_sessions=len(BACKENDS), turns=4, backends=BACKENDS)
    homes = Counter(p[0] for p in placement)
    assert len(homes) == len(BACKENDS), f"sessions doubled up while engines idled: {homes}"


@pytest.mark.parametrize("dumps", ["orjson", "json"])
def test_cache_aware_follows_sessions_whatever_the_json_spacing(dumps: str) -> None:
    # Gym (aiohttp json=) and the OpenAI client serialise with json.dumps: "}, {" with a space
    import json

    encode = orjson.dumps if dumps == "orjson" else (lambda o: json.dumps(o).encode())
    policy = CacheAware()
    load = LoadTracker(BACKENDS[:2], rng=random.Random(1))
    messages = [{"role": "system", "content": SYSTEM}]
    homes = []
    for turn in range(5):
        messages.append({"role": "user", "content": f"turn {turn}: " + "what next? " * 80})
        body = encode({"model": "tiny", "messages": messages, "max_tokens": 8})
        homes.append(route(policy, RouteRequest("/v1/chat/completions", body=body), load))
        messages.append({"role": "assistant", "content": "}, {] noise " * 3})
    assert len(set(homes)) == 1, homes
    assert policy.decisions["affinity"] == 4
