"""``generation.engine: sim``: the simulator's settings (``generation.sim``: ``SimConfig`` fields and
``fault``), their rules, its label and command line (one ``python -m launcher.engines.sim`` per engine)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import Field

from launcher.engines.kind import (
    EngineKind,
    EngineSettings,
    GenerationFields,
    Placement,
    ResolvedGenerationFields,
)
from launcher.engines.sim.config import SimConfig
from launcher.engines.sim.faults import FaultSpec
from launcher.spec.errors import Issue

if TYPE_CHECKING:
    from launcher.engines.base import Engine
    from launcher.engines.host_config import EngineHostConfig


class SimSettings(EngineSettings):
    sim: dict[str, Any] = Field(default_factory=dict)
    """Simulator options: ``SimConfig`` fields, plus ``fault`` (``FaultSpec``)."""

    refused_elsewhere = {"sim": "simulator options need generation.engine: sim; remove them"}


_LORA_OPTIONS = frozenset(
    {"enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras", "allow_runtime_lora_updating"}
)
"""``SimConfig`` fields that ``generation.lora`` sets (``EngineHostConfig.lora_command``)."""


def _same_kind(value: Any, default: Any) -> bool:
    """Type check for a simulator option against its default: bools are not numbers, ints are floats."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(default, bool) and isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, int | float)
    return isinstance(value, type(default))


def sim_issues(sim: Mapping[str, Any]) -> list[Issue]:
    """Each simulator option checked against ``SimConfig`` (its name, its type, then the whole config)."""
    issues: list[Issue] = []
    fields = {f.name: f for f in dataclasses.fields(SimConfig)}
    known = sorted([*(f for f in fields if f != "model_name" and f not in _LORA_OPTIONS), "fault"])
    kwargs: dict[str, Any] = {}
    for key, value in sim.items():
        path = f"generation.sim.{key}"
        if key == "model_name":
            issues.append(
                Issue(path, "set generation.served_model_name instead (it names the model for Gym too)")
            )
        elif key in _LORA_OPTIONS:
            issues.append(Issue(path, "set generation.lora instead (the router reads it too)"))
        elif key == "fault":
            try:
                FaultSpec.parse(value)
            except (TypeError, ValueError) as exc:
                issues.append(Issue(path, f"{exc}"))
        elif key not in fields:
            hint = difflib.get_close_matches(str(key), known, n=1)
            # the did-you-mean, else the 26 names: the whole list after a good guess made a 400-character line
            said = f"did you mean {hint[0]!r}?" if hint else f"known: {', '.join(known)}"
            issues.append(Issue(path, f"unknown simulator option; {said}"))
        else:
            default = fields[key].default
            if not _same_kind(value, default):
                issues.append(Issue(path, f"must be of type {type(default).__name__} (got {value!r})"))
            else:
                kwargs[key] = value
    if not issues:
        try:
            SimConfig(**kwargs).validate()
        except ValueError as exc:
            issues.append(Issue("generation.sim", str(exc)))
    return issues


class SimKind(EngineKind):
    name = "sim"
    settings = (SimSettings,)
    runs_on = "CPU"
    uses_gpus = False
    serves_adapters = True  # vLLM's LoRA flags and routes, simulated (launcher.engines.sim.lora)
    default_served_name = SimConfig.model_name

    def rules(self, gen: GenerationFields, place: Placement) -> list[Issue]:
        return sim_issues(SimSettings.of(gen).sim)

    def label(self, gen: ResolvedGenerationFields) -> str:
        return f"{gen.num_engines} sim"

    def host_fields(self, gen: ResolvedGenerationFields, env: Mapping[str, str]) -> dict[str, Any]:
        from launcher.engines.sim.cli import options_to_flags

        return {"sim_args": options_to_flags(SimSettings.of(gen).sim)}

    def build(self, cfg: EngineHostConfig, gpus: list[str], api_key: str | None, log_path: str) -> Engine:
        from launcher.engines.base import EngineSpec
        from launcher.engines.sim.process import SimEngine

        lora_flags, lora_env = cfg.lora_command()  # vLLM's flags and env: the simulator takes the same
        spec = EngineSpec(
            model=cfg.served_name or cfg.model,
            host=cfg.host,
            api_key=api_key,
            extra_args=[*lora_flags, *cfg.sim_args],
            env={**cfg.env, **lora_env},
            log_path=log_path,
            startup_timeout_s=cfg.startup_timeout_s,
        )
        # One process per simulated engine, like vLLM, so one engine can die and be restarted alone.
        return SimEngine(spec, engines=1)

    def max_num_seqs(self, settings: Mapping[str, Any]) -> int:
        """The simulator's ``max_num_seqs`` option, else ``SimConfig``'s default."""
        sim = settings.get("sim") or {}
        return int(sim.get("max_num_seqs", SimConfig().max_num_seqs))


SIM = SimKind()
