"""The front kinds, by the name the spec's ``router.kind`` gives (``GATEWAY_KINDS``).

Adding a front: a package ``launcher/gateways/<kind>/`` whose ``kind.py`` declares a ``FrontKind``
(``launcher.gateways.front``: its ``router:`` section, rules, label, what it has and does) naming its
``Gateway``, and one entry here. Nothing else names a kind: the spec, the driver, ``status``, the bench
and the CLI ask the declaration.
"""

from __future__ import annotations

from typing import Any

from launcher.gateways.builtin.kind import BUILTIN
from launcher.gateways.dynamo.kind import DYNAMO
from launcher.gateways.front import FrontKind
from launcher.gateways.ray_serve.kind import RAY_SERVE
from launcher.gateways.vllm_router.kind import VLLM_ROUTER
from launcher.spec.section import chosen_by

GATEWAY_KINDS: dict[str, FrontKind[Any]] = {
    kind.name: kind for kind in (BUILTIN, VLLM_ROUTER, DYNAMO, RAY_SERVE)
}
DEFAULT_GATEWAY_KIND = BUILTIN.name


class UnknownFront(ValueError):
    """A ``router.kind`` no front is registered under (a job directory from another version)."""


def front_kind(name: str) -> FrontKind[Any]:
    """The declaration of front kind ``name``; ``UnknownFront`` naming the known ones otherwise."""
    try:
        return GATEWAY_KINDS[name]
    except KeyError:
        known = ", ".join(GATEWAY_KINDS)
        raise UnknownFront(f"unknown router.kind {name!r}; choose one of: {known}") from None


def router_section_type() -> Any:
    """The type of the spec's ``router:`` section: one front's section, chosen by ``kind``."""
    return chosen_by(
        "kind", DEFAULT_GATEWAY_KIND, {name: kind.section for name, kind in GATEWAY_KINDS.items()}
    )
