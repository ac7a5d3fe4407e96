"""Pick a free TCP port for a server we start as a separate process.

Why: vLLM has no "bind port 0 and tell me which port you got" mode, so the launcher must choose the port
before it starts the server. We ask the OS for an ephemeral port by binding port 0, read it back, and
close the socket. That leaves a small race: between our close and vLLM's bind, another process could
take the same port. It is acceptable here because (a) ephemeral ports are handed out round-robin by the
kernel, so an immediate reuse by an unrelated bind(0) is unlikely, (b) a lost race is not silent: vLLM
fails to bind and exits, ``VllmEngine.wait_ready`` then raises ``EngineStartError`` with the "address
already in use" log tail, and the caller can retry with a new port. Passing the listening socket's fd to
the child would close the race but needs server support vLLM's CLI does not offer for all versions.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (see the module docstring for the race).

    ``SO_REUSEADDR`` is deliberately *not* set: we want a port with no socket in any state on it, so the
    child's bind (which vLLM/uvicorn does with ``SO_REUSEADDR``) succeeds even right after our close.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
