"""Worker processes that share the router's port: every core parses, hashes and relays; one state decides.

One Python process tops out near one core of parsing and relaying (measured in bench/README.md), and a rollout
fleet of 64 engines sends more than that. So with ``RouterConfig.workers = N > 1`` the router process (the
*parent*) keeps everything that must be one (the serving set, the prober, the admin API, the policy's prefix
index, the in-flight and byte counts: ``router.state.routing.LocalRouting``) and starts N worker processes
that accept on the parent's listening socket and do the per-request work. Each decision is one round trip to
the parent over a Unix socket (``router.multiprocess.decisions``); everything else a worker does alone.

Choices, each against a failure:

* The parent binds and listens before any worker exists and keeps the socket for its whole life; workers
  inherit the descriptor (``pass_fds``) and accept on it. The URL is valid from the constructor on, and a
  dying worker never closes the port: its unaccepted connections stay queued for the others (with
  ``SO_REUSEPORT`` they would be reset with the dead worker's socket).
* Workers are started with ``python -m router.multiprocess.workers`` (not ``fork``: the parent has an event
  loop thread, and in a Ray actor, Ray's threads). The configuration, secrets included, arrives on the
  worker's stdin: secrets never appear in argv.
* All workers hash prompts with the same ``PYTHONHASHSEED`` (chosen once per router, kept for
  replacements): the prefix index holds hashes computed by every worker, and a session's next turn parsed
  by another worker must find its own blocks.
* A worker answers the proxied routes, ``/health`` (it is alive: that is the question) and its 404 itself.
  What it relays to the parent's application, on a private Unix socket, is decided by the marks the
  parent registered its routes with (``router.http.auth.RouteTable``; the list arrives with the
  configuration): every *admin* route (``/workers``, ``/fleet/*``, and any added later), so each acts on
  the one routing state, and the other open routes (``/readiness``, ``/metrics``), which read the parent's
  state: only the parent knows the serving set, and ``/metrics`` must be the router's numbers summed over
  every worker, not the fraction one worker saw. (A route registered without a mark never gets this
  far: the router does not start with one.)
* Nothing is relayed unbounded: an admin body is read by the admin check bound to the route (the
  caller admitted first, then at most ``ADMIN_MAX_BODY_BYTES`` within the body deadline,
  ``router.http.bodies``) before it is relayed; an open route's body is never read nor relayed (aiohttp
  drains it for at most the body deadline); every relay has a deadline, and the parent's answer is
  read up to ``RELAY_MAX_ANSWER_BYTES``. Before, every
  unproxied route relayed whatever body it got, read whole with no cap and no deadline: a few clients
  trickling bodies to ``/health`` held their connections for ever, and four 60 MB bodies cost 500 MB.
  Authentication is checked by both the worker and the parent. With a consumers file
  (``router.consumers``) each process reads it into a ``ConsumerKeys`` of its own, so a consumer's key is
  checked, and a revoked one refused, by whichever worker accepts the connection; the consumer's name and
  weight then travel with the request's decision to the parent, where the fair share and the
  per-consumer counts live.
* The fleet pause holds requests in the parent (``router.multiprocess.decisions``: a generation request's
  decision waits at the routing state's one ``PauseGate``), and ``/fleet/*`` reaches the parent through the
  relay below like every admin route, so a pause closes every worker's door at once and the gate's bounds and
  numbers are the router's, not a worker's.
* With a request record (``RouterConfig.record_dir``) each worker writes its own file,
  ``requests-w<index>.jsonl`` (``router.record.writer``), within its share of the record's size cap; a
  replacement appends to its predecessor's. No file is shared between processes, so no lock is.
* A worker that exits is replaced within ``SUPERVISE_S``; what it held in flight is released by the parent
  when its channel closes. A worker whose channel closes (the parent died) exits: no orphan serves the port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from router.config import SECRET_FIELDS, RouterConfig
from router.consumers import ConsumerKeys
from router.fleet.fleet import ENGINE_TIMEOUT_S
from router.http.app import PROXIED_ROUTES, build_app, health, not_found, serve_guarded
from router.http.auth import Access, MarkedRoute, RouteTable
from router.http.capability import bounded_body, capability_path
from router.http.forwarding import Forwarder, ForwardingConfig
from router.http.headers import HOP_BY_HOP
from router.http.status import error_body
from router.multiprocess.decisions import DecisionService, WorkerChannel
from router.multiprocess.remote import RemoteRouting
from router.policies import make_policy
from router.record.metrics import watch_record
from router.record.writer import RecordWriter
from router.state.metrics import RouterMetrics, Snapshot, per_request_snapshot
from router.state.routing import LocalRouting

log = logging.getLogger(__name__)

SUPERVISE_S = 0.2
STATS_TIMEOUT_S = 2.0
STOP_GRACE_S = 5.0
# An open route relayed for the parent's state (/readiness, /metrics, which asks every worker for its
# numbers within STATS_TIMEOUT_S) answers well within this.
STATE_RELAY_TIMEOUT_S = 30.0
# Beyond the longest wait an admin route has of its own (POST /workers waits worker_health_timeout_s for
# the engine's /health; a fleet operation waits ENGINE_TIMEOUT_S for the engines).
ADMIN_RELAY_MARGIN_S = 30.0
RELAY_MAX_ANSWER_BYTES = 64 * 1024 * 1024


class WorkerFleet:
    """The parent's side: starts, supervises and stops the worker processes; serves their decisions."""

    start_timeout_s = 120.0

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.count = config.workers
        self.restarts = 0
        # Made by ``open`` when serving starts, so a router that fails to bind leaves nothing behind.
        self._dir: str | None = None
        self.decisions_path = ""
        self.admin_path = ""
        # One seed for every worker of this router, replacements included (see module doc).
        self._hash_seed = str(random.SystemRandom().randrange(1, 2**32 - 1))
        self._procs: list[subprocess.Popen[bytes] | None] = [None] * self.count
        self._socket: socket.socket | None = None
        self._service: DecisionService | None = None
        self._server: asyncio.AbstractServer | None = None
        self._supervisor: asyncio.Task[None] | None = None
        self._stopping = False
        self._snapshots: dict[int, Snapshot] = {}
        self._retired: list[Snapshot] = []
        self._routes: list[MarkedRoute] = []

    def relay_routes(self, routes: list[MarkedRoute]) -> None:
        """The routes of the parent's application with their marks: what workers relay (module doc)."""
        self._routes = list(routes)

    def attach(self, routing: LocalRouting) -> None:
        self._service = DecisionService(routing)
        # The workers' forwarders hear of moves and version stamps from the one routing state.
        routing.backends.move_listeners.append(self._service.move_off)
        routing.versions.listeners.append(self._service.version_changed)

    def listen_on(self, sock: socket.socket) -> None:
        self._socket = sock

    # -- lifecycle (on the parent's loop) ---------------------------------------------------------------
    def open(self) -> None:
        """The private directory of the two Unix sockets (0700: only this user reaches them)."""
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="rl-router-")
            self.decisions_path = os.path.join(self._dir, "decisions.sock")
            self.admin_path = os.path.join(self._dir, "admin.sock")

    async def start(self) -> None:
        assert self._service is not None and self._socket is not None
        loop = asyncio.get_running_loop()
        service = self._service
        self._server = await loop.create_unix_server(service.channel, self.decisions_path)
        ready: set[int] = set()
        all_ready = loop.create_future()

        def on_ready(channel: WorkerChannel) -> None:
            ready.add(channel.index)
            if len(ready) >= self.count and not all_ready.done():
                all_ready.set_result(None)

        service.watch_ready(on_ready)
        for index in range(self.count):
            self._spawn(index)
        try:
            await asyncio.wait_for(all_ready, self.start_timeout_s)
        except TimeoutError:
            raise RuntimeError(
                f"only {len(ready)} of {self.count} router worker processes started within "
                f"{self.start_timeout_s:g} s (see their stderr above)"
            ) from None
        self._supervisor = loop.create_task(self._supervise())

    def _spawn(self, index: int) -> None:
        assert self._socket is not None
        fd = self._socket.fileno()
        payload = {
            "config": self.config.model_dump(mode="json"),
            "secrets": {name: self.config.secret(name) for name in SECRET_FIELDS},
            "routes": [r.to_json() for r in self._routes],
        }
        env = {**os.environ, "PYTHONHASHSEED": self._hash_seed}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router.multiprocess.workers",
                "--listen-fd",
                str(fd),
                "--decisions",
                self.decisions_path,
                "--admin",
                self.admin_path,
                "--index",
                str(index),
            ],
            stdin=subprocess.PIPE,
            pass_fds=(fd,),
            env=env,
            start_new_session=False,
        )
        assert proc.stdin is not None
        proc.stdin.write(orjson.dumps(payload))
        proc.stdin.close()
        self._procs[index] = proc

    async def _supervise(self) -> None:
        while not self._stopping:
            await asyncio.sleep(SUPERVISE_S)
            for index, proc in enumerate(self._procs):
                if self._stopping:
                    return
                if proc is not None and proc.poll() is not None:
                    self.restarts += 1
                    # Its counts stay in the sums: requests it answered were answered, and a counter
                    # must not go down.
                    last = self._snapshots.pop(index, None)
                    if last is not None:
                        self._retired.append(last)
                    log.warning(
                        "router worker %d (pid %d) exited with %s; starting a replacement",
                        index,
                        proc.pid,
                        proc.returncode,
                    )
                    self._spawn(index)

    async def stop(self) -> None:
        self._stopping = True
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
        procs = [p for p in self._procs if p is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_GRACE_S
        loop = asyncio.get_running_loop()
        for proc in procs:
            try:
                await loop.run_in_executor(None, proc.wait, max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._service is not None:
            self._service.close()  # requests still held at the pause gate: their workers are gone
        if self._server is not None:
            self._server.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def pids(self) -> list[int]:
        return [p.pid if p is not None and p.poll() is None else 0 for p in self._procs]

    # -- metrics (router.state.metrics.WorkerStats) -------------------------------------------------------
    def snapshots(self) -> dict[int, Snapshot]:
        return dict(self._snapshots)

    def serving(self) -> int:
        """Worker processes connected to the routing state and accepting on the port."""
        return 0 if self._service is None else len(self._service.ready_channels())

    def retired(self) -> list[Snapshot]:
        return list(self._retired)

    async def refresh(self) -> None:
        if self._service is None:
            return
        channels = self._service.ready_channels()
        answers = await asyncio.gather(*(c.ask_stats(STATS_TIMEOUT_S) for c in channels))
        for channel, answer in zip(channels, answers, strict=True):
            if answer is not None:
                self._snapshots[channel.index] = orjson.loads(answer)


# -- the worker process -----------------------------------------------------------------------------------
_RELAY_DROP = frozenset(n.decode() for n in HOP_BY_HOP) | {"host", "content-length", "date", "server"}


class ParentRelay:
    """Routes the parent owns, relayed to its application unchanged, each with a deadline."""

    def __init__(self, admin_path: str, admin_timeout_s: float) -> None:
        self._path = admin_path
        self._admin_timeout = aiohttp.ClientTimeout(total=admin_timeout_s)
        self._state_timeout = aiohttp.ClientTimeout(total=STATE_RELAY_TIMEOUT_S)
        self._session: aiohttp.ClientSession | None = None

    async def admin(self, request: web.Request) -> web.Response:
        """An admin route: the access check admitted the caller and read the body (capped, in time)."""
        body = await request.read() if request.body_exists else None
        return await self._relay(request, body, self._admin_timeout)

    async def state(self, request: web.Request) -> web.Response:
        """An open route that reads the parent's state: it takes no body, so none is read or relayed."""
        return await self._relay(request, None, self._state_timeout)

    async def _relay(
        self, request: web.Request, body: bytes | None, deadline: aiohttp.ClientTimeout
    ) -> web.Response:
        try:
            return await self._send(request, body, deadline)
        except TimeoutError:
            message = f"the router process did not answer within {deadline.total:g} s"
            return web.Response(
                status=500, body=error_body(message, "relay_timeout", 500), content_type="application/json"
            )

    async def _send(
        self, request: web.Request, body: bytes | None, deadline: aiohttp.ClientTimeout
    ) -> web.Response:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(self._path, limit=0), auto_decompress=False
            )
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in _RELAY_DROP)
        async with self._session.request(
            request.method,
            "http://router" + request.rel_url.raw_path_qs,
            headers=headers,
            data=body,
            allow_redirects=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            timeout=deadline,
        ) as answer:
            parts: list[bytes] = []
            size = 0
            async for chunk in answer.content.iter_any():
                size += len(chunk)
                if size > RELAY_MAX_ANSWER_BYTES:
                    raise web.HTTPInternalServerError(text="the router's answer exceeds the relay's cap")
                parts.append(chunk)
            out = CIMultiDict((k, v) for k, v in answer.headers.items() if k.lower() not in _RELAY_DROP)
            return web.Response(status=answer.status, body=b"".join(parts), headers=out)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def worker_routes(
    table: RouteTable, relay: ParentRelay, parent_routes: list[MarkedRoute], body_timeout_s: float = 10.0
) -> None:
    """Everything but the proxied routes, in a worker: ``/health`` answered here, the parent's admin
    routes, its capability routes other than the proxied ones and its other open routes relayed (module
    doc), the router's 404 for the rest."""
    table.add("GET", "/health", health, Access.OPEN)
    proxied = {(m, capability_path(p)) for p, methods in PROXIED_ROUTES for m in methods}
    for route in parent_routes:
        if route.access in (Access.ADMIN, Access.OWNER):
            table.add(route.method, route.path, relay.admin, route.access)
        elif route.access is Access.CAPABILITY and (route.method, route.path) not in proxied:
            # Checked here and again by the parent, which sees the same path.
            table.add(route.method, route.path, bounded_body(relay.admin, body_timeout_s), route.access)
        elif route.access is Access.OPEN and (route.method, route.path) != ("GET", "/health"):
            table.add(route.method, route.path, relay.state, Access.OPEN)
        # Client routes are the proxied ones, served by the worker itself, and the parent's 404.
    table.add("*", "/{tail:.*}", not_found, Access.CLIENT)


