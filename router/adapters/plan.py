"""The fleet's LoRA plan: how many adapters its engines keep loaded and the largest rank they accept.

One plan, read by both sides of a process boundary: the launcher turns it into each vLLM engine's flags
(``engine_flags``) and the router refuses a load that does not fit it before anything reaches an engine.
Before a plan, the two could disagree, and vLLM's own answers are what a tenant then met at rollout time:
a rank above ``--max-lora-rank`` is a 500 from the engine's worker, and an adapter beyond
``--max-cpu-loras`` is silently evicted and reloaded from its directory on the next request (a directory
the trainer may have deleted since: a 404 or 500 in the middle of a step).

Why ``max_cpu_loras`` is twice ``max_adapters``: every adapter refit loads the new version under its own
name beside the old one (``router.adapters.names``), and the old one stays loaded until nothing in flight
uses it; so each adapter may need two slots for a while, and the engine must never evict a version a
request is still decoding on.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_ADAPTERS = 64
MAX_RANK = 512
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's ``--max-lora-rank`` choices (``vllm.config.lora.MaxLoRARanks``): another rank fails its start."""


class LoraPlan(BaseModel):
    """``generation.lora`` of a spec, as the router and the engines' flags read it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_adapters: int = Field(
        default=4,
        ge=1,
        le=MAX_ADAPTERS,
        description="adapters the fleet serves at once (each engine keeps every one loaded, and each may "
        "have two versions loaded during its refit); a load of one more is refused with the reason",
    )
    max_lora_rank: int = Field(
        default=16, ge=1, le=MAX_RANK, description="the largest LoRA rank an adapter may have"
    )
    max_loras: int | None = Field(
        default=None,
        ge=1,
        description="adapters one engine batch may mix (vLLM's --max-loras; default max_adapters): a "
        "smaller number saves memory, and requests of more adapters wait for a batch",
    )

    base_model: bool = Field(
        default=True,
        description="serve the base model to requests that name no adapter; false: such requests are "
        "refused (404), and adapters that adapt lm_head may be loaded on CPU engines, whose vLLM 0.32 "
        "build applies such an adapter's lm_head to requests of the base model",
    )

    @property
    def batch_loras(self) -> int:
        return self.max_loras or self.max_adapters

    @property
    def cpu_loras(self) -> int:
        """vLLM's ``--max-cpu-loras``: two versions of every adapter (module doc)."""
        return 2 * self.max_adapters

    def engine_flags(self) -> list[str]:
        """The vLLM flags of this plan (and the simulator's, which takes the same)."""
        return [
            "--enable-lora",
            "--max-loras",
            str(self.batch_loras),
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--max-cpu-loras",
            str(self.cpu_loras),
        ]


RUNTIME_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
"""What vLLM needs in its environment to serve ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(without it the routes are not mounted: a 404)."""
