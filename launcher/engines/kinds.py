"""The engine kinds, by the name the spec's ``generation.engine`` gives (``ENGINE_KINDS``).

Adding a kind: a package ``launcher/engines/<kind>/`` whose ``kind.py`` declares an ``EngineKind``
(``launcher.engines.kind``: its settings, rules, label, command line), and one entry here. Nothing else
names a kind: the spec, the engine host, the driver and Ray Serve's replicas ask the declaration.
"""

from __future__ import annotations

from launcher.engines.dynamo.kind import DYNAMO_MOCKER, DYNAMO_VLLM
from launcher.engines.kind import EngineKind, EngineSettings
from launcher.engines.sim.kind import SIM
from launcher.engines.vllm.kind import VLLM

ENGINE_KINDS: dict[str, EngineKind] = {kind.name: kind for kind in (VLLM, SIM, DYNAMO_VLLM, DYNAMO_MOCKER)}
DEFAULT_ENGINE_KIND = VLLM.name


def engine_kind(name: str) -> EngineKind:
    """The declaration of engine kind ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return ENGINE_KINDS[name]
    except KeyError:
        known = ", ".join(ENGINE_KINDS)
        raise ValueError(f"unknown engine kind {name!r} ({known})") from None


def engine_settings() -> tuple[type[EngineSettings], ...]:
    """Every kind's settings model, each once (``vllm_args`` is vLLM's and Dynamo's vLLM workers')."""
    return tuple(dict.fromkeys(model for kind in ENGINE_KINDS.values() for model in kind.settings))
