"""Continuation is on by default where the engines can continue, off where they cannot (issue 41).

The builtin router over vLLM or simulated engines continues a request whose engine dies, drains, is
quarantined or restarts (``router.continuation_max_moves`` 3); ``0`` restores the byte-for-byte proxy.
Dynamo's key-checking front keeps it off whatever the default: its one backend is Dynamo's frontend,
which refuses the ``return_token_ids`` a continued request adds, and Dynamo migrates requests itself.
"""

from __future__ import annotations

from launcher.gateways.builtin.kind import BuiltinRouterSection
from launcher.gateways.dynamo.gateway import FRONT_SETTINGS
from router.config import RouterConfig, RouterSettings
from router.http.forwarding_config import ForwardingConfig


def _forwarding(settings: RouterSettings) -> ForwardingConfig:
    return ForwardingConfig.of(
        RouterConfig.from_settings(settings, host="127.0.0.1", port=0, insecure_admin=True)
    )


def test_the_builtin_router_continues_by_default_and_zero_turns_it_off() -> None:
    assert RouterSettings().continuation_max_moves == 3
    assert ForwardingConfig(1.0, 1.0, 409).continuation_max_moves == 3
    assert _forwarding(BuiltinRouterSection()).continuation_max_moves == 3  # a spec's router: section
    off = BuiltinRouterSection.model_validate({"continuation_max_moves": 0})
    assert _forwarding(off).continuation_max_moves == 0


def test_dynamos_key_checking_front_does_not_continue() -> None:
    assert _forwarding(RouterSettings(**FRONT_SETTINGS)).continuation_max_moves == 0
