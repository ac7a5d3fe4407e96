"""What one consumer may take of one router process: its client connections and its request bodies' bytes.

A standing fleet's router is shared by jobs that each have a key (``router.consumers``). Two of its
resources belong to the process, not to the routing state: the client connections (the cap,
``HttpLimits.max_client_connections``, split between the worker processes) and the memory the request
bodies sit in while their requests are read, held (a pause, a version gate, a wait for a fair-share slot)
or in flight. One consumer that held enough requests took both: the connection cap filled and another
consumer's connection was closed at accept; 8 held 8 MB bodies took the router's RSS from 110 to 190 MB.
The count of held requests is bounded per consumer where the holds are decided, in the routing state
(``router.state.fair_share.FairShare.hold``); this bounds the rest, right after the access check has said
who the consumer is and before its body is read:

* connections: at most ``HttpLimits.max_connections_per_consumer`` per process (0: the consumer's weighted
  share of this process's cap for keyed connections, ``ConnectionGate.keyed_cap``: the cap less the pool
  kept for connections that presented no key; the consumers' weights from the file and the owner's 1); a
  request on one more is refused and that connection closed, so it goes back to the cap for the others.
* bodies: at most ``HttpLimits.max_body_bytes_per_consumer`` of the consumer's request bodies in this
  process at once, counted from the declared ``Content-Length`` before a byte is read (a body without one
  is counted at ``max_request_bytes``, the most it may be, since its size is known only once read) until
  the request has ended; one past it is refused without reading its body.

Both refusals are the no-healthy status, which no client retries (``router.http.status``; a 429 would be
retried forever by older Gym), with a message naming the bound and the setting. Without a consumers file
there is one client and none of this runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from router.consumers import OWNER, Consumer, ConsumerKeys
from router.http.limits import HttpLimits
from router.http.status import error_body
from router.state.metrics import RouterMetrics

BODY_BYTES = web.RequestKey("consumer_body_bytes", int)
"""The body bytes a request counted against its consumer, given back when it ends (``done``)."""


@dataclass
class _Shares:
    """The consumers file's total weight (the owner's 1 included), recomputed when the file is re-read."""

    reloads: int = -1
    total: float = 1.0
    weights: dict[str, float] | None = None


class ConsumerLimits:
    """Per consumer, in this process: connections claimed and body bytes held. One per forwarder."""

    def __init__(
        self,
        consumers: ConsumerKeys,
        limits: HttpLimits,
        max_request_bytes: int,
        status: int,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.consumers = consumers
        self.max_connections = limits.max_connections_per_consumer
        self.max_body_bytes = limits.max_body_bytes_per_consumer
        self.max_request_bytes = max_request_bytes
        self.status = status
        self.metrics = metrics
        self.body_bytes: dict[str, int] = {}
        self._shares = _Shares()

    def _connection_cap(self, consumer: Consumer, process_cap: int) -> int:
        if self.max_connections:
            return self.max_connections
        shares = self._shares
        keys = self.consumers
        if shares.reloads != keys.reloads:  # re-read since: the weights may have changed
            table = keys.accounts()  # an admin key is no consumer of its own: its weight is its account's
            shares.weights = {name: c.weight for name, c in table.items()}
            shares.total = sum(shares.weights.values()) + 1.0  # the owner
            shares.reloads = keys.reloads
        total = shares.total
        if consumer.name != OWNER and consumer.name not in (shares.weights or {}):
            total += consumer.weight  # revoked since its key was checked: its own weight still counts
        return max(1, int(process_cap * consumer.weight / total))

    def _refuse(self, kind: str, message: str, close: bool) -> web.Response:
        if self.metrics is not None:
            self.metrics.errors.labels(kind).inc()
        response = web.Response(
            status=self.status, body=error_body(message, kind, self.status), content_type="application/json"
        )
        if close:
            response.force_close()
        return response

    def admit(self, request: web.Request, consumer: Consumer | None) -> web.Response | None:
        """Before the body is read: claim the request's connection for ``consumer`` and count its body;
        a refusal to answer instead (nothing counted). ``done`` must follow a None, whatever happens."""
        if consumer is None:
            return None
        claim = getattr(request.protocol, "claim", None)  # a GuardedRequestHandler (router.http.connections)
        if claim is not None:
            cap = self._connection_cap(consumer, request.protocol.gate.keyed_cap)  # type: ignore[union-attr]
            if not claim(consumer.name, cap):
                return self._refuse(
                    "consumer_connections",
                    f"consumer {consumer.name} already has {cap} client connections open to this router "
                    f"process (at most {cap}: "
                    + (
                        "router.http.max_connections_per_consumer"
                        if self.max_connections
                        else "its weighted share of router.http.max_client_connections"
                    )
                    + "); this connection is closed: reuse the open ones (fewer at a time)",
                    close=True,
                )
        size = request.content_length if request.body_exists else 0
        if size is None:
            size = self.max_request_bytes
        held = self.body_bytes.get(consumer.name, 0)
        if size and held + size > self.max_body_bytes:
            return self._refuse(
                "consumer_body_bytes",
                f"consumer {consumer.name} has {held} bytes of request bodies in this router process; this "
                f"body ({size} bytes) would pass router.http.max_body_bytes_per_consumer "
                f"({self.max_body_bytes}): refused unread, send fewer or smaller requests at a time",
                close=False,  # aiohttp drains the unread body, bounded (router.http.bodies), unbuffered
            )
        if size:
            self.body_bytes[consumer.name] = held + size
            request[BODY_BYTES] = size
        return None

    def done(self, request: web.Request, consumer: Consumer | None) -> None:
        """The request ``admit`` let through has ended: its body bytes go back."""
        size = request.pop(BODY_BYTES, 0)
        if not size or consumer is None:
            return
        left = self.body_bytes.get(consumer.name, 0) - size
        if left > 0:
            self.body_bytes[consumer.name] = left
        else:
            self.body_bytes.pop(consumer.name, None)
