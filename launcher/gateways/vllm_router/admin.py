"""vllm-router's admin API as rl-launch drives it, and the registrar that converges its worker set.

Facts of vllm-router 0.1.17 this code is built on (checked against the real binary in
``tests/slurm/test_gateway_vllm_router.py``):

* ``POST /workers {"url": ...}`` blocks until the router's own ``GET {url}/health`` passes (polled every
  ``--worker-startup-check-interval``), then answers 200; a URL it already has answers 400 "already
  exists", which means registered, not failed.
* ``DELETE /workers/<percent-encoded url>`` answers 200 even for an unknown worker.
* ``GET /workers`` lists what it routes to, with its own ``is_healthy``.
* ``/health`` is 503 while *any* worker is unhealthy: useless as the router's own liveness, so
  ``/liveness`` (the process answers) and ``/readiness`` (it has a healthy worker) are probed instead.

Why registrations run in the background: a POST blocks for as long as the engine takes to pass the
router's health check (up to the router's startup timeout); the fleet controller's tick must not wait on
it, or every other engine's health would go unjudged meanwhile.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from launcher.gateways.vllm_router.command import root_url
from launcher.net.http_call import open_url

_CALL_TIMEOUT_S = 5.0
# A POST waits on the router's health check of the engine; the registrar's own bound on one attempt
# (a still-pending registration is simply tried again on a later tick).
REGISTER_TIMEOUT_S = 60.0


class AdminError(RuntimeError):
    """vllm-router's admin API answered something other than success (the message says what)."""


class VllmRouterAdmin:
    """Blocking calls to one vllm-router's admin surface (``base`` without ``/v1``)."""

    def __init__(self, base: str) -> None:
        self.base = root_url(base)

    def _call(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float = _CALL_TIMEOUT_S
    ) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with open_url(req, timeout=timeout_s) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def live(self) -> bool:
        """The router process answers (``/liveness``), whatever its workers' health."""
        try:
            return self._call("GET", "/liveness")[0] == 200
        except OSError:
            return False

    def ready(self) -> bool:
        """It has a healthy worker to route to (``/readiness``)."""
        try:
            return self._call("GET", "/readiness")[0] == 200
        except OSError:
            return False

    def workers(self) -> list[dict[str, Any]]:
        """``GET /workers``: what the router routes to, with its own ``is_healthy``."""
        status, data = self._call("GET", "/workers")
        if status != 200 or not isinstance(data, dict):
            raise AdminError(f"GET {self.base}/workers answered {status}: {str(data)[:200]}")
        return [w for w in data.get("workers") or [] if isinstance(w, dict) and isinstance(w.get("url"), str)]

    def worker_urls(self) -> set[str]:
        return {root_url(w["url"]) for w in self.workers()}

    def add(self, url: str, timeout_s: float = REGISTER_TIMEOUT_S) -> None:
        """Register ``url`` (returns once routable); "already exists" counts as registered."""
        status, data = self._call("POST", "/workers", {"url": root_url(url)}, timeout_s=timeout_s)
        if status == 200 or (status == 400 and "already exists" in str(data)):
            return
        raise AdminError(f"POST {self.base}/workers {root_url(url)} answered {status}: {str(data)[:200]}")

    def remove(self, url: str) -> None:
        quoted = urllib.parse.quote(root_url(url), safe="")
        status, data = self._call("DELETE", f"/workers/{quoted}")
        if status != 200:
            raise AdminError(f"DELETE {self.base}/workers/{quoted} answered {status}: {str(data)[:200]}")


