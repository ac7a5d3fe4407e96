"""The adapter table and the one body change: who may call or change an adapter, which version a request
goes to, the plan's capacity, gates on an adapter's versions, and the model name replaced in place."""

from __future__ import annotations

import orjson
import pytest

from router.adapters.body import model_of, with_model
from router.adapters.names import served_name, split_served
from router.adapters.plan import LoraPlan
from router.adapters.table import (
    AdapterCapacity,
    AdapterForbidden,
    AdapterTable,
    AdapterUnavailable,
    new_version,
)
from router.consumers import OWNER
from router.state.versions import UnknownVersion, VersionWant

E1, E2 = "http://127.0.0.1:1", "http://127.0.0.1:2"


def table(max_adapters: int = 2) -> AdapterTable:
    t = AdapterTable(LoraPlan(max_adapters=max_adapters), lambda: {"pa": "tenant-a", "pb": "tenant-b"})
    t.rebuilt = True  # as the router's start leaves it (router.fleet.adapter_rebuild)
    return t


def stamped(t: AdapterTable, name: str, owner: str, version: str, engines: set[str]) -> None:
    v = new_version(name, version, f"/ckpt/{name}/{version}", 8)
    v.engines = set(engines)
    t.stamp(name, owner, v)


def test_served_names_are_one_per_version_and_split_back() -> None:
    assert served_name("policy-a", "step-3") == "policy-a@step-3"
    assert split_served("policy-a@step-3") == ("policy-a", "step-3")
    assert split_served("tiny") is None
    assert split_served("a@b@c") is None  # the adapter part may not hold the separator


def test_a_tenant_calls_its_own_adapter_and_is_refused_another_and_the_owner_calls_any() -> None:
    t = table()
    stamped(t, "pa", "tenant-a", "v1", {E1, E2})
    route = t.resolve("pa", "tenant-a")
    assert route is not None and route.served == "pa@v1" and route.target.engines == {E1, E2}
    with pytest.raises(AdapterForbidden, match="belongs to consumer 'tenant-a'"):
        t.resolve("pa", "tenant-b")
    with pytest.raises(AdapterForbidden):  # its served name is the same adapter
        t.resolve("pa@v1", "tenant-b")
    assert t.resolve("pa", OWNER) is not None
    assert t.resolve("tiny", "tenant-b") is None  # the base model: not the table's
    with pytest.raises(AdapterUnavailable, match="not loaded on this fleet yet"):
        t.resolve("pb", "tenant-b")  # reserved, not loaded: never passed on to a 404
    with pytest.raises(AdapterForbidden):
        t.resolve("pb", "tenant-a")


def test_only_the_owner_or_the_fleet_owner_changes_an_adapter() -> None:
    t = table()
    t.may_change("pa", "tenant-a")
    t.may_change("pa", OWNER)
    with pytest.raises(AdapterForbidden, match="may not load or unload"):
        t.may_change("pa", "tenant-b")
    t.may_change("free", "tenant-b")  # not reserved: whoever loads it first owns it
    stamped(t, "free", "tenant-b", "v1", {E1})
    with pytest.raises(AdapterForbidden):
        t.may_change("free", "tenant-a")


def test_a_new_adapter_beyond_the_plan_is_refused_with_the_reason_and_a_known_one_is_not() -> None:
    t = table(max_adapters=1)
    t.admit_new("pa")
    stamped(t, "pa", "tenant-a", "v1", {E1})
    t.admit_new("pa")  # a new version of a served adapter needs no new slot
    with pytest.raises(AdapterCapacity, match="max_adapters: 1"):
        t.admit_new("pb")


def test_a_new_version_drains_the_old_one_and_gates_read_the_adapters_versions() -> None:
    t = table()
    stamped(t, "pa", "tenant-a", "v1", {E1, E2})
    stamped(t, "pa", "tenant-a", "v2", {E1})  # E2 did not take v2: it keeps serving others
    route = t.resolve("pa", "tenant-a")
    assert route is not None and route.version == "v2" and route.target.engines == {E1}
    assert [d.version for d in t.adapters["pa"].draining] == ["v1"]
    assert t.served_on() == {E1: ["pa@v1", "pa@v2"], E2: ["pa@v1"]}
    at_least = t.satisfies(route, VersionWant("v1", at_least=True))
    assert at_least is not None and at_least.version == "v2"
    exact_old = t.satisfies(route, VersionWant("v1"))
    assert exact_old is not None and exact_old.version == "v1"  # still draining: served where it is
    with pytest.raises(UnknownVersion, match="no version 'v9'"):
        t.satisfies(route, VersionWant("v9"))
    t.pending["pa"] = "v3"
    assert t.satisfies(route, VersionWant("v3")) is None  # a refit is loading it: wait


