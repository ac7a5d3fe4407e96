"""A small read-only JSON status endpoint on the driver's node, next to the router's ``/metrics``.

``GET /status`` answers the job's current state (phase, router URL, the fleet snapshot with every
engine's health state and restarts); ``GET /events?n=50`` the last events. Scripts and dashboards that
cannot read the job directory (another cluster's login node, a monitoring system) get the same facts
over HTTP. It is read-only by construction: no route changes anything, so it needs no token; it binds the
node's own address like the router.

A stdlib ``ThreadingHTTPServer`` on a daemon thread: a handful of requests a second at most, and it must
not share the router's event loop (the router lives in a Ray actor anyway).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from launcher.jobdir import JobDir


def parse_count(raw: str) -> int | None:
    """``n`` of ``/events?n=``: a positive integer, else None (answered 400; ``n=0`` used to return every
    event, and ``n=abc`` closed the connection from inside the handler)."""
    raw = raw.strip()
    if not raw.isdigit() or len(raw) > 9:
        return None
    n = int(raw)
    return n if n > 0 else None


class StatusServer:
    def __init__(self, job: JobDir, host: str, port: int) -> None:
        self.job = job
        handler = self._handler()
        self.server = ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="status-endpoint", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StatusServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        job = self.job

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                if parts.path == "/status":
                    self._json(200, job.read_state())
                elif parts.path == "/events":
                    raw = (parse_qs(parts.query, keep_blank_values=True).get("n") or ["50"])[0]
                    n = parse_count(raw)
                    if n is None:
                        self._json(400, {"error": f"n must be a positive integer (got {raw[:40]!r})"})
                    else:
                        self._json(200, {"events": job.read_events()[-n:]})
                else:
                    self._json(404, {"error": f"{parts.path} not found; try /status or /events?n=50"})

            def _json(self, status: int, payload: object) -> None:
                body = json.dumps(payload, default=str).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