class Registrar:
    """Converges one vllm-router's worker set on the serving set the fleet controller pushes.

    ``converge`` reads ``GET /workers`` every time (a router restarted by its owner comes back empty),
    removes at once the workers this job registered that no longer serve, and starts a background
    registration for every serving engine the router lacks.

    A worker this job never registered is a *foreign* one: vllm-router 0.1.17 lets anyone who reaches it
    ``POST /workers``, and passes each client's ``Authorization`` (the job's API key) on to whichever
    worker it routes to. So with ``owns_router`` (the managed router: the job's alone) every foreign worker
    is removed on the tick that sees it; a router this job only attached to (external, perhaps shared by
    several jobs) keeps its owner's workers, and each foreign one is reported once (``note("foreign")``):
    rollouts may be routed there, with the job's key. Workers are compared as the router lists them
    (``http://e:1/v1`` is not ``http://e:1``: requests to it would go to ``/v1/v1/...``).
    """

    REPEAT_NOTE_S = 60.0
    """A foreign worker re-added as fast as it is removed is removed every tick, noted once a minute."""

    def __init__(
        self,
        admin: VllmRouterAdmin,
        say: Callable[[str], None] = lambda m: None,
        note: Callable[[str, str, str], None] = lambda action, url, why: None,
        owns_router: bool = False,
    ) -> None:
        self.admin = admin
        self.say = say
        self.note = note
        """``note(action, url, why)`` once a worker is ``registered`` or ``deregistered`` (this job's),
        ``removed`` (a foreign one, from a router the job owns) or seen as ``foreign`` (in a router it
        does not own): the job's events."""
        self.owns_router = owns_router
        self.ours: set[str] = set()
        """Every engine URL this job asked the router to route to (what ``stop`` deregisters)."""
        self.foreign: set[str] = set()
        """Workers of the router this job did not register, as of the last ``converge``."""
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._closed = False
        self._warned: set[str] = set()
        self._removed_at: dict[str, float] = {}

    def converge(self, urls: Iterable[str]) -> None:
        desired = {root_url(u) for u in urls}
        current = {w["url"] for w in self.admin.workers()}  # as listed: what DELETE must name
        with self._lock:
            self.ours |= desired
            stale = (current & self.ours) - desired
            foreign = current - self.ours
            self.foreign = foreign
            missing = desired - current - set(self._pending)
            for url in missing if not self._closed else ():
                # Daemon threads, one per engine being registered (deduplicated): a POST still waiting
                # on an engine must never hold up the driver's exit.
                self._pending.add(url)
                threading.Thread(
                    target=self._register, args=(url,), name="vllm-router-register", daemon=True
                ).start()
        for url in sorted(stale):
            self.admin.remove(url)
            self.say(f"vllm-router: {url} deregistered (not serving)")
            self.note("deregistered", url, "not serving")
        for url in sorted(foreign):
            if self.owns_router:
                self._remove_foreign(url)
            elif url not in self._warned:
                self._warned.add(url)
                why = (
                    "not this job's engine: rollouts may be routed to it with the job's API key in "
                    "Authorization (an external router's workers are its owner's: left in place)"
                )
                self.say(f"vllm-router: WARNING {url} is {why}")
                self.note("foreign", url, why)

    def _remove_foreign(self, url: str) -> None:
        why = (
            "not one of this job's engines (added by someone else with POST /workers): it would receive "
            "rollouts with the job's API key"
        )
        try:
            self.admin.remove(url)
        except (OSError, AdminError) as exc:
            self.say(f"vllm-router: could not remove foreign worker {url}, retried next tick: {exc}")
            return
        now = time.monotonic()
        if now - self._removed_at.get(url, -self.REPEAT_NOTE_S) >= self.REPEAT_NOTE_S:
            self._removed_at[url] = now
            self.say(f"vllm-router: removed {url}: {why}")
            self.note("removed", url, why)

    def _register(self, url: str) -> None:
        try:
            self.admin.add(url)
            with self._lock:
                closed = self._closed
            if closed:  # the job ended while this POST waited: leave no worker of ours behind
                self.admin.remove(url)
                return
            self.note("registered", url, "serving")
        except (OSError, AdminError) as exc:
            self.say(f"vllm-router: registering {url} failed, retried next tick: {exc}")
        finally:
            with self._lock:
                self._pending.discard(url)

    def register_all(self, urls: Sequence[str], timeout_s: float) -> None:
        """Register ``urls`` now and wait for every one (the gateway's start); raises on the first failure."""
        with self._lock:
            self.ours |= {root_url(u) for u in urls}
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(urls)))) as pool:
            for f in [pool.submit(self.admin.add, u, timeout_s) for u in urls]:
                f.result()

    def close(self) -> None:
        """No new registrations from now on (a pending one is undone when it completes)."""
        with self._lock:
            self._closed = True

    def deregister_ours(self) -> list[str]:
        """Remove every engine this job registered (a shared router keeps serving its other workers);
        returns the failures."""
        failed = []
        with self._lock:
            self._closed = True
            ours = sorted(self.ours)
        for url in ours:
            try:
                self.admin.remove(url)
            except (OSError, AdminError) as exc:
                failed.append(f"{url}: {exc}")
        return failed
