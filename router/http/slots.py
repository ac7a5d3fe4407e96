"""A proxied request's claims on the routing state, each given back exactly once.

A request holds up to two: its backend slot (``Slot``: the in-flight count and body bytes ``dispatch``
charged to the engine) and, where consumers are told apart, its fair-share slot (``Ticket``). Both are
given back on the first of several paths (the answer in full, a failure, the client gone), so each is
an object that forgets its routing state once used: a second call on another path is a no-op, never a
double release that would drive a count below what is really in flight.
"""

from __future__ import annotations

from router.state.routing import RoutingState


class Slot:
    """One attempt's in-flight count, released once: as soon as the backend has answered in full and
    before the end of the answer reaches the client, or when the attempt ends otherwise.

    Why before the client: a Gym session sends its next turn the moment it has this answer. With
    worker processes that turn may be parsed by another worker, whose decision could reach the routing
    state before this worker's release, and would then see the session's engine one request (and one
    whole context of bytes) busier than it is: measured on the replay bench, that moved enough turns
    off their engine to cost 1-2.5 points of prefix-cache hits."""

    __slots__ = ("_request_id", "_routing", "_url", "_version", "_weight")

    def __init__(
        self, routing: RoutingState, url: str, weight: int, version: str | None, request_id: str
    ) -> None:
        self._routing: RoutingState | None = routing
        self._url = url
        self._weight = weight
        self._version = version
        self._request_id = request_id

    def release(self) -> None:
        routing, self._routing = self._routing, None
        if routing is not None:
            routing.release(self._url, self._weight, self._version, self._request_id)


class Ticket:
    """A generation request's fair-share slot and place in the consumer ledger, ended once: when the
    engine has answered in full (with its completion tokens, just before the backend slot is released),
    or when the request ends otherwise."""

    __slots__ = ("_routing", "name")

    def __init__(self, routing: RoutingState, name: str) -> None:
        self._routing: RoutingState | None = routing
        self.name = name

    def end(self, tokens: int = 0) -> None:
        routing, self._routing = self._routing, None
        if routing is not None:
            routing.finish(self.name, tokens)
