"""Bench arms ``vllm-router[:POLICY]``: a fresh vllm-router process in front of a fresh cold simulated fleet.

The router is started with the same command line a job's managed vllm-router gets
(``launcher.gateways.vllm_router.command.router_command``) and the engines are registered the same way
(``POST /workers``, ``Registrar``), so the arm measures the front a job would run, not a hand-tuned one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import ValidationError

from launcher.engines.sim.local import sim_fleet
from launcher.gateways.vllm_router.admin import Registrar, VllmRouterAdmin
from launcher.gateways.vllm_router.command import VLLM_ROUTER_POLICIES, VllmRouterSection, router_command
from launcher.gateways.vllm_router.process import VllmRouterProcess
from router.ports import free_port

_REGISTER_TIMEOUT_S = 60.0


@contextlib.contextmanager
def vllm_router_arm(
    n_engines: int, option: str | None, sim_options: Mapping[str, Any], sim_process: bool
) -> Iterator[tuple[str, list[str]]]:
    """``option`` is vllm-router's policy (default ``cache_aware``); yields (router URL, engine URLs)."""
    try:
        section = VllmRouterSection(policy=option) if option else VllmRouterSection()
    except ValidationError:
        raise ValueError(
            f"vllm-router:{option}: not a vllm-router policy; "
            f"choose one of: {', '.join(VLLM_ROUTER_POLICIES)}"
        ) from None
    with sim_fleet(n_engines, sim_options, process=sim_process) as engines:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = router_command(host="127.0.0.1", port=port, metrics_port=free_port(), policy=section.policy)
        router = VllmRouterProcess(command, url).start()
        try:
            Registrar(VllmRouterAdmin(url)).register_all(engines, timeout_s=_REGISTER_TIMEOUT_S)
            yield url, engines
        finally:
            router.stop()
