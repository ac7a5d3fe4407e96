"""``rl-launch router``: run the generation router standalone, in the foreground (Ctrl-C stops cleanly)."""

from __future__ import annotations

import json
import signal
import threading

import click

from router.backends import canonical_backend_url
from router.policies import DEFAULT_POLICY, POLICIES
from router.server import GenerationRouter, RouterBindError
from router.status import DEFAULT_NO_HEALTHY_BACKEND_STATUS, validate_no_healthy_status


def _check_backend(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    for value in values:
        try:
            canonical_backend_url(value)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    return values


def _check_status(ctx: click.Context, param: click.Parameter, value: int) -> int:
    try:
        return validate_no_healthy_status(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("router")
@click.option(
    "--backend",
    "backends",
    multiple=True,
    callback=_check_backend,
    help="Engine URL, http://host:port/v1 (repeat for each engine).",
)
@click.option("--policy", type=click.Choice(list(POLICIES)), default=DEFAULT_POLICY, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option(
    "--backend-timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="Total time one backend attempt may take before it counts as failed (answered 500).",
)
@click.option(
    "--connect-timeout-s", type=click.FloatRange(min=0, min_open=True), default=5.0, show_default=True
)
@click.option(
    "--no-healthy-backend-status",
    type=int,
    default=DEFAULT_NO_HEALTHY_BACKEND_STATUS,
    callback=_check_status,
    show_default=True,
    help="Status when no backend serves; must be a 4xx that clients do not retry.",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Attempts per request on distinct backends (1 disables the retry).",
)
@click.option(
    "--probe-interval-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Actively probe GET /health on each backend at this interval (standalone use).",
)
@click.option("--session-header", default=None, help="consistent_hash: header carrying the session key.")
@click.option(
    "--api-key",
    envvar="RL_ROUTER_API_KEY",
    default=None,
    help="Bearer token clients must send (env RL_ROUTER_API_KEY).",
)
@click.option(
    "--backend-api-key",
    envvar="RL_ROUTER_BACKEND_API_KEY",
    default=None,
    help="Replace the client's token with this one toward engines (env RL_ROUTER_BACKEND_API_KEY).",
)
@click.option(
    "--admin-token",
    envvar="RL_ROUTER_ADMIN_TOKEN",
    default=None,
    help="Bearer token required by /workers (env RL_ROUTER_ADMIN_TOKEN).",
)
@click.option(
    "--options-json",
    default=None,
    metavar="JSON",
    help='More GenerationRouter keyword arguments, e.g. \'{"policy_options": {"load_slack": 4}}\'.',
)
def router_command(
    backends: tuple[str, ...],
    policy: str,
    host: str,
    port: int,
    backend_timeout_s: float,
    connect_timeout_s: float,
    no_healthy_backend_status: int,
    max_attempts: int,
    probe_interval_s: float | None,
    session_header: str | None,
    api_key: str | None,
    backend_api_key: str | None,
    admin_token: str | None,
    options_json: str | None,
) -> None:
    """Run the generation router in the foreground."""
    options = {"session_header": session_header} if session_header and policy == "consistent_hash" else {}
    extra: dict[str, object] = {}
    if options_json:
        try:
            extra = json.loads(options_json)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not JSON: {exc}", param_hint="--options-json") from None
        if not isinstance(extra, dict):
            raise click.BadParameter("must be a JSON object", param_hint="--options-json")
        options.update(extra.pop("policy_options", {}))
    try:
        router = GenerationRouter(
            backends,
            host=host,
            port=port,
            policy=policy,
            policy_options=options,
            backend_timeout_s=backend_timeout_s,
            connect_timeout_s=connect_timeout_s,
            no_healthy_backend_status=no_healthy_backend_status,
            max_attempts=max_attempts,
            probe_interval_s=probe_interval_s,
            api_key=api_key,
            backend_api_key=backend_api_key,
            admin_token=admin_token,
            **extra,  # type: ignore[arg-type]
        )
    except TypeError as exc:
        raise click.BadParameter(str(exc), param_hint="--options-json") from None
    except (RouterBindError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    router.serve_in_background()
    click.echo(
        f"router serving {router.base_url()}/v1 (policy {policy}, {len(backends)} backend(s))", err=True
    )
    try:
        while not stop.wait(0.5):
            pass
    finally:
        router.stop()
        click.echo("router stopped", err=True)