def test_an_engine_that_left_gets_no_adapter_request_until_restored() -> None:
    t = table()
    stamped(t, "pa", "tenant-a", "v1", {E1, E2})
    t.engines_left(E2)
    route = t.resolve("pa", "tenant-a")
    assert route is not None and route.target.engines == {E1}
    t.engines_left(E1)
    with pytest.raises(AdapterUnavailable, match="no engine serving"):
        t.resolve("pa", "tenant-a")


def test_the_model_is_replaced_in_place_and_nothing_else_changes() -> None:
    body = b'{"model": "pa", "prompt": "say \\"model\\": \\"pa\\"", "max_tokens": 4, "temperature": 0.70}'
    out = with_model(body, "pa", "pa@v2")
    assert out == body.replace(b'"model": "pa"', b'"model": "pa@v2"', 1)
    assert model_of(out) == "pa@v2"
    nested = b'{"model":"pa","metadata":{"model":"pa"},"x":1.50}'
    again = with_model(nested, "pa", "pa@v2")  # twice in the body: parsed and written whole
    assert orjson.loads(again) == {"model": "pa@v2", "metadata": {"model": "pa"}, "x": 1.5}
    escaped = b'{"model":"p\\u0061","prompt":"x"}'
    assert model_of(escaped) == "pa" and model_of(with_model(escaped, "pa", "pa@v2")) == "pa@v2"
    assert model_of(b"") is None and model_of(b"[1]") is None and model_of(b"{bad") is None


def test_a_reserved_adapter_follows_its_reservation_to_a_resubmitted_job() -> None:
    """A consumer is a job: a trainer resubmitted after its job ended attaches under a new name, and the
    fleet's spec, which reserves the adapter for the job's name, hands it the adapter its last run
    trained; while nobody holds the reservation, only the fleet's owner may use it."""
    reserved = {"pa": "tenant-a-1"}
    t = AdapterTable(LoraPlan(), lambda: dict(reserved))
    t.rebuilt = True
    stamped(t, "pa", "tenant-a-1", "v1", {E1})
    del reserved["pa"]  # the job ended: its consumer entry (and reservation) revoked
    with pytest.raises(AdapterForbidden):
        t.resolve("pa", "tenant-a-2")
    reserved["pa"] = "tenant-a-2"  # resubmitted: the same job name, a new consumer
    assert t.resolve("pa", "tenant-a-2") is not None
    t.may_change("pa", "tenant-a-2")
    assert t.to_json()["adapters"]["pa"]["owner"] == "tenant-a-2"


def test_cache_affinity_is_keyed_by_adapter_version_and_prefix() -> None:
    """The same prompt for two adapters (or two versions) shares no KV on an engine (vLLM keys its prefix
    cache by the adapter's name), so the cache-aware policy must not send one after the other for a hit;
    the same adapter version and prompt continue to find each other."""
    from router.policies import make_policy
    from router.policies.base import LoadTracker, RouteRequest

    policy = make_policy("cache_aware")
    body = b'{"model": "pa", "messages": [{"role": "user", "content": "' + b"x" * 600 + b'"}]}'
    prepared = policy.prepare(RouteRequest("/v1/chat/completions", body))
    a1, a1_again = policy.scope(prepared, "pa@v1"), policy.scope(prepared, "pa@v1")
    b1, a2 = policy.scope(prepared, "pb@v1"), policy.scope(prepared, "pa@v2")
    assert a1.features == a1_again.features
    assert not set(a1.features) & set(b1.features) and not set(a1.features) & set(a2.features)  # type: ignore[arg-type]
    load = LoadTracker([E1, E2])
    first = policy.choose(a1, load)
    policy.commit(a1, first)
    load.acquire(first)
    assert policy.choose(a1_again, load) == first  # its own prefix: affinity
    assert policy.choose(b1, load) != first  # another adapter's: nothing cached for it there


def test_every_served_name_is_checked_against_its_owner_even_outside_the_table() -> None:
    """Security findings 2026-12-05 #1: a ``NAME@VERSION`` the table did not hold (a draining version of
    an unloaded adapter, any name while the table was empty) went to the engines as a base-model request."""
    t = table()
    with pytest.raises(AdapterForbidden, match="belongs to consumer 'tenant-a'"):
        t.resolve("pa@v1", "tenant-b")  # an empty table: the reservation still names its owner
    with pytest.raises(AdapterUnavailable, match="no adapter version 'free@v1'"):
        t.resolve("free@v1", "tenant-b")  # nobody's: not one of this fleet's, never passed on
    stamped(t, "free", "tenant-b", "v1", {E1})
    dropped = t.drop("free")  # unloaded: its version drains on the engines
    assert dropped is not None and t.names == {"free@v1": "tenant-b"}
    with pytest.raises(AdapterForbidden):
        t.resolve("free@v1", "tenant-a")
    with pytest.raises(AdapterUnavailable, match="not served now"):
        t.resolve("free@v1", "tenant-b")
    t.forget("free@v1")  # its engines unloaded it
    with pytest.raises(AdapterUnavailable, match="no adapter version"):
        t.resolve("free@v1", "tenant-a")
    assert t.resolve("tiny", "tenant-a") is None and t.resolve("free", "tenant-a") is None


