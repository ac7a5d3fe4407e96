"""``generation.lora`` and ``fleet.consumers.<job>.adapters``: the spec's rules (each refusal names the
field to change), the engines' command lines and environments built from the plan, and the plan reaching
the engine host's config and the router's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from launcher.engines.host_config import EngineHostConfig
from launcher.engines.sim.kind import SIM
from launcher.engines.vllm.kind import VLLM
from launcher.spec import SpecError, parse_spec
from router.adapters.plan import RUNTIME_LORA_ENV, LoraPlan
from router.config import RouterConfig


def job(**generation: Any) -> dict[str, Any]:
    """A local job of simulated engines with ``generation`` fields on top."""
    return {
        "name": "t",
        "cluster": "local",
        "training": {"command": "true"},
        "generation": {"engine": "sim", **generation},
    }


def fleet(consumers: dict[str, Any], **generation: Any) -> dict[str, Any]:
    """A local standing fleet of simulated engines with these consumers."""
    return {
        "name": "f",
        "cluster": "local",
        "generation": {"engine": "sim", **generation},
        "fleet": {"consumers": consumers},
    }


def issues(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    return {i.path: i.message for i in info.value.issues}


def test_a_plan_resolves_and_reaches_the_router_and_the_engines() -> None:
    r = parse_spec(job(lora={"max_adapters": 2, "max_lora_rank": 8})).resolved()
    assert r.generation.lora == LoraPlan(max_adapters=2, max_lora_rank=8)
    config = RouterConfig.from_settings(
        r.router, host="127.0.0.1", port=0, admin_token="t" * 32, lora=r.generation.lora
    )
    assert config.lora == r.generation.lora
    assert parse_spec(job()).resolved().generation.lora is None
    again = type(r).model_validate(yaml.safe_load(r.to_yaml()))  # the job's snapshot reads back
    assert again.generation.lora == r.generation.lora


def test_a_fleet_reserves_adapters_for_its_consumers() -> None:
    r = parse_spec(fleet({"a": {"adapters": ["x", "y.2"]}, "b": {}}, lora={})).resolved()
    assert r.fleet is not None
    assert r.fleet.consumer("a").adapters == ("x", "y.2")
    assert r.fleet.consumer("b").adapters == () and r.fleet.consumer("nobody").adapters == ()


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        (job(engine="vllm", model="m", lora={}, owner="launcher", elastic=None), None, None),
        (job(engine="dynamo-mocker", model="m", lora={}), "generation.lora", "vllm or sim"),
        (job(owner="trainer", lora={}), "generation.lora", "owner: launcher"),
        ({**job(lora={}), "router": {"kind": "vllm-router"}}, "router.kind", "router.kind: builtin"),
        ({**job(lora={}), "router": {"workers": 2}}, "router.workers", "lives in the router process"),
        (job(lora={"max_lora_rank": 12}), "generation.lora.max_lora_rank", "one of vLLM's"),
        (job(lora={"max_adapters": 1, "max_loras": 4}), "generation.lora.max_loras", "at most 2"),
        (job(lora={"max_adapters": 0}), "generation.lora.max_adapters", ">= 1"),
        (job(lora={"max_adapters": "2"}), "generation.lora.max_adapters", "integer"),
        (job(lora={"rank": 8}), "generation.lora.rank", ""),
        (job(sim={"enable_lora": True}), "generation.sim.enable_lora", "set generation.lora instead"),
        (
            job(engine="vllm", model="m", vllm_args=["--enable-lora"]),
            "generation.vllm_args",
            "generation.lora",
        ),
        (job(engine="vllm", model="m", vllm_args=["--max-lora-rank=64"]), "generation.vllm_args", "lora"),
        (job(engine="vllm", model="m", vllm_args=["--max-cpu-loras", "8"]), "generation.vllm_args", "lora"),
        (fleet({"a": {"adapters": ["x"]}}), "fleet.consumers.a.adapters", "needs generation.lora"),
        (
            fleet({"a": {"adapters": ["x"]}, "b": {"adapters": ["x"]}}, lora={}),
            "fleet.consumers.b.adapters",
            "'x' is already reserved for 'a'",
        ),
        (fleet({"a": {"adapters": ["x", "x"]}}, lora={}), "fleet.consumers.a.adapters", "listed twice"),
        (fleet({"a": {"adapters": ["no/slash"]}}, lora={}), "fleet.consumers.a.adapters", "1-128 characters"),
        (fleet({"a": {"adapters": ["x" * 129]}}, lora={}), "fleet.consumers.a.adapters", "1-128 characters"),
    ],
)
def test_the_rules_name_the_field(data: dict[str, Any], field: str | None, words: str | None) -> None:
    if field is None:
        parse_spec(data).resolved()  # vllm with a plan is fine
        return
    found = issues(data)
    assert field in found, found
    assert words in found[field], found[field]


def test_a_job_on_a_standing_fleet_takes_its_plan_from_the_fleet() -> None:
    data = job(lora={})
    data["generation"] = {"fleet": "f", "lora": {}}
    assert "generation.lora" in issues(data)


def host(lora: LoraPlan | None, **fields: Any) -> EngineHostConfig:
    return EngineHostConfig(
        kind="vllm",
        count=1,
        host="127.0.0.1",
        model="m",
        env={"USER_VAR": "1"},
        lora=lora.model_dump() if lora is not None else None,
        **fields,
    )


def test_vllm_takes_the_plans_flags_before_the_users_and_its_environment(tmp_path: Path) -> None:
    plan = LoraPlan(max_adapters=3, max_lora_rank=32, max_loras=2)
    cfg = host(plan, extra_args=["--max-model-len", "2048"], pipeline_parallel_size=2)
    engine: Any = VLLM.build(cfg, ["0"], None, str(tmp_path / "log"))
    assert engine.spec.extra_args == [
        "--pipeline-parallel-size", "2",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "6",
        "--max-model-len", "2048",
    ]  # fmt: skip
    assert engine.spec.env == {"USER_VAR": "1", **RUNTIME_LORA_ENV, "CUDA_VISIBLE_DEVICES": "0"}
    plain: Any = VLLM.build(host(None, extra_args=["--x"]), [], None, str(tmp_path / "log"))
    assert plain.spec.extra_args == ["--x"] and plain.spec.env == {"USER_VAR": "1"}


def test_the_simulator_takes_the_same_flags_and_environment(tmp_path: Path) -> None:
    plan = LoraPlan(max_adapters=2, max_lora_rank=8)
    cfg = host(plan, sim_args=["--speed", "10"])
    cfg.kind = "sim"
    engine: Any = SIM.build(cfg, [], None, str(tmp_path / "log"))
    assert engine.spec.extra_args == [*plan.engine_flags(), "--speed", "10"]
    assert engine.spec.env == {"USER_VAR": "1", **RUNTIME_LORA_ENV}
    # the flags parse as the simulator's own, into the config its LoRA routes read
    from launcher.engines.sim.cli import build_parser, config_from_args

    sim = config_from_args(build_parser().parse_args(engine.spec.extra_args))
    assert (sim.enable_lora, sim.max_loras, sim.max_lora_rank, sim.max_cpu_loras) == (True, 2, 8, 4)


def test_the_host_config_file_carries_the_plan(tmp_path: Path) -> None:
    plan = LoraPlan(max_adapters=2)
    host(plan).dump(tmp_path / "host.json")
    loaded = EngineHostConfig.load(tmp_path / "host.json")
    assert loaded.lora_command() == (plan.engine_flags(), RUNTIME_LORA_ENV)
    assert host(None).lora_command() == ([], {})
