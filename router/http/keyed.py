"""Which client connections have presented a key: every checked route, once its check passed, moves its
request's connection into the keyed pool of the connection gate (``router.http.connections``).

The gate cannot tell at accept whether a connection will authenticate; the route's check can, and only it.
So the router's applications register their routes through ``KeyedRouteTable``, a ``RouteTable`` that
puts ``keyed(handler)`` under the check every non-open mark calls for: the promotion runs exactly when the
check let the request through (a client key, a consumer's key, the admin token, the registration
capability), and never for an open route (``/health``, ``/metrics``) whatever header it carries. Where a
client route has no check at all (a router with neither an API key nor consumers), every request on it
promotes: nothing there tells a keyed client from a keyless one.

The keyed pool full (connections that presented a key fill what the cap leaves them), the request is
answered the no-healthy status (which no client retries, ``router.http.status``) and its connection closed,
as ``router.http.consumer_limits`` answers one consumer's connections past its share.
"""

from __future__ import annotations

from aiohttp import web

from router.http.auth import Access, Credentials, Handler, RouteTable
from router.http.status import error_body


class KeyedRouteTable(RouteTable):
    """``RouteTable`` whose checked routes promote their connection once the check passed (module doc).
    ``status``: the no-healthy status, for a promotion past the keyed pool. Serving an application made
    with one turns the gate's pools on (``router.http.app.serve_guarded``)."""

    def __init__(self, app: web.Application, credentials: Credentials, status: int) -> None:
        super().__init__(app, credentials)
        self.status = status

    def add(self, method: str, path: str, handler: Handler, access: Access) -> None:
        if access is not Access.OPEN:
            handler = keyed(handler, self.status)
        super().add(method, path, handler, access)


def keyed(handler: Handler, status: int) -> Handler:
    """``handler``, its request's connection promoted first (refused and closed past the keyed pool)."""

    async def promoted(request: web.Request) -> web.StreamResponse:
        promote = getattr(request.protocol, "promote", None)  # a GuardedRequestHandler's
        if promote is not None and not promote():
            gate = request.protocol.gate  # type: ignore[union-attr]
            message = (
                f"this router process already has {gate.keyed_cap} client connections that presented a key "
                "(router.http.max_client_connections, less the share kept for connections that present "
                "none); this connection is closed: reuse the open ones (fewer at a time)"
            )
            response = web.Response(
                status=status,
                body=error_body(message, "connection_cap", status),
                content_type="application/json",
            )
            response.force_close()
            return response
        return await handler(request)

    return promoted
