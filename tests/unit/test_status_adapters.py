"""The dashboard's adapter block: each tenant's adapter and version, an engine short, the served names."""

from __future__ import annotations

from launcher.status.adapters import adapters_text

E1, E2 = "http://127.0.0.1:1", "http://127.0.0.1:2"
VIEW = {
    "plan": {"max_adapters": 2, "max_lora_rank": 8},
    "adapters": {
        "policy-a": {
            "owner": "tenant-a",
            "version": "step-3",
            "current": {"engines": [E1, E2]},
            "draining": [{"version": "step-2", "in_flight": 3}],
            "requests": 120,
        },
        "policy-b": {"owner": "tenant-b", "version": "step-1", "current": {"engines": [E1]}, "requests": 4},
    },
    "engines": {E1: ["policy-a@step-2", "policy-a@step-3", "policy-b@step-1"], E2: ["policy-a@step-3"]},
    "active": {},
    "last": {"policy-b": {"version": "step-1", "phase": "done", "ok": False, "error": "E2: load failed"}},
}


def test_each_tenant_its_version_and_an_engine_short_are_shown() -> None:
    text = adapters_text(VIEW, engines=2)
    assert text is not None
    lines = text.plain.splitlines()
    assert lines[0] == "adapters 2/2 (rank <= 8)"
    assert "policy-a [tenant-a] 'step-3' on 2/2 engine(s)  draining step-2 (3 in flight)" in lines[1]
    assert "policy-b [tenant-b] 'step-1' on 1/2 engine(s)" in lines[2] and "E2: load failed" in lines[2]
    assert lines[3].strip() == f"{E1}: policy-a@step-2, policy-a@step-3, policy-b@step-1"
    assert adapters_text(None) is None
