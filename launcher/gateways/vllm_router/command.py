"""How rl-launch starts ``vllm-router`` (PyPI ``vllm-router`` 0.1.17): the spec's ``router.vllm_router``
section and the one command-line builder the managed gateway and the bench both use.

Why one builder: the bench's ``vllm-router:<policy>`` arms must measure the router exactly as a job runs
it (same short worker-startup check interval, same loopback metrics port); two copies of the flags would
drift. Why options are checked with vllm-router's own argument parser: its flags change between
releases, and a typo found by the parser at ``rl-launch validate`` costs nothing, while one found at
start costs a queue wait and an allocation.

This module must stay light (no Ray, no aiohttp): the spec loader imports it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

# ``vllm-router --help`` of 0.1.17: the names users already write in their own launch scripts.
VLLM_ROUTER_POLICIES = (
    "cache_aware",
    "consistent_hash",
    "round_robin",
    "random",
    "power_of_two",
    "kv_aware",
    "sticky_least_loaded",
)
DEFAULT_VLLM_ROUTER_POLICY = "cache_aware"

# vllm-router waits this long between its GET /health checks of a worker being registered (its default
# is 30 s: a restarted engine would sit out of rotation that long after it is ready).
DEFAULT_WORKER_STARTUP_CHECK_INTERVAL_S = 1

# Flags the launcher sets itself: a copy in ``options`` would fight it.
OWNED_OPTIONS: dict[str, str] = {
    "host": "the launcher binds vllm-router to the driver node's address",
    "port": "the launcher reserves the port from router.port_range",
    "policy": "set router.vllm_router.policy instead",
    "worker_urls": "the launcher registers the engines itself (POST /workers)",
    "prometheus_host": "the launcher binds the metrics port to 127.0.0.1",
    "prometheus_port": "the launcher reserves the metrics port",
    "api_key": "secrets never go on a command line; vllm-router passes the client's key to the engines",
    "service_discovery": "the fleet controller owns the worker set",
    "vllm_pd_disaggregation": "prefill/decode disaggregation is not supported by rl-launch",
    "mini_lb": "the debugging load balancer is not a production front",
}
_OPTION_RE = re.compile(r"[a-z][a-z0-9_]*")


class VllmRouterSection(BaseModel):
    """``router.vllm_router``: the managed vllm-router's policy and further options (vllm-router's own
    flag names with ``_``, e.g. ``balance_abs_threshold: 32`` for ``--balance-abs-threshold 32``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    policy: str = Field(default=DEFAULT_VLLM_ROUTER_POLICY, description="vllm-router's --policy")
    options: dict[str, bool | int | float | str | list[str]] = Field(
        default_factory=dict, description="further vllm-router flags, by name without '--' (use '_')"
    )

    @field_validator("policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        if v not in VLLM_ROUTER_POLICIES:
            raise ValueError(
                f"unknown vllm-router policy {v!r}; choose one of: {', '.join(VLLM_ROUTER_POLICIES)}"
            )
        return v

    @field_validator("options")
    @classmethod
    def _options(cls, v: dict[str, Any]) -> dict[str, Any]:
        for key in v:
            if key in OWNED_OPTIONS:
                raise ValueError(f"{key!r} is set by the launcher: {OWNED_OPTIONS[key]}")
            if not _OPTION_RE.fullmatch(key):
                raise ValueError(
                    f"{key!r} is not a vllm-router option name; write the flag without '--' and with '_', "
                    "e.g. balance_abs_threshold"
                )
        return v


PROGRAM = "vllm-router"
"""The vllm-router binary's name (PyPI's ``vllm-router`` installs it beside the interpreter)."""


def option_flags(options: Mapping[str, Any]) -> list[str]:
    """``{"balance_abs_threshold": 32, "disable_retries": True}`` -> ``--balance-abs-threshold 32
    --disable-retries`` (``False`` leaves a switch off; a list gives one flag with several values)."""
    args: list[str] = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            continue
        elif isinstance(value, list | tuple):
            args += [flag, *map(str, value)]
        else:
            args += [flag, str(value)]
    return args


def router_command(
    *,
    host: str,
    port: int,
    metrics_port: int,
    policy: str = DEFAULT_VLLM_ROUTER_POLICY,
    options: Mapping[str, Any] | None = None,
    executable: str | None = None,
) -> list[str]:
    """The argv of one vllm-router process: no worker URLs (it serves once workers are registered through
    ``POST /workers``, and a restarted one comes back empty either way) and no secret."""
    cmd = [executable or vllm_router_executable(), "--host", host, "--port", str(port), "--policy", policy]
    cmd += ["--worker-startup-check-interval", str(DEFAULT_WORKER_STARTUP_CHECK_INTERVAL_S)]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    return cmd + option_flags(options or {})


def vllm_router_executable() -> str:
    """``vllm-router`` beside this Python (the project's venv), else on PATH; raises if absent."""
    beside = Path(sys.executable).with_name(PROGRAM)
    if beside.exists():
        return str(beside)
    found = shutil.which(PROGRAM)
    if found is None:
        raise FileNotFoundError(
            "vllm-router is not installed: pip install 'rl-launch[vllm-router]' (vllm-router==0.1.17)"
        )
    return found


class _Refusal(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print and exit the validating process
        raise _Refusal(message)


def check_options(policy: str, options: Mapping[str, Any]) -> str | None:
    """vllm-router's own argument parser on the flags the options make: ``None`` when it accepts them,
    else its one-line complaint. Raises ``ImportError`` when the package is not installed."""
    from vllm_router.router_args import RouterArgs

    parser = _Parser(prog="vllm-router", add_help=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    try:
        parser.parse_args(["--policy", policy, *option_flags(options)])
    except _Refusal as exc:
        return str(exc)
    return None


def check_section(section: VllmRouterSection | None) -> list[tuple[str, str]]:
    """(field, message) problems of a managed vllm-router's section, found by vllm-router's parser."""
    section = section or VllmRouterSection()
    try:
        complaint = check_options(section.policy, section.options)
    except ImportError:
        return [
            (
                "router.kind",
                "a managed vllm-router needs the vllm-router package where the driver runs: "
                "pip install 'rl-launch[vllm-router]' (or use router.mode: external)",
            )
        ]
    return [("router.vllm_router.options", f"vllm-router refuses them: {complaint}")] if complaint else []


def root_url(url: str) -> str:
    """An engine's base URL as vllm-router wants it: no trailing ``/`` and no ``/v1`` (it appends the
    request path itself)."""
    u = url.rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


def roots(urls: Sequence[str]) -> list[str]:
    return [root_url(u) for u in urls]
