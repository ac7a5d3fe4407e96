"""The registration capability: a per-job secret carried in the URL's path instead of a header.

Why a path and not a key: NeMo-RL registers the engines it owns with an external router exactly as it
would with vllm-router (``POST {router_url minus /v1}/workers {"url": ...}``, no ``Authorization``
header), then points Gym's ``policy_base_url`` at ``router_url + "/v1"``, and Gym sends a key of its own
choosing (often a dummy). Neither can be taught to send our admin token, but both keep whatever path the
URL they are given has. So the job hands the trainer ``http://host:port/t/<capability>`` as the router
URL: under that prefix ``POST``/``GET /workers`` (the serving set) and the proxied routes
(``/v1/...``, ``/tokenize``, ...) are served to whoever presents the capability, and nothing else is.

What it protects: another user of the cluster, who can reach the router's port but not the job's
``secrets/`` (0700), can neither register an engine (which would receive a share of the rollouts) nor
generate. A wrong or missing capability is a 401 like a wrong key. The comparison is constant-time.

What it does not: the URL is a bearer secret, so anything that prints the trainer's config (NeMo-RL logs
its resolved config, W&B saves it) prints the capability; the engines the trainer registers are its own
processes, open as it started them (rl-launch sends them no key and cannot close them); and a holder of
the capability may register any URL, which the router then probes and routes to. Since such a URL may be
anyone's, the router sends the engines it registers no key of the job (neither the client's on a rollout
nor its own on a fan-out), reads their answers with a cap (``router.fleet.engine_reads``), and refuses to
register itself or an address with a path (``registration_refusal``): a request sent there came back
into the router, and with the router as its only member recursed until the connection cap.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

import orjson
from aiohttp import web
from yarl import URL

from router.http.bodies import read_admin_body
from router.http.status import error_body
from router.state.backends import registered_backend_url

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CAPABILITY_SEGMENT = "t"
CAPABILITY_PREFIX = "/t/{capability}"
"""The aiohttp pattern of the prefix; ``match_info["capability"]`` is the presented secret."""


def capability_path(path: str) -> str:
    """``path`` (``/workers``, ``/v1/completions``) under the capability prefix, as an aiohttp pattern."""
    return CAPABILITY_PREFIX + path


def registration_url(base_url: str, capability: str) -> str:
    """What the trainer is handed as its router URL: ``base_url/t/<capability>`` (no ``/v1``; NeMo-RL
    appends it, and strips a trailing one before ``/workers``)."""
    return f"{base_url.rstrip('/')}/{CAPABILITY_SEGMENT}/{capability}"


def presents(request: web.Request, capability: str) -> bool:
    """Whether ``request``'s path carries ``capability`` (constant-time; a non-UTF-8 segment is a miss)."""
    given = request.match_info.get("capability", "")
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), capability.encode())


def refused() -> web.Response:
    body = error_body("invalid or missing registration capability", "unauthorized", 401)
    return web.Response(status=401, body=body, content_type="application/json")


ROUTE_KEY = "rl_launch.route"
"""Where ``without_prefix`` leaves the route pattern the request stands for (``/v1/completions``): the
forwarder's metrics, request record and pause holds are keyed by route, and the clone keeps the matched
``/t/{capability}/...`` resource (before, rollouts under the prefix were neither recorded nor held
during a pause)."""


def without_prefix(request: web.Request) -> web.Request:
    """``request`` as if it had been sent to the path after ``/t/<capability>``: the forwarder routes,
    records, holds and relays ``/v1/...`` and never sees (or sends an engine) the capability."""
    raw = request.rel_url.raw_path
    rest = raw.split("/", 3)[3] if raw.count("/") >= 3 else ""
    url = URL.build(path="/" + rest, query_string=request.rel_url.raw_query_string, encoded=True)
    clone = request.clone(rel_url=url)
    resource = request.match_info.route.resource
    pattern = resource.canonical if resource is not None else ""
    if pattern.startswith(CAPABILITY_PREFIX):
        clone[ROUTE_KEY] = pattern[len(CAPABILITY_PREFIX) :]
    return clone


def stripped(handler: Handler) -> Handler:
    """``handler`` (the forwarder's) on the path after the prefix (``without_prefix``)."""

    async def strip(request: web.Request) -> web.StreamResponse:
        return await handler(without_prefix(request))

    return strip


ROUTER_ADDRESS = web.AppKey("rl_launch.router_address", tuple)
"""``(host, port)`` the router's socket is bound to, set on its application by the router: the address a
registration must not name (``registration_refusal``)."""
RESOLVE_TIMEOUT_S = 2.0


def _is_local(address: str) -> bool:
    """Whether a connection to ``address`` stays on this machine: loopback, the unspecified address
    (which connects to loopback), or an address of one of its interfaces (it can be bound here)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


async def names_this_router(url: str, port: int) -> bool:
    """Whether ``url`` reaches the router's own port on this machine, however spelled (``127.0.0.1``,
    ``localhost``, the node's name or any of its addresses). A name that does not resolve in time is not
    this router (its registration then fails its health wait, as any dead URL's does)."""
    parts = urlsplit(url)
    if parts.port != port or not parts.hostname:
        return False
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await loop.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        return False
    return any(_is_local(str(info[4][0])) for info in infos)


async def registration_refusal(request: web.Request) -> str | None:
    """Why the URL a registration names must not become an engine, or None: a path other than ``/`` or
    ``/v1`` (``registered_backend_url``), or this router itself. A body that names no URL is left to the
    handler, which answers it as it always has."""
    try:
        raw = orjson.loads(await request.read())["url"]
        url = registered_backend_url(raw)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    except ValueError as exc:
        return str(exc)
    own = request.app.get(ROUTER_ADDRESS)
    if own is not None and await names_this_router(url, int(own[1])):
        return (
            f"worker URL {raw!r} is this router itself (port {own[1]} on this machine): requests sent to it "
            "would come back into the router; register the engines' own URLs"
        )
    return None


def refusing_bad_urls(handler: Handler) -> Handler:
    """``handler`` run only for a URL a registration may name (``registration_refusal``: else 400
    ``ADD_WORKER_FAILED``, nothing probed). Every ``POST /workers`` goes through it, the owner's as well
    as the capability's: the router as its own engine recurses whoever registered it."""

    async def checked(request: web.Request) -> web.StreamResponse:
        why = await registration_refusal(request)
        if why is not None:
            body = orjson.dumps({"success": False, "code": "ADD_WORKER_FAILED", "message": why})
            return web.Response(status=400, body=body, content_type="application/json")
        return await handler(request)

    return checked


def bounded_body(handler: Handler, timeout_s: float) -> Handler:
    """``handler`` with the body read as an admin route's is (capped, in time), and the URL it registers
    checked (``refusing_bad_urls``), before it runs: the registration routes take a small JSON body from
    a caller who holds no key."""
    checked = refusing_bad_urls(handler)

    async def bounded(request: web.Request) -> web.StreamResponse:
        return await checked(await read_admin_body(request, timeout_s))

    return bounded
