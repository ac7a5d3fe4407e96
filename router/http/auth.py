"""Who may call which route: every route declares its access where it is registered, and one check reads it.

Six kinds of access (``Access``):

* ``OPEN``: no credential. ``/health``, ``/readiness`` and ``/metrics``, as vLLM's, so probes and
  scrapers need no secret.
* ``CLIENT``: the client API key when one is set (the proxied routes and the router's 404).
* ``LISTING``: as ``CLIENT``, and the admin token or an admin consumer's key too: ``GET /v1/models``
  alone. A trainer written for one vLLM (NeMo-RL's ``remote_vllm``) sends its one key, the admin token
  of the control URL, to the generation URL's model list in its preflight; a read of served names, which
  the admin holder may see anyway (``/control/v1/models``). Generation stays ``CLIENT``: an admin key
  there is still 401/403 (one use each, below). (On a fleet of LoRA tenants the router answers the list
  itself, ``router.fleet.adapter_routes``, with the same mark: each caller sees its own adapters.)
* ``ADMIN``: the admin token, else the client key (``RouterConfig.admin_secret``): ``/fleet/*``, which
  pause and refit engines. Separate from the client key because that one travels to every rollout worker
  (it is in Gym's config).
* ``OWNER``: as ``ADMIN``, but never a consumer's key, admin or not: ``/workers``, the serving set. Who
  changes it decides where the engine key is sent (every fan-out presents it to every member), so it
  stays with the fleet's owner; an admin consumer keeps the refit routes. On a fleet of LoRA tenants
  (``router.adapters``) the routes that pause the fleet or change its base weights are ``OWNER`` too:
  every tenant's adapter is trained on those weights, and one tenant must not move them under the
  others (``router.fleet.api.FleetApi.add_routes``).
* ``CAPABILITY``: the job's registration capability in the path (``/t/<capability>/...``,
  ``router.http.capability``) in place of any header: the routes a trainer that owns its engines uses
  (``/workers`` and the proxied routes under that prefix), for clients that send no key of ours. Served
  only where the router has a capability (``RouterConfig.registration_capability``).

Why marks and not a list of path prefixes: with a list, a route added outside it was open by default
(``/fleet/`` had to be remembered in two places). Now a route is registered only through a
``RouteTable``, with its mark, and the check the mark calls for is bound to its handler right there;
a route someone registers straight on ``app.router`` carries no mark, and the router refuses to start
with it, naming it: never served, open or otherwise. The worker processes relay to the router process
exactly the routes it marked (``RouteTable.marked``; see ``router.multiprocess.workers``).

The body of an admin route is read by its check, once the caller is admitted and before the handler
runs, with the admin cap and the body deadline (``router.http.bodies.read_admin_body``); the handler's
``request.read()`` returns the bytes already read. The proxied routes read theirs in the forwarder.

Consumers (``router.consumers``, with ``RouterConfig.consumers_file``): the jobs attached to a standing
fleet each have a key of their own, listed (hashed) in the consumers file the launcher edits. A client
route then takes the router's API key (the fleet owner: consumer ``owner``) or any consumer's client
key, and requires one of them (an open client route would make a revoked key work as no key); an admin
key there is 403 (one use each: it is the job's admin token, not a rollout credential). An admin route
takes the admin token or a consumer's admin key (``router.consumers``: a job the owner lets pause and
refit); a client key there is 403 with what to do, not 401, since the key itself is good; an owner route
takes the admin token alone (a consumer's key, 403). Who called is put on the request (``CONSUMER``) for
the forwarder: fair share and the per-consumer counts need it, and a request held (paused, waiting for
its share) re-checks its key when it is dispatched (``still_admitted``): a key revoked meanwhile is 401
then, not served up to ``pause_max_wait_s`` later. Each process checks against its own ``ConsumerKeys``
of the same file (the worker processes included), which re-reads it within half a second of a change.
Without a consumers file the checks are those above, unchanged, and nothing is put on the request.

``RouterConfig`` refuses a router with neither an admin token nor an API key unless ``insecure_admin``
is set, on every address (loopback is every local user).

aiohttp decodes header bytes as UTF-8 with ``surrogateescape``, so a non-UTF-8 ``Authorization`` value
arrives as a ``str`` that cannot be encoded back: it is a wrong credential (401), never an exception
(a 500 with a traceback per request is an unauthenticated log flood, and 500 is a status clients retry).
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from router.consumers import OWNER, OWNER_CONSUMER, Consumer, ConsumerKeys
from router.http.bodies import read_admin_body
from router.http.capability import presents
from router.http.capability import refused as refused_capability
from router.http.status import error_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

CONSUMER = web.RequestKey("consumer", Consumer)
"""Who made the request, where the router has a consumers file: a consumer, or ``OWNER_CONSUMER``."""
_KEYS = web.RequestKey("consumer_keys", ConsumerKeys)
"""The table the request's consumer was found in, for ``still_admitted``."""


class Access(enum.Enum):
    OPEN = "open"
    CLIENT = "client"
    LISTING = "listing"
    ADMIN = "admin"
    OWNER = "owner"
    CAPABILITY = "capability"


