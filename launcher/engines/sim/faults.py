"""Fault modes a simulated engine can be put in, each mimicking a way real vLLM engines fail.

Set at construction (``SimServer(fault=...)``, ``--fault`` on the command line), from Python
(``SimServer.set_fault``, ``SimFleet.set_fault``) or over HTTP: ``POST /sim/fault`` with a JSON body
such as ``{"mode": "error", "error_rate": 0.3}``. Exact behaviour:

``none``
    Normal service. Leaving ``wedge`` resumes the stalled requests; leaving ``kill`` binds the same
    port again with an empty KV cache (a restarted engine), so clients see refusals end.
``kill`` (the process died)
    The listening socket is closed (new connections are refused) and every open connection is reset
    (TCP RST), in-flight requests included: streams end abruptly, non-streaming calls get a reset,
    never a clean error. Every request is aborted and the prefix cache emptied. ``revive_after_s``
    brings it back after that many seconds (an engine restart); otherwise only ``set_fault("none")``
    from Python does, since ``/sim/fault`` itself is unreachable while killed. When set over HTTP, the
    admin request still gets its 200 (``Connection: close``) before its own connection closes.
``wedge`` (a hung GPU or NCCL collective)
    Connections are accepted and request headers read, but nothing answers: generation routes,
    ``/tokenize``, ``/v1/models`` and, with ``wedge_health`` (default true), ``/health`` and
    ``/metrics`` too, so only a client timeout ends them. In-flight requests stop producing tokens
    (streams stall mid-way). ``wedge_health=false`` is the nastier variant where the liveness probe
    still answers 200 while generation hangs (vLLM's ``/health`` only checks that the engine process
    is alive), so a router that trusts ``/health`` keeps sending work into the hole. ``/sim/*``
    admin routes always answer, so a wedge can be lifted over HTTP.
``slow`` (thermal throttling, a noisy neighbour, a degraded link)
    Every step takes ``slow_factor`` times as long; everything else is normal.
``error`` (an engine raising on requests)
    Each generation request (``/v1/chat/completions``, ``/v1/completions``) answers, on arrival and
    with probability ``error_rate`` (seeded dice, so runs repeat), 500 with an OpenAI-style JSON body
    ``{"error": {"message", "type": "InternalServerError", "param", "code": 500}}``. Other routes and
    the remaining requests are served normally.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

FaultMode = Literal["none", "kill", "wedge", "slow", "error"]
FAULT_MODES: tuple[str, ...] = get_args(FaultMode)


@dataclass(frozen=True)
class FaultSpec:
    """A fault mode and its parameters (parameters of other modes are ignored)."""

    mode: FaultMode = "none"
    error_rate: float = 0.3
    """``error``: probability that a generation request answers 500."""
    slow_factor: float = 10.0
    """``slow``: multiplier on every step time."""
    wedge_health: bool = True
    """``wedge``: whether ``/health`` and ``/metrics`` hang too (true) or keep answering (false)."""
    revive_after_s: float | None = None
    """``kill``: come back (empty cache) after this many wall-clock seconds; None = stay down."""

    def __post_init__(self) -> None:
        if self.mode not in FAULT_MODES:
            raise ValueError(f"fault mode must be one of {FAULT_MODES}, got {self.mode!r}")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError("error_rate must be within [0, 1]")
        if self.slow_factor <= 0:
            raise ValueError("slow_factor must be > 0")
        if self.revive_after_s is not None and self.revive_after_s < 0:
            raise ValueError("revive_after_s must be >= 0")

    @classmethod
    def parse(cls, value: FaultSpec | str | Mapping[str, Any] | None, **overrides: Any) -> FaultSpec:
        """Accept a spec, a bare mode name or a JSON-like mapping; unknown keys are an error (a typo in
        a fault request must not silently inject nothing)."""
        if value is None:
            value = "none"
        if isinstance(value, FaultSpec):
            return cls(**{**asdict(value), **overrides}) if overrides else value
        if isinstance(value, str):
            return cls(mode=value, **overrides)  # type: ignore[arg-type]
        if not isinstance(value, Mapping):
            raise ValueError("fault must be a mode name or an object")
        known = {"mode", "error_rate", "slow_factor", "wedge_health", "revive_after_s"}
        unknown = set(value) - known
        if unknown:
            raise ValueError(f"unknown fault fields: {sorted(unknown)}")
        kwargs: dict[str, Any] = dict(value)
        try:
            if "error_rate" in kwargs:
                kwargs["error_rate"] = float(kwargs["error_rate"])
            if "slow_factor" in kwargs:
                kwargs["slow_factor"] = float(kwargs["slow_factor"])
            if kwargs.get("revive_after_s") is not None:
                kwargs["revive_after_s"] = float(kwargs["revive_after_s"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad fault parameter: {e}") from None
        if "wedge_health" in kwargs and not isinstance(kwargs["wedge_health"], bool):
            raise ValueError("wedge_health must be a boolean")
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
