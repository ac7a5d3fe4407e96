"""Every port the project picks: one module, so the rules (and the races they leave) are stated once.

* ``free_port(host)``: a port the OS says is free now, for a server that must be told its port before it
  binds (vLLM, the simulator, etcd, NATS, vllm-router's metrics, a bench's router). It leaves a small race:
  between our close and the server's bind another process may take the port. A lost race is not silent:
  the server fails to bind and exits, and whoever waits for it (``VllmEngine.wait_ready``, the Dynamo
  runtime, the gateway) reports "address already in use" with its log. ``SO_REUSEADDR`` is deliberately not
  set on the probe: the port must have no socket in any state on it. A stranger can only make such a
  start fail this way (an engine is then restarted on another port), never receive its traffic: the
  launcher hands the URL out only once the server answers.
* ``free_port_in(host, range)``: the same from a fixed range (a port a restart must find again; below the
  ephemeral range, where a restart could find it taken by an outgoing connection), starting at an offset
  derived from the Slurm job id so two jobs on a node rarely probe the same ports first, or from the top.
* ``PortHold.reserve(host, range)``: a port of the range *held* for the job's life by a placeholder
  socket, for the job's front. A port chosen by probing is free only at that moment: until the front
  binds it, and again between a front's death and its restart in place (the router's Ray actor,
  ``max_restarts=-1``), any local user may take it, and whoever holds it then receives Gym's requests,
  each with the job's API key in ``Authorization``. The placeholder is bound with ``SO_REUSEPORT`` and
  nothing else, and never listens. Linux lets another socket bind the port only if it also sets
  ``SO_REUSEPORT`` and belongs to the same user, and connections go to listening sockets only, so a front
  that binds beside it (``RouterConfig.port_held``) receives them all. Without ``SO_REUSEADDR`` on the
  placeholder nobody else can bind the wildcard address over it either (checked: another user's bind of
  ``127.0.0.1:P`` or ``0.0.0.0:P``, with or without either option, is refused while it is held). Fronts
  that bind their own socket without the option (vllm-router, Ray Serve's proxy) get the port released
  just before they start (``Gateway.binds_beside_port_hold``), and keep the short window.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Iterator


class NoFreePort(RuntimeError):
    """Nothing in the range could be bound; the message names the range and the host."""


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` a moment ago, chosen by the OS (see the module doc for the race)."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _candidates(port_range: tuple[int, int], order: str) -> Iterator[int]:
    lo, hi = port_range
    span = hi - lo + 1
    if order == "top":
        yield from range(hi, lo - 1, -1)
        return
    if order == "random":
        start = random.randrange(span)
    else:
        start = int(os.environ.get("SLURM_JOB_ID", os.getpid())) % span
    for i in range(span):
        yield lo + (start + i) % span


def _bindable(host: str, port: int) -> bool:
    # Without SO_REUSEPORT: a socket of another job of this user that holds the port with the option
    # would otherwise let us bind beside it.
    with socket.socket(_family(host)) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port_in(
    host: str,
    port_range: tuple[int, int],
    *,
    order: str = "job",
    exclude: tuple[int, ...] = (),
    what: str = "",
) -> int:
    """A port of ``port_range`` free on ``host`` now. ``order``: ``job`` (from an offset derived from the
    job id), ``random`` (processes of one node starting at once), or ``top`` (from the highest down, away
    from where ``job`` starts). ``what`` names the port in the error."""
    for port in _candidates(port_range, order):
        if port not in exclude and _bindable(host, port):
            return port
    lo, hi = port_range
    raise NoFreePort(f"no free port in {lo}-{hi} on {host}{' for ' + what if what else ''}")


def reserve_port(host: str, port_range: tuple[int, int]) -> int:
    """A port of the router's range free now, not held (a listener of the launcher that binds at once)."""
    return free_port_in(host, port_range, what="the router port range")


class PortHold:
    """A port of the range, held by a placeholder socket until ``release`` (see the module doc)."""

    def __init__(self, host: str, port: int, sock: socket.socket) -> None:
        self.host = host
        self.port = port
        self._sock: socket.socket | None = sock

    @classmethod
    def reserve(cls, host: str, port_range: tuple[int, int]) -> PortHold:
        for port in _candidates(port_range, "job"):
            if not _bindable(host, port):
                continue
            sock = socket.socket(_family(host))
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                sock.bind((host, port))
            except OSError:  # taken in between: try the next one
                sock.close()
                continue
            return cls(host, port, sock)
        lo, hi = port_range
        raise NoFreePort(f"no free port in the router port range {lo}-{hi} on {host}")

    @property
    def held(self) -> bool:
        return self._sock is not None

    def release(self) -> None:
        """Let the port go (before a front that cannot bind beside the hold starts); idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