def holder_of(request: web.Request) -> str | None:
    """The consumer whose key made ``request`` (an admin route's caller), or None for the fleet's owner
    (its admin token is never revoked) and for a router without consumers: what a pause or refit records
    as its holder, so that revoking that key ends it (``router.fleet.revocation``)."""
    consumer = request.get(CONSUMER)
    if consumer is None or consumer is OWNER_CONSUMER:
        return None
    return consumer.name


def account_of(request: web.Request) -> str:
    """Who is asking, as what a caller owns is kept (adapters, a trainer's step): a consumer's account
    (its admin key acts for it, so both keys see the same), or ``OWNER`` for the fleet's owner and for a
    router without consumers."""
    consumer = request.get(CONSUMER)
    if consumer is None or consumer is OWNER_CONSUMER or consumer.name == OWNER:
        return OWNER
    return consumer.account or consumer.name


def still_admitted(request: web.Request) -> bool:
    """Whether the key ``request`` was admitted with is still registered: False once its consumer was
    revoked (the owner's key and a router without consumers: always True)."""
    consumer = request.get(CONSUMER)
    keys = request.get(_KEYS)
    if consumer is None or keys is None or consumer is OWNER_CONSUMER:
        return True
    return keys.holds(consumer)


@dataclass(frozen=True)
class MarkedRoute:
    """One registered route as the worker processes learn it: method, aiohttp path pattern, access."""

    method: str
    path: str
    access: Access

    def to_json(self) -> list[str]:
        return [self.method, self.path, self.access.value]

    @classmethod
    def from_json(cls, data: list[str]) -> MarkedRoute:
        return cls(data[0], data[1], Access(data[2]))


@dataclass(frozen=True)
class Credentials:
    """What the router's marked routes take: the client API key (client routes), the admin secret
    (admin routes: ``RouterConfig.admin_secret``; None only with ``insecure_admin``), the deadline
    of an admin route's body, and the consumers' keys (None: no consumers file)."""

    api_key: str | None
    admin_token: str | None
    body_timeout_s: float
    consumers: ConsumerKeys | None = None
    capability: str | None = None
    """``RouterConfig.registration_capability``: what ``Access.CAPABILITY`` routes take (None: refused)."""


class RouteTable:
    """The routes of one application, each with its access mark; ``add`` is the only way the router's
    modules register a route.

    With ``credentials`` (the router's own applications) each handler is registered behind the check
    its mark calls for, bound once here: nothing for an open route, nor for a client route when no API
    key is set (the proxied path then pays nothing per request), the key otherwise, the admin secret and
    the bounded body read for an admin route. And the application refuses to start with any route
    registered without a mark (straight on ``app.router``), naming it. The driver's own listeners
    (``launcher.driver.status_server``, the fleet endpoint beside vllm-router) use it the same way.
    Without ``credentials`` (``RouteTable.of``) it records the marks only. The application keeps its
    table for the worker processes (``marked``)."""

    def __init__(self, app: web.Application, credentials: Credentials | None = None) -> None:
        self.app = app
        self._credentials = credentials
        self._marks: dict[web.AbstractRoute, Access] = {}
        self._routes: list[MarkedRoute] = []
        app[ROUTE_TABLE] = self
        if credentials is not None:
            app.on_startup.append(self._refuse_unmarked)

    def add(self, method: str, path: str, handler: Handler, access: Access) -> None:
        """Register ``handler`` for exactly ``method path`` (``"*"``: every method) with ``access``."""
        if not isinstance(access, Access):
            raise TypeError(f"route {method} {path}: access must be an Access, got {access!r}")
        route = self.app.router.add_route(method, path, self._guarded(handler, access))
        self._marks[route] = access
        self._routes.append(MarkedRoute(method, path, access))

    def _guarded(self, handler: Handler, access: Access) -> Handler:
        c = self._credentials
        if c is None or access is Access.OPEN:
            return handler
        if access is Access.CAPABILITY:
            return _capability_checked(handler, c.capability)
        if access is Access.LISTING:
            return _listing_checked(handler, c.api_key, c.admin_token, c.consumers)
        if access is Access.CLIENT:
            if c.consumers is not None:
                return _client_or_consumer_checked(handler, c.api_key, c.consumers)
            return handler if c.api_key is None else _client_checked(handler, c.api_key)
        return _admin_checked(
            handler, c.admin_token, c.body_timeout_s, c.consumers, owner_only=access is Access.OWNER
        )

    async def _refuse_unmarked(self, app: web.Application) -> None:
        unmarked = [
            f"{route.method} {route.resource.canonical if route.resource is not None else '?'}"
            for route in app.router.routes()
            if route not in self._marks
        ]
        if unmarked:
            raise RuntimeError(
                f"route(s) registered without an access mark: {', '.join(unmarked)}; register every route "
                "through router.http.auth.RouteTable.add with its Access "
                "(the router does not start with them)"
            )

    def access(self, route: web.AbstractRoute) -> Access | None:
        return self._marks.get(route)

    @classmethod
    def of(cls, app: web.Application) -> RouteTable:
        """The application's table, made (marks only) on first use."""
        table = app.get(ROUTE_TABLE)
        return table if table is not None else cls(app)

    def marked(self) -> list[MarkedRoute]:
        """Every route registered here, in registration order."""
        return list(self._routes)


