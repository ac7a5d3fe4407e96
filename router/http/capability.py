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
the capability may register any URL, which the router then probes and routes to.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web
from yarl import URL

from router.http.bodies import read_admin_body
from router.http.status import error_body

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


def bounded_body(handler: Handler, timeout_s: float) -> Handler:
    """``handler`` with the body read as an admin route's is (capped, in time), before it runs: the
    registration routes take a small JSON body from a caller who holds no key."""

    async def bounded(request: web.Request) -> web.StreamResponse:
        return await handler(await read_admin_body(request, timeout_s))

    return bounded