def test_until_rebuilt_every_adapter_looking_name_is_refused() -> None:
    t = AdapterTable(LoraPlan(), lambda: {"pa": "tenant-a"})
    for model in ("pa", "pa@v1", "other@v1"):
        with pytest.raises(AdapterUnavailable, match="reading which adapters the engines hold"):
            t.resolve(model, "tenant-a")
    with pytest.raises(AdapterForbidden):
        t.resolve("pa@v1", "tenant-b")  # the reservation answers another tenant at once
    assert t.resolve("tiny", "tenant-a") is None and t.resolve("scratch", "tenant-b") is None


def test_a_reservation_holds_its_slot_against_unreserved_loads() -> None:
    """Security findings 2026-12-05 #5: tenant B's scratch adapter took the slot the spec reserved for A."""
    t = table(max_adapters=2)
    t.admit_new("pb")
    stamped(t, "pb", "tenant-b", "v1", {E1})
    with pytest.raises(AdapterCapacity, match="reserved for consumers, not loaded yet: pa"):
        t.admit_new("scratch")
    t.admit_new("pa")
    t.pending["pa"] = "v1"  # a first load in progress takes its slot too
    big = table(max_adapters=3)
    big.pending["x"] = "v1"
    with pytest.raises(AdapterCapacity):
        big.admit_new("y")  # x loading, pa and pb reserved: no room


def test_what_the_engines_hold_is_adopted_with_owners_from_the_reservations() -> None:
    from router.adapters.adoption import adopt

    t = AdapterTable(LoraPlan(max_adapters=3), lambda: {"pa": "tenant-a", "pb": "tenant-b"})
    listings = {
        E1: {"tiny": "/m", "pb@v1": "/b1", "pa@v1": "/a1", "pa@v2": "/a2", "scratch@v1": "/s1"},
        E2: {"tiny": "/m", "pa@v1": "/a1", "pa@v2": "/a2", "pb@v1": "/elsewhere"},
    }
    stale = adopt(t, listings)
    t.rebuilt = True
    assert [v.served for v in stale] == ["pa@v1"]
    a = t.adapters["pa"]
    assert (a.owner, a.current and a.current.served, a.current and a.current.engines) == (
        "tenant-a",
        "pa@v2",
        {E1, E2},
    )
    assert t.adapters["pb"].current is not None and t.adapters["pb"].current.engines == {E1}  # E2: other dir
    assert t.adapters["scratch"].owner == OWNER  # unreserved: the fleet's owner's (fails closed)
    with pytest.raises(AdapterForbidden):
        t.resolve("pa@v1", "tenant-b")
    route = t.resolve("pa", "tenant-a")
    assert route is not None and route.served == "pa@v2"
    with pytest.raises(AdapterCapacity):
        t.admit_new("another")  # three held by the engines
    assert adopt(t, listings) == []  # known now: nothing adopted twice


def test_a_body_is_read_once_strictly() -> None:
    from router.adapters.body import UnreadableBody, requested_model

    assert requested_model(b'{"model": "pa@v1", "prompt": "x"}') == "pa@v1"
    assert requested_model(b'{"prompt": "x"}') is None and requested_model(b'{"model": null}') is None
    for body in (
        b'{"model": "pa@v1", "x": NaN}',  # json.loads (vLLM) reads these three; orjson does not
        b'\xef\xbb\xbf{"model": "pa@v1"}',
        b'{"model": "pa@v1", "user": "\\ud800"}',
        b"",
        b'["pa@v1"]',
        b'{"model": ["pa@v1"]}',
    ):
        with pytest.raises(UnreadableBody):
            requested_model(body)


def test_a_version_being_loaded_is_not_adopted_as_stale_from_a_rejoining_engine() -> None:
    from router.adapters.adoption import adopt

    t = table()
    stamped(t, "pa", "tenant-a", "v1", {E1, E2})
    t.pending["pa"] = "v2"
    t.names["pa@v2"] = "tenant-a"  # the refit's canary has it already
    assert adopt(t, {E2: {"tiny": "/m", "pa@v1": "/ckpt/pa/v1", "pa@v2": "/ckpt/pa/v2"}}) == []
    assert [d.version for d in t.adapters["pa"].draining] == []