ROUTE_TABLE = web.AppKey("route_table", RouteTable)


def _bearer(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    if value[:7].lower() == "bearer ":
        return value[7:].strip()
    return None


def _matches(given: str | None, expected: str) -> bool:
    # surrogateescape: aiohttp decodes non-UTF-8 header bytes to surrogates; they must compare unequal
    # (401), not raise (500 and a traceback per request).
    if given is None:
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def _refuse(status: int, message: str, kind: str) -> web.Response:
    body = error_body(message, kind, status)
    return web.Response(status=status, body=body, content_type="application/json")


def _client_checked(handler: Handler, api_key: str) -> Handler:
    async def checked(request: web.Request) -> web.StreamResponse:
        if not _matches(_bearer(request), api_key):
            return _refuse(401, "invalid or missing API key", "unauthorized")
        return await handler(request)

    return checked


def _client_or_consumer_checked(handler: Handler, api_key: str | None, consumers: ConsumerKeys) -> Handler:
    """The owner's key or a consumer's; a key is required even without an owner's key (module doc)."""

    async def checked(request: web.Request) -> web.StreamResponse:
        given = _bearer(request)
        if api_key is not None and _matches(given, api_key):
            request[CONSUMER] = OWNER_CONSUMER
        else:
            consumer = consumers.lookup(given)
            if consumer is None:
                return _refuse(401, "invalid or missing API key", "unauthorized")
            if consumer.is_admin_key:
                return _refuse(
                    403,
                    f"{consumer.name} is consumer {consumer.account}'s admin key (the refit routes only); "
                    "generation takes the job's client key (its secrets/api_key, the Gym overlay's)",
                    "forbidden",
                )
            request[CONSUMER] = consumer
            request[_KEYS] = consumers
        return await handler(request)

    return checked


def _listing_checked(
    handler: Handler, api_key: str | None, admin_token: str | None, consumers: ConsumerKeys | None
) -> Handler:
    """``Access.LISTING`` (module doc): what the client route takes, or the admin token, or an admin
    consumer's key. Open only where the client routes are (no client key, no consumers file)."""
    client = (
        _client_or_consumer_checked(handler, api_key, consumers)
        if consumers is not None
        else (handler if api_key is None else _client_checked(handler, api_key))
    )

    async def checked(request: web.Request) -> web.StreamResponse:
        given = _bearer(request)
        if admin_token is not None and _matches(given, admin_token):
            if consumers is not None:
                request[CONSUMER] = OWNER_CONSUMER
            return await handler(request)
        if consumers is not None:
            consumer = consumers.lookup(given)
            if consumer is not None and consumer.is_admin_key and consumer.admin:
                request[CONSUMER] = consumer
                request[_KEYS] = consumers
                return await handler(request)
        return await client(request)

    return checked


def _capability_checked(handler: Handler, capability: str | None) -> Handler:
    """The path's capability (``router.http.capability``), whatever the headers say. The body is the
    handler's to read: the forwarder's cap on a proxied route, ``capability.bounded_body`` on the rest."""

    async def checked(request: web.Request) -> web.StreamResponse:
        if capability is None or not presents(request, capability):
            return refused_capability()
        return await handler(request)

    return checked


def _admin_checked(
    handler: Handler,
    admin_token: str | None,
    body_timeout_s: float,
    consumers: ConsumerKeys | None = None,
    owner_only: bool = False,
) -> Handler:
    """``owner_only``: an ``Access.OWNER`` route, which no consumer's key opens (module doc)."""

    async def checked(request: web.Request) -> web.StreamResponse:
        if admin_token is not None:
            given = _bearer(request)
            if _matches(given, admin_token):
                if consumers is not None:
                    request[CONSUMER] = OWNER_CONSUMER
            else:
                consumer = consumers.lookup(given) if consumers is not None else None
                if consumer is None:
                    return _refuse(401, "admin token required", "unauthorized")
                if owner_only:
                    return _refuse(
                        403,
                        f"consumer {consumer.account or consumer.name} may not call {request.method} "
                        f"{request.path}: it is the fleet owner's alone (the serving set on every "
                        "fleet; on a fleet of LoRA tenants also the pause and the base weights, and an "
                        "admin consumer refits its own adapters through /fleet/adapters)",
                        "forbidden",
                    )
                if not consumer.admin:
                    return _refuse(
                        403,
                        f"consumer {consumer.name} may not call {request.method} {request.path}: only the "
                        "fleet's owner and the consumers it marks admin may (the fleet's owner allows admin "
                        "consumers in its spec)",
                        "forbidden",
                    )
                request[CONSUMER] = consumer
        return await handler(await read_admin_body(request, body_timeout_s))

    return checked
