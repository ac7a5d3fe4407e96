"""``rl-launch router``: run the generation router standalone, in the foreground (Ctrl-C stops cleanly).

The flags only parse; every check is ``RouterConfig``'s (one place, one wording), and every default shown
in ``--help`` is read from it. Secrets come from ``--*-file`` or the environment (``router.secrets``).
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from typing import Any

import click
from pydantic import ValidationError

from router.config import SECRET_FIELDS, RouterConfig, default_worker_count, describe_errors
from router.policies import POLICIES
from router.secrets import SecretSourceError, resolve_secret

DEFAULT_PORT = 8000
SECRET_ENV = {
    "api_key": "RL_ROUTER_API_KEY",
    "admin_token": "RL_ROUTER_ADMIN_TOKEN",
    "backend_api_key": "RL_ROUTER_BACKEND_API_KEY",
    "registration_capability": "RL_ROUTER_REGISTRATION_CAPABILITY",
}


def _default(field: str) -> Any:
    return RouterConfig.model_fields[field].default


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def _setting(field: str, kind: Any, help_text: str) -> Any:
    return click.option(
        _flag(field), field, type=kind, default=_default(field), show_default=True, help=help_text
    )


def _secret_options(fn: Any) -> Any:
    helps = {
        "api_key": "Bearer token clients must send",
        "admin_token": "Bearer token /workers requires (default: the API key)",
        "backend_api_key": "Replace the client's token with this one toward engines",
        "registration_capability": "Serve /t/<this>/workers and /t/<this>/v1/* to callers with no key "
        "(a trainer registering its own engines)",
    }
    for name in reversed(SECRET_FIELDS):
        env = SECRET_ENV[name]
        fn = click.option(
            f"{_flag(name)}-file",
            f"{name}_file",
            type=click.Path(dir_okay=False),
            default=None,
            help=f"{helps[name]}: read from this file (chmod 600).",
        )(fn)
        fn = click.option(
            _flag(name),
            name,
            envvar=env,
            default=None,
            help=f"{helps[name]} (env {env}). On the command line it shows in ps: prefer {_flag(name)}-file.",
        )(fn)
    return fn


@click.command("router")
@click.option(
    "--backend", "backends", multiple=True, help="Engine URL, http://host:port/v1 (repeat for each engine)."
)
@click.option(
    "--policy", default=_default("policy"), show_default=True, help=f"Routing policy: {', '.join(POLICIES)}."
)
@click.option("--host", default=_default("host"), show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True, help="Port to listen on.")
@_setting("backend_timeout_s", float, "Total time one backend attempt may take before it counts as failed.")
@_setting("connect_timeout_s", float, "TCP connect timeout toward a backend.")
@_setting("no_healthy_backend_status", int, "Status when no backend serves; a 4xx that clients do not retry.")
@_setting("max_attempts", int, "Attempts per request on distinct backends (1 disables the retry).")
@_setting("probe_interval_s", float, "Probe GET /health on each backend this often; 0 turns probing off.")
@_setting("probe_timeout_s", float, "A health probe slower than this counts as failed.")
@_setting(
    "probe_failures_to_eject", int, "Consecutive failures (probes or proxied attempts) that eject a backend."
)
@_setting("probe_successes_to_readmit", int, "Consecutive successful probes that re-admit a backend.")
@_setting("worker_health_timeout_s", float, "How long POST /workers waits for the worker's GET /health.")
@_setting("max_request_bytes", int, "Largest request body accepted (413 above).")
@_setting(
    "consumers_file",
    click.Path(dir_okay=False),
    "A standing fleet's consumers file (jobs attached to it, each with its own key, stored hashed); "
    "client routes then take the API key or a consumer's key.",
)
@_setting(
    "fair_share_capacity",
    int,
    "Generation requests in flight through the router at most, shared between consumers by weight "
    "(unset: no admission control).",
)
@_setting("fair_share_max_wait_s", float, "Longest a generation request waits for a fair-share slot.")
@_setting(
    "record_dir",
    click.Path(file_okay=False),
    "Record every generation request, one JSONL line each (requests*.jsonl; hashes, no text), in this "
    "directory (unset: no record).",
)
@_setting("record_max_bytes", int, "The record's files take at most this many bytes in all.")
@_setting("record_keep_files", int, "Files per process the record is rotated through.")
@click.option(
    "--record-text",
    "record_text",
    is_flag=True,
    default=_default("record_text"),
    help="Also record the prompt's text (and a whole JSON answer's completion).",
)
@click.option(
    "--workers",
    type=int,
    default=default_worker_count(),
    show_default="the cores this process may use, at most 8",
    help="Worker processes sharing the port (parsing, hashing, relaying) with one routing state; "
    "1 serves everything in one process.",
)
@click.option("--session-header", default=None, help="consistent_hash: header carrying the session key.")
@click.option(
    "--insecure-admin",
    is_flag=True,
    default=False,
    help="Start without any admin token or API key, on any address, loopback included (every user who "
    "can reach it, every local user on 127.0.0.1, can then add, remove, pause and refit engines).",
)
@_secret_options
@click.option(
    "--options-json",
    default=None,
    metavar="JSON",
    help='More RouterConfig fields (no secrets), e.g. \'{"policy_options": {"load_slack": 4}}\'.',
)
@click.pass_context
def router_command(
    ctx: click.Context,
    backends: tuple[str, ...],
    session_header: str | None,
    options_json: str | None,
    **flags: Any,
) -> None:
    """Run the generation router in the foreground."""
    warn = _warn
    secrets: dict[str, str | None] = {}
    try:
        for name in SECRET_FIELDS:
            source = ctx.get_parameter_source(name)
            secrets[name] = resolve_secret(
                name=name.replace("_", "-"),
                flag_value=flags.pop(name),
                from_env=source is click.core.ParameterSource.ENVIRONMENT,
                env_var=SECRET_ENV[name],
                file_path=flags.pop(f"{name}_file"),
                warn=warn,
            )
    except SecretSourceError as exc:
        raise click.ClickException(str(exc)) from None
    settings: dict[str, Any] = dict(flags)
    extra = _options_json(options_json)
    policy_options = dict(extra.pop("policy_options", None) or {})
    if session_header is not None:
        policy_options.setdefault("session_header", session_header)
    settings.update(extra)
    settings["policy_options"] = policy_options
    try:
        config = RouterConfig.model_validate({**settings, **secrets})
    except ValidationError as exc:
        raise click.ClickException("invalid router settings:\n" + describe_errors(exc)) from None
    _serve(config, backends)


def _warn(message: str) -> None:
    click.echo(f"warning: {message}", err=True)


def _options_json(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--options-json") from None
    if not isinstance(extra, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--options-json")
    leaked = sorted(set(extra) & set(SECRET_FIELDS))
    if leaked:
        raise click.BadParameter(
            f"{', '.join(leaked)} cannot be given here (argv is visible in ps); use "
            + ", ".join(f"{_flag(k)}-file" for k in leaked),
            param_hint="--options-json",
        )
    return extra


def _serve(config: RouterConfig, backends: tuple[str, ...]) -> None:
    # aiohttp only once the config is valid
    from router.http.app import RouterBindError
    from router.server import GenerationRouter

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        router = GenerationRouter(config, backends)
    except (RouterBindError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        router.serve_in_background()
    except RuntimeError as exc:  # e.g. worker processes that could not start; nothing is left running
        raise click.ClickException(str(exc)) from None
    probing = f"probing /health every {config.probe_interval_s:g} s" if config.probing else "no probing"
    workers = f"{config.workers} worker processes" if config.workers > 1 else "one process"
    what = f"policy {config.policy}, {len(backends)} backend(s), {probing}, {workers}"
    click.echo(f"router serving {router.base_url()}/v1 ({what})", err=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        router.stop()
        click.echo("router stopped", err=True)