def admin_relay_timeout_s(config: RouterConfig) -> float:
    return max(config.worker_health_timeout_s, ENGINE_TIMEOUT_S) + ADMIN_RELAY_MARGIN_S


async def serve_worker(
    config: RouterConfig,
    sock: socket.socket,
    decisions: str,
    admin: str,
    index: int,
    parent_routes: list[MarkedRoute],
) -> None:
    loop = asyncio.get_running_loop()
    stopped = asyncio.Event()
    policy = make_policy(config.policy, **config.policy_options)
    metrics = RouterMetrics(None, policy.name)
    _, routing = await loop.create_unix_connection(
        lambda: RemoteRouting(policy, stopped.set, lambda: per_request_snapshot(metrics.registry)),
        decisions,
    )
    routing.hello(index, os.getpid())
    # This worker's own record file (requests-w<index>.jsonl); its counts are summed by the parent, which
    # reports the directory's bytes.
    record = RecordWriter.of(config, index)
    watch_record(metrics, record, None)
    forwarder = Forwarder(
        routing,
        policy,
        metrics,
        ForwardingConfig.of(config),
        record,
    )
    forwarder.use_limits(config.http)
    routing.engine_watch = forwarder.engine_watch  # the parent's MOVE_OFF / VERSION frames reach it
    relay = ParentRelay(admin, admin_relay_timeout_s(config))
    app = build_app(
        forwarder,
        config.secret("api_key"),
        config.admin_secret,
        config.max_request_bytes,
        config.http,
        lambda table: worker_routes(table, relay, parent_routes, config.http.body_timeout_s),
        ConsumerKeys(config.consumers_file) if config.consumers_file is not None else None,
        config.secret("registration_capability"),
    )
    runner, _gate = await serve_guarded(app, sock, config.http, metrics, share=config.workers)
    loop.add_signal_handler(signal.SIGTERM, stopped.set)
    routing.ready()
    try:
        await stopped.wait()
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(runner.cleanup(), STOP_GRACE_S)
        await forwarder.close()
        await relay.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one worker process of rl-launch's router (started by it)")
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--decisions", required=True)
    parser.add_argument("--admin", required=True)
    parser.add_argument("--index", type=int, required=True)
    args = parser.parse_args(argv)
    # Ctrl-C reaches the whole process group; the parent stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.WARNING, format=f"router worker {args.index}: %(levelname)s %(message)s"
    )
    payload = orjson.loads(sys.stdin.buffer.read())
    config = RouterConfig.model_validate(
        {**payload["config"], **{k: v for k, v in payload["secrets"].items() if v is not None}}
    )
    routes = [MarkedRoute.from_json(r) for r in payload["routes"]]
    sock = socket.socket(fileno=args.listen_fd)
    sock.setblocking(False)
    serve = serve_worker(config, sock, args.decisions, args.admin, args.index, routes)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(serve)
    else:
        uvloop.run(serve)


if __name__ == "__main__":
    main()
