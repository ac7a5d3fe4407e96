"""What an engine kind declares (``EngineKind``) and the settings it adds to the spec's ``generation:``
section (``EngineSettings``): the base of each engine kind's ``kind.py`` (``launcher/engines/<kind>/``).

The spec's ``generation:`` section stays flat (``generation.vllm_args``, ``generation.sim``: what users
write), so a kind's own fields are a small model that ``launcher.spec.schema`` folds into the section
(every kind's fields, the shared ones once); a field of another kind that is set is refused by the
spec's rules with the words its owner gives (``EngineSettings.refused_elsewhere``).

Why a declaration apart from the running ``Engine`` (``base``): the spec's rules, ``validate``'s labels
and the engine host's command line need to know what a kind is without importing vLLM's process code or
the simulator's servers; the process classes are imported only by ``build``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Self

from launcher.spec.errors import Issue
from launcher.spec.section import Section

if TYPE_CHECKING:
    from launcher.engines.base import Engine
    from launcher.engines.host_config import EngineHostConfig

OPENAI_API = "openai"
"""Engines that each serve the OpenAI API over HTTP (vLLM, the simulator): what most fronts route to."""


class GenerationFields(Protocol):
    """What a kind reads of the spec's ``generation:`` section, as written (``GenerationSection``) or
    resolved (``ResolvedGeneration``); a kind's own settings it reads through ``EngineSettings.of``."""

    @property
    def engine(self) -> str: ...
    @property
    def model(self) -> str | None: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def pipeline_parallel_size(self) -> int: ...


class ResolvedGenerationFields(GenerationFields, Protocol):
    """What a kind reads of the resolved ``generation`` (``launcher.spec.resolved.ResolvedGeneration``)."""

    @property
    def served_model_name(self) -> str: ...
    @property
    def num_engines(self) -> int: ...
    @property
    def gpus_per_engine(self) -> int: ...


class EngineSettings(Section):
    """Fields of ``generation:`` that one or more engine kinds own (``vllm_args`` for vLLM and Dynamo's
    vLLM workers, ``sim`` for the simulator)."""

    refused_elsewhere: ClassVar[dict[str, str]] = {}
    """``{field: message}``: a field set to anything but its default under an engine kind that does not
    own it is refused with this message (a field not listed here is left alone there)."""

    @classmethod
    def of(cls, gen: Any) -> Self:
        """This model's fields as the section holds them (already checked: nothing is validated again)."""
        return cls.model_construct(**{name: getattr(gen, name) for name in cls.model_fields})


@dataclass(frozen=True)
class Placement:
    """Where the engines run, for a kind's rules: the cluster, the GPUs of one generation node (0 with
    ``cluster: local``) and the spec field that sets them."""

    cluster: str
    gpus_per_node: int
    gpus_field: str


class EngineKind:
    """One engine kind: a class per kind, one instance in the registry (``launcher.engines.kinds``)."""

    name: ClassVar[str]
    settings: ClassVar[tuple[type[EngineSettings], ...]] = ()
    """The models of the ``generation:`` fields this kind owns."""
    refusals: ClassVar[dict[str, str]] = {}
    """This kind's own words for refusing another kind's field (overrides ``refused_elsewhere``)."""
    api: ClassVar[str] = OPENAI_API
    """How a front reaches the engines (``FrontKind.engine_api`` must match)."""
    reached_by: ClassVar[str] = "a front routing over HTTP"
    """``api`` in words, for the spec's error when the front does not match."""
    runs_on: ClassVar[str] = "GPUs"
    """Where its engines run, in a word, for the spec's hint naming the kinds a front can take."""
    uses_gpus: ClassVar[bool] = True
    """Whether each engine takes TP x PP GPUs of its node (the engine host splits them)."""
    spans_nodes_with_ray: ClassVar[bool] = False
    """Whether one instance may span nodes through Ray's executor (vLLM's ``--distributed-executor-backend
    ray``): a Ray Serve replica then passes it the executor flags (``ServePlan.executor_args``) and the
    Ray address."""
    serves_adapters: ClassVar[bool] = False
    """Whether its engines take ``generation.lora``: vLLM's LoRA flags and its runtime adapter routes
    (``/v1/load_lora_adapter``), through which the router loads adapters."""
    default_served_name: ClassVar[str] = ""
    """The model name clients send when the spec sets neither ``served_model_name`` nor ``model``."""

    def rules(self, gen: GenerationFields, place: Placement) -> list[Issue]:
        """Rules of this kind (a model it needs, GPUs it needs), each issue naming the field to change."""
        return []

    def label(self, gen: ResolvedGenerationFields) -> str:
        """The fleet in a few words, with its size (``4 sim``, ``8 vllm Qwen/Qwen3-8B (TP 2 ...)``)."""
        raise NotImplementedError

    def host_fields(self, gen: ResolvedGenerationFields, env: Mapping[str, str]) -> dict[str, Any]:
        """This kind's ``EngineHostConfig`` fields from its settings and the driver's environment ``env``
        (where the engines' interpreter is named)."""
        return {}

    def build(self, cfg: EngineHostConfig, gpus: list[str], api_key: str | None, log_path: str) -> Engine:
        """One engine of a host (a fresh object each time: a restart starts a new process on a new port,
        on the same ``gpus``)."""
        raise NotImplementedError

    def max_num_seqs(self, settings: Mapping[str, Any]) -> int:
        """The engine's batch size from this kind's settings (``{field: value}``), where a front that owns
        its engines sizes its queue by it (Ray Serve)."""
        raise NotImplementedError(f"{self.name} engines do not run behind a front that owns its engines")

    def cache_reset(self) -> tuple[str, bool]:
        """The route that flushes one engine's prefix cache, and whether it takes the job's API key."""
        from router.fleet.engine import VLLM_RESET_PATH

        return VLLM_RESET_PATH, True
