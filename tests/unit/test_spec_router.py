"""The spec's ``router:`` section is the router's own ``RouterSettings``: one validation, and what the
driver hands the router actor is built from it whole (``RouterConfig.from_settings``)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from launcher.spec import SpecError, load_resolved, load_snapshot
from router.config import RouterConfig


def _spec(tmp_path: Path, router: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            name: t
            cluster: local
            training: {command: "true"}
            generation: {engine: sim}
            router:
            """
        )
        + textwrap.indent(textwrap.dedent(router), "  ")
    )
    return path


def test_policy_options_reach_the_actor_config(tmp_path: Path) -> None:
    spec = load_resolved(
        _spec(
            tmp_path,
            """\
            policy: cache_aware
            policy_options: {load_slack: 5, byte_load_factor: 2.0}
            max_attempts: 3
            no_healthy_backend_status: 421
            """,
        )
    )
    config = RouterConfig.from_settings(
        spec.router, host="127.0.0.1", port=20001, api_key="k", admin_token="a", health_managed=True
    )
    assert config.policy_options == {"load_slack": 5, "byte_load_factor": 2.0}
    assert (config.max_attempts, config.no_healthy_backend_status, config.port) == (3, 421, 20001)
    assert config.health_managed is True
    assert config.admin_secret == "a"


def test_policy_option_errors_name_the_spec_line_and_key(tmp_path: Path) -> None:
    path = _spec(tmp_path, "policy: cache_aware\npolicy_options:\n  load_slak: 3\n")
    with pytest.raises(SpecError) as err:
        load_resolved(path)
    assert str(err.value) == (
        f"{path}:8: router.policy_options.load_slak: not an option of policy 'cache_aware' (its options: "
        "block_bytes, max_index_bytes, holders_per_block, load_factor, load_slack, max_prompt_bytes, "
        "byte_load_factor)"
    )
    path = _spec(tmp_path, "policy: cache_aware\npolicy_options: {load_slack: 0}\n")
    with pytest.raises(SpecError, match=r"router\.policy_options\.load_slack: cache_aware load_slack"):
        load_resolved(path)


def test_no_healthy_status_rule_is_the_routers(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"router\.no_healthy_backend_status: no_healthy_backend_status=503"):
        load_resolved(_spec(tmp_path, "no_healthy_backend_status: 503\n"))


def test_router_settings_survive_the_snapshot(tmp_path: Path) -> None:
    spec = load_resolved(_spec(tmp_path, "policy_options: {load_factor: 1.5}\nport_range: 21000-21099\n"))
    snapshot = tmp_path / "spec.resolved.yaml"
    snapshot.write_text(spec.to_yaml())
    again = load_snapshot(snapshot)
    assert again.router == spec.router
    assert again.router.port_range == (21000, 21099)
    assert again.router.policy_options == {"load_factor": 1.5}


def test_http_limits_are_router_settings_a_job_may_set(tmp_path: Path) -> None:
    spec = load_resolved(_spec(tmp_path, "http: {head_timeout_s: 5, max_client_connections: 20000}\n"))
    config = RouterConfig.from_settings(spec.router, host="127.0.0.1", port=20001, admin_token="a")
    assert (config.http.head_timeout_s, config.http.max_client_connections) == (5, 20000)
    assert config.http.keepalive_timeout_s == 75.0  # the rest keep their defaults
    snapshot = tmp_path / "spec.resolved.yaml"
    snapshot.write_text(spec.to_yaml())
    assert load_snapshot(snapshot).router.http == spec.router.http
    with pytest.raises(SpecError, match=r"router\.http: unknown HTTP limit 'head_timeout'; known: "):
        load_resolved(_spec(tmp_path, "http: {head_timeout: 5}\n"))
    with pytest.raises(SpecError, match=r"router\.http: HttpLimits\.head_timeout_s must be > 0, got 0"):
        load_resolved(_spec(tmp_path, "http: {head_timeout_s: 0}\n"))


def test_a_job_sets_the_router_worker_processes(tmp_path: Path) -> None:
    spec = load_resolved(_spec(tmp_path, "workers: 4\n"))
    config = RouterConfig.from_settings(
        spec.router, host="127.0.0.1", port=20001, health_managed=True, admin_token="a"
    )
    assert config.workers == 4
    assert (
        RouterConfig.from_settings(
            load_resolved(_spec(tmp_path, "policy: cache_aware\n")).router, admin_token="a"
        ).workers
        == 1
    )
    path = _spec(tmp_path, "workers: 0\n")
    with pytest.raises(SpecError) as err:
        load_resolved(path)
    assert str(err.value) == f"{path}:6: router.workers: must be >= 1 (got 0)"


def test_router_workers_belong_to_the_builtin_router_only(tmp_path: Path) -> None:
    path = _spec(tmp_path, "kind: ray-serve\nworkers: 2\n")
    with pytest.raises(SpecError, match=r"router\.workers: only for router\.kind: builtin") as err:
        load_resolved(path)
    assert "\n" not in str(err.value)
    assert load_resolved(_spec(tmp_path, "kind: ray-serve\n")).router.workers == 1
