"""The job's reserved ports on the driver's node: chosen once from the spec's range, and held.

A port chosen by binding and closing a probe socket is free only at that moment: until the server binds
it, any local user may take it, and a front restarted in place (the router's Ray actor, ``max_restarts=-1``)
must bind the same port again after its death, when again anyone may. Whoever holds the port then receives
Gym's requests, each with the job's API key in ``Authorization``.

``PortHold`` closes both windows for a front that binds with ``SO_REUSEPORT`` beside it
(``RouterConfig.port_held``): a socket bound to the port with ``SO_REUSEPORT`` and nothing else, kept by the
driver for the job's whole life and never listening. Linux lets another socket bind the port only if it
also sets ``SO_REUSEPORT`` and belongs to the same user; connections go to listening sockets only, so the
front receives them all. Without ``SO_REUSEADDR`` on the placeholder, no one else can bind the wildcard
address over it either (checked: a second user's bind of ``127.0.0.1:P`` or ``0.0.0.0:P``, with or without
either option, is refused while the placeholder holds it). Fronts that bind their own socket without the
option (vllm-router, Ray Serve's proxy) get the port released just before they start, and keep the old,
shorter window; ``Gateway.binds_beside_port_hold`` says which.
"""

from __future__ import annotations

import os
import socket


class NoFreePort(RuntimeError):
    """Nothing in the range could be bound; the message names the range and the host."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str) -> int:
    """A port the OS says is free on ``host`` now (for servers that must be told their port)."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def reserve_port(host: str, port_range: tuple[int, int]) -> int:
    """The first port of the range free on ``host`` now, starting at an offset derived from the job id so
    two jobs sharing a node rarely probe the same ports first."""
    return PortHold.reserve(host, port_range, hold=False).port


class PortHold:
    """A port of the range, held by a placeholder socket until ``release`` (see the module doc)."""

    def __init__(self, host: str, port: int, sock: socket.socket | None) -> None:
        self.host = host
        self.port = port
        self._sock = sock

    @classmethod
    def reserve(cls, host: str, port_range: tuple[int, int], hold: bool = True) -> PortHold:
        lo, hi = port_range
        span = hi - lo + 1
        start = int(os.environ.get("SLURM_JOB_ID", os.getpid())) % span
        for i in range(span):
            port = lo + (start + i) % span
            # Probe without SO_REUSEPORT first: a socket of another job of this user that holds the port
            # with the option would let the placeholder bind beside it.
            with socket.socket(_family(host)) as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
            if not hold:
                return cls(host, port, None)
            sock = socket.socket(_family(host))
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((host, port))
            except OSError:  # taken in between: try the next one
                sock.close()
                continue
            return cls(host, port, sock)
        raise NoFreePort(f"no free port in the router port range {lo}-{hi} on {host}")

    @property
    def held(self) -> bool:
        return self._sock is not None

    def release(self) -> None:
        """Let the port go (before a front that cannot bind beside the hold starts); idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
