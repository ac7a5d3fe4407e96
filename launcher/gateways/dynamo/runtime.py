"""Dynamo's runtime for one job, on the driver node: etcd (discovery) and NATS (events), each refusing
anyone without the job's own credentials.

Why credentials and not only an address: on a cluster the workers on the generation nodes must reach both
over the network, and without authentication anyone who can reach those ports reads and writes the
discovery keys (a fake worker registered there gets a share of the generation requests, and its
completions go into training) or publishes forged events. What was checked with ai-dynamo-runtime 1.6.1
(its Rust runtime reads these variables; a wrong value makes a worker or the frontend fail to start):

* **etcd**: ``ETCD_AUTH_USERNAME`` / ``ETCD_AUTH_PASSWORD``. After etcd is healthy the driver adds the
  ``root`` user (a random password kept in memory only and then forgotten: nothing administers this etcd
  afterwards), a role with read-write on every key and the job's user, and turns ``auth enable`` on,
  through etcd's v3 JSON gateway on the client port (a POST body, so no password is ever in argv; Debian's
  etcd-server has no etcdctl). From then on a client without a token gets "user name is empty".
  ``--auth-token-ttl``: the runtime's etcd client does not re-authenticate when its simple token expires
  (with a 5 s TTL the frontend lost its instance list and a restarted worker its lease within a minute),
  so tokens live as long as this etcd, which dies with the job.
  The peer port serves nobody (one member): it listens on loopback.
* **NATS**: ``NATS_AUTH_TOKEN``. The server gets its address, JetStream directory and token from a config
  file (``-c``, 0600, in the 0700 runtime directory), never from argv. Without a token, and with the
  ``user``/``user`` the runtime falls back to when it has none, a client gets "Authorization Violation".

The secrets are ``<job>/secrets/dynamo_etcd_password`` and ``dynamo_nats_token`` (0600, made per job by
``JobDir.new_secret``); ``DynamoPlanes.secret_files`` names them, and every process that starts a worker
or the frontend reads them into that process's environment.

Left open (docs/fronts.md's "Behind Dynamo" says so, and ``cluster: slurm`` refuses to start without
``router.dynamo.allow_insecure_network``): etcd and NATS traffic is not encrypted (no TLS: the password and
token cross the network in clear text), and what the workers themselves listen on (see
``launcher.gateways.dynamo``). etcd 3.4 also writes the user-add request, password included, into its
write-ahead log (3.5 hashes it first): its data directory is 0700 inside the 0700 runtime directory, which
teardown removes.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.gateways.base import GatewayError
from launcher.jobdir import JobDir
from router.ports import free_port

ETCD_USER = "rl-launch"
ETCD_PASSWORD_SECRET = "dynamo_etcd_password"
NATS_TOKEN_SECRET = "dynamo_nats_token"
# Longer than any job runs (10 years): see the module docstring.
ETCD_TOKEN_TTL_S = 10 * 365 * 24 * 3600


class ManagedProcess:
    """One runtime process (etcd, NATS, the frontend) in its own session, logged to a file."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"# rl-launch: starting {self.name}: {shlex.join(self.argv)}\n".encode())
            out.flush()
            try:
                self.proc = subprocess.Popen(
                    self.argv,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                )
            except OSError as exc:
                raise GatewayError(f"cannot start {self.name} ({self.argv[0]}): {exc}") from exc
        return self

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        # The group may hold children after the leader exited (the frontend's helpers): SIGKILL them.
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def private_dir(path: Path) -> Path:
    """``path`` made (if needed) and set to 0700: the runtime's data, the NATS config with its token and
    the file-discovery directory are the job owner's only."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def write_private(path: Path, text: str) -> None:
    """``text`` into a file created 0600 (never readable by others, not even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def nats_config(host: str, port: int, store_dir: Path, token: str) -> str:
    """The NATS server's whole configuration (strings JSON-quoted, which NATS' config format reads)."""
    return (
        f"listen: {json.dumps(f'{host}:{port}')}\n"
        f"jetstream {{ store_dir: {json.dumps(str(store_dir))} }}\n"
        f"authorization {{ token: {json.dumps(token)} }}\n"
    )


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _etcd_post(endpoint: str, path: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(
        f"{endpoint}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:  # etcd's message names the problem, never the password
        detail = exc.read().decode(errors="replace")[:300]
        raise GatewayError(f"etcd {endpoint}: {path} failed (HTTP {exc.code}): {detail}") from None
    except OSError as exc:
        raise GatewayError(f"etcd {endpoint}: {path} failed: {exc}") from None


def enable_etcd_auth(endpoint: str, user: str, password: str) -> None:
    """Turn on etcd's authentication with ``user`` (read-write on every key) as the only user besides a
    ``root`` whose password nobody keeps. ``endpoint``: ``http://host:port`` of a fresh etcd."""
    root_password = secrets.token_urlsafe(32)
    every_key = {"permType": "READWRITE", "key": _b64("\0"), "range_end": _b64("\0")}
    for path, body in (
        ("/v3/auth/user/add", {"name": "root", "password": root_password}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/role/add", {"name": user}),
        ("/v3/auth/role/grant", {"name": user, "perm": every_key}),
        ("/v3/auth/user/add", {"name": user, "password": password}),
        ("/v3/auth/user/grant", {"user": user, "role": user}),
        ("/v3/auth/enable", {}),
    ):
        _etcd_post(endpoint, path, body)


class EtcdNats:
    """etcd on two free ports (client on ``host``, peer on loopback) and ``nats-server`` with JetStream
    on a third, data under ``data_dir``, logs in the job's ``logs/``; both require the job's credentials
    once ``start`` returns."""

    def __init__(self, job: JobDir, host: str, data_dir: Path, say: Callable[[str], None]) -> None:
        self.job, self.host, self.data_dir, self.say = job, host, data_dir, say
        self.procs: list[ManagedProcess] = []

    def start(self, lease_ttl_s: int) -> tuple[dict[str, str], dict[str, str]]:
        """Start both and turn etcd's authentication on; return the workers' and the frontend's
        environment (``DynamoPlanes.env``) and their credentials (``DynamoPlanes.secret_files``)."""
        etcd_bin, nats_bin = shutil.which("etcd"), shutil.which("nats-server")
        if etcd_bin is None or nats_bin is None:
            missing = " and ".join(n for n, b in (("etcd", etcd_bin), ("nats-server", nats_bin)) if not b)
            raise GatewayError(
                f"router.dynamo.discovery is 'etcd' but {missing} is not on PATH on the driver node "
                "(Debian: apt-get install etcd-server nats-server), or use discovery: file"
            )
        host = self.host
        password_file = self.job.new_secret(ETCD_PASSWORD_SECRET)
        token_file = self.job.new_secret(NATS_TOKEN_SECRET)
        client, peer, nats = free_port(host), free_port("127.0.0.1"), free_port(host)
        logs = self.job.logs
        etcd = ManagedProcess(
            "etcd",
            [
                etcd_bin,
                "--name", "rl-launch",
                "--data-dir", str(self.data_dir / "etcd"),
                "--listen-client-urls", f"http://{host}:{client}",
                "--advertise-client-urls", f"http://{host}:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"rl-launch=http://127.0.0.1:{peer}",
                "--auth-token-ttl", str(ETCD_TOKEN_TTL_S),
            ],
            logs / "dynamo-etcd.log",
        ).start()  # fmt: skip
        self.procs.append(etcd)
        conf = self.data_dir / "nats.conf"
        write_private(conf, nats_config(host, nats, self.data_dir / "nats", token_file.read_text().strip()))
        nats_proc = ManagedProcess(
            "nats-server", [nats_bin, "-c", str(conf)], logs / "dynamo-nats.log"
        ).start()
        self.procs.append(nats_proc)
        deadline = time.monotonic() + 30
        while True:
            dead = self.dead()
            if dead:
                raise GatewayError(dead)
            if _etcd_healthy(host, client) and _accepts(host, nats):
                break
            if time.monotonic() > deadline:
                raise GatewayError(
                    f"Dynamo runtime not ready in 30 s (etcd {host}:{client}, NATS {host}:{nats}); logs "
                    f"{etcd.log}, {nats_proc.log}"
                )
            time.sleep(0.2)
        enable_etcd_auth(f"http://{host}:{client}", ETCD_USER, password_file.read_text().strip())
        up = (
            f"Dynamo runtime up: etcd {host}:{client}, NATS {host}:{nats} (JetStream); both require the "
            f"job's credentials ({password_file.parent})"
        )
        self.say(up)
        self.job.log_event("gateway_runtime", up)  # `submit --follow` and `status` show events
        env = {
            "ETCD_ENDPOINTS": f"http://{host}:{client}",
            "ETCD_AUTH_USERNAME": ETCD_USER,
            "NATS_SERVER": f"nats://{host}:{nats}",
            # How long a dead worker stays in the frontend's instance list (its etcd lease).
            "ETCD_LEASE_TTL": str(lease_ttl_s),
        }
        return env, {"ETCD_AUTH_PASSWORD": str(password_file), "NATS_AUTH_TOKEN": str(token_file)}

    def dead(self) -> str | None:
        for proc in self.procs:
            code = proc.exited()
            if code is not None:
                return f"Dynamo {proc.name} exited with {code}; log {proc.log}:\n{proc.tail()}"
        return None

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def _get_json(url: str, timeout_s: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read() or b"null")


def _etcd_healthy(host: str, port: int) -> bool:
    try:
        return bool(_get_json(f"http://{host}:{port}/health", 1.0).get("health") == "true")
    except (OSError, ValueError, AttributeError, urllib.error.URLError):
        return False


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False
