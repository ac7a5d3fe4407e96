"""What the Ray Serve gateway deploys, derived once from the spec: a plain, picklable plan.

One module owns the shape the driver's process hands to the Serve replicas (``ServePlan``), so the
replica, the ingress and the gateway never disagree on a field. Everything here is pure (no Ray), so the
sizing rules are unit-tested without a cluster.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from launcher.engines import kinds as engine_kinds

# Requests a replica may hold per sequence slot of its engine: one running batch plus one waiting
# batch, so the engine's scheduler has the next requests at hand when sequences finish (no round trip
# through Serve's queue), and affinity survives a full batch instead of spilling to the fallback rank.
ONGOING_PER_SEQ = 2


@dataclass(frozen=True)
class ServePlan:
    """Everything a replica and the ingress need, sized from the spec."""

    num_replicas: int
    max_replicas_per_node: int
    max_ongoing_requests: int
    engine: dict[str, Any]
    """``EngineHostConfig`` fields (``launcher.engines.host``): the replica builds its engine with the same
    ``build_engine`` the engine hosts use, so a vLLM replica runs the very command a host would."""
    engine_overrides: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Engine fields replaced for the replica of that Serve rank (kept by its replacement): a mixed
    fleet, e.g. one real vLLM engine among simulated ones in CI, or a canary."""
    executor_args: list[str] = field(default_factory=list)
    local: bool = True
    """Engines bind loopback (local mode, the bench) or the node's own address (a cluster)."""
    routing: str = "power_of_two"
    """``power_of_two`` (Serve's default request router) or one of our policies' names."""
    policy_options: dict[str, Any] = field(default_factory=dict)
    max_attempts: int = 2
    backend_timeout_s: float = 300.0
    no_healthy_status: int = 409
    max_request_bytes: int = 64 * 1024 * 1024
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 10.0
    generation_nodes: tuple[str, ...] = ()
    """Hostnames replicas may run on (empty: anywhere in the Ray cluster)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def max_num_seqs(engine_kind: str, vllm_args: list[str], sim: dict[str, Any]) -> int:
    """The engine's batch size, by its kind (``EngineKind.max_num_seqs``): ``--max-num-seqs`` from
    vllm_args (either spelling), the simulator's ``max_num_seqs`` option, else the engine's own default."""
    return engine_kinds.engine_kind(engine_kind).max_num_seqs({"vllm_args": vllm_args, "sim": sim})


def replicas_per_node(gpus_per_node: int, tp: int, pp: int, engines_per_node: int) -> int:
    """``max_replicas_per_node``: GPUs per node // (TP x PP); at least 1 (an instance larger than a node
    takes one node's worth as its head and spans the rest through vLLM's Ray executor). Without GPUs
    (simulated or CPU engines) the spec's engines_per_node."""
    if gpus_per_node <= 0:
        return max(1, engines_per_node)
    return max(1, gpus_per_node // (tp * pp))


def executor_args(platform: str, tp: int, pp: int) -> list[str]:
    """The distributed-executor flag for one instance on ``platform`` ("cuda" or "cpu").

    On GPUs the instance's workers are Ray actors (``--distributed-executor-backend ray``), so an
    instance may span nodes and Ray places its workers. vLLM's CPU build refuses the Ray executor
    ("current platform cpu does not support ray") at TP=1 and silently falls back to ``mp`` above it,
    so on CPU the flag is left out and vLLM picks its own executor: the same code then runs TP=1
    replicas on a CPU-only machine."""
    if platform == "cpu":
        return []
    return ["--distributed-executor-backend", "ray"]
