"""Who may call which route: every route declares its access where it is registered, and one check reads it.

Three kinds of access (``Access``):

* ``OPEN``: no credential. ``/health``, ``/readiness`` and ``/metrics``, as vLLM's, so probes and
  scrapers need no secret.
* ``CLIENT``: the client API key when one is set (the proxied routes and the router's 404).
* ``ADMIN``: the admin token, else the client key (``RouterConfig.admin_secret``): ``/workers`` and
  ``/fleet/*``, which add, remove, pause and refit engines. Separate from the client key because that
  one travels to every rollout worker (it is in Gym's config).

Why marks and not a list of path prefixes: with a list, a route added outside it was open by default
(``/fleet/`` had to be remembered in two places). Now a route is registered only through a
``RouteTable``, which records its mark, and ``access_middleware`` refuses every request whose route
carries no mark (403, logged once per route): a route someone registers straight on ``app.router`` is
never served, open or otherwise. The worker processes relay to the router process exactly the routes
it marked (``RouteTable.marked``; see ``router.workers``).

The body of an admin route is read here, once the caller is admitted and before the handler runs,
with the admin cap and the body deadline (``router.bodies.read_admin_body``); the handler's
``request.read()`` returns the bytes already read. The proxied routes read theirs in the forwarder.

``RouterConfig`` refuses a router with neither an admin token nor an API key unless ``insecure_admin``
is set, on every address (loopback is every local user).

aiohttp decodes header bytes as UTF-8 with ``surrogateescape``, so a non-UTF-8 ``Authorization`` value
arrives as a ``str`` that cannot be encoded back: it is a wrong credential (401), never an exception
(a 500 with a traceback per request is an unauthenticated log flood, and 500 is a status clients retry).
"""

from __future__ import annotations

import enum
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from router.bodies import read_admin_body
from router.limits import DEFAULT_HTTP_LIMITS
from router.status import error_body

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DEFAULT_BODY_TIMEOUT_S = DEFAULT_HTTP_LIMITS.body_timeout_s


class Access(enum.Enum):
    OPEN = "open"
    CLIENT = "client"
    ADMIN = "admin"


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


class RouteTable:
    """The router's routes on one application, each with its access mark.

    ``add`` is the only way the router's modules register a route; ``access_middleware`` reads the
    marks, and the application keeps its table (``RouteTable.of(app)``) for the worker processes."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self._marks: dict[web.AbstractRoute, Access] = {}
        self._routes: list[MarkedRoute] = []
        app[ROUTE_TABLE] = self

    def add(self, method: str, path: str, handler: Handler, access: Access) -> None:
        """Register ``handler`` for exactly ``method path`` (``"*"``: every method) with ``access``."""
        if not isinstance(access, Access):
            raise TypeError(f"route {method} {path}: access must be an Access, got {access!r}")
        route = self.app.router.add_route(method, path, handler)
        self._marks[route] = access
        self._routes.append(MarkedRoute(method, path, access))

    def access(self, route: web.AbstractRoute) -> Access | None:
        return self._marks.get(route)

    @classmethod
    def of(cls, app: web.Application) -> RouteTable:
        """The application's table, made on first use."""
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


async def _admit(
    request: web.Request,
    handler: Handler,
    access: Access,
    api_key: str | None,
    admin_token: str | None,
    body_timeout_s: float,
) -> web.StreamResponse:
    if access is Access.OPEN:
        return await handler(request)
    if access is Access.CLIENT:
        if api_key is not None and not _matches(_bearer(request), api_key):
            return _refuse(401, "invalid or missing API key", "unauthorized")
        return await handler(request)
    if admin_token is not None and not _matches(_bearer(request), admin_token):
        return _refuse(401, "admin token required", "unauthorized")
    return await handler(await read_admin_body(request, body_timeout_s))


def access_middleware(
    table: RouteTable, api_key: str | None, admin_token: str | None, body_timeout_s: float
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The one access check of the router's applications: by the mark ``table`` recorded for the route.
    ``admin_token``: what admin routes take (``RouterConfig.admin_secret``; None: they are open, which
    ``RouterConfig`` allows only with ``insecure_admin``). A route without a mark is refused (403)."""
    warned: set[str] = set()
    marks = table._marks

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        match = request.match_info
        access = marks.get(match.route)
        if access is None:
            if match.http_exception is None:
                resource = match.route.resource
                where = f"{request.method} {resource.canonical if resource is not None else request.path}"
                if where not in warned:
                    warned.add(where)
                    log.error("route %s was registered without an access mark: refused", where)
                return _refuse(403, f"route {request.method} {request.path} is not served", "forbidden")
            access = Access.CLIENT  # aiohttp's own 404/405: answered to clients only
        return await _admit(request, handler, access, api_key, admin_token, body_timeout_s)

    return check


def auth_middleware(
    api_key: str | None, admin_token: str | None, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The check for applications outside the router package (the driver's listeners), which register
    some routes straight on ``app.router``: a route marked through the application's ``RouteTable``
    (``FleetApi``'s) by its mark; any other route takes the strongest secret given (the admin token, else
    the API key) and is refused (403) when neither is. Never open by omission; the router's own
    applications use ``access_middleware``, which refuses every unmarked route."""
    strongest = admin_token if admin_token is not None else api_key

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        table = request.app.get(ROUTE_TABLE)
        access = table.access(request.match_info.route) if table is not None else None
        if access is not None:
            return await _admit(request, handler, access, api_key, admin_token, body_timeout_s)
        if strongest is None:
            return _refuse(403, f"route {request.method} {request.path} is not served", "forbidden")
        if not _matches(_bearer(request), strongest):
            return _refuse(401, "invalid or missing token", "unauthorized")
        return await handler(request)

    return check
