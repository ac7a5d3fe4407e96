"""Resizing a running job from outside it: the Python calls behind ``rl-launch fleet grow/shrink``.

A request goes to the job's driver through its job directory (``launcher.fleet.elastic.shapes``); the driver
checks it against the live fleet and answers at once (a refusal names the reason and changes nothing).
``wait`` then follows the job state until the grow has joined (or failed) or the drained nodes are given
back, bounded by ``timeout_s``.

    from launcher.fleet.elastic.client import grow, shrink
    g = grow("~/rl-launch/jobs/grpo-1234", nodes=2)             # submits a grow job, returns its id
    shrink("~/rl-launch/jobs/grpo-1234", node_names=["gpu7"])   # drains gpu7, hands it back
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launcher.fleet.elastic import shapes
from launcher.fleet.elastic.shapes import ElasticAnswer, ElasticRequest
from launcher.jobdir import JobDir

ANSWER_TIMEOUT_S = 30.0


class ElasticError(RuntimeError):
    """The resize was refused or did not finish; the message is one line with the reason."""


@dataclass(frozen=True)
class ResizeResult:
    answer: ElasticAnswer
    elastic: dict[str, Any]
    """The job state's ``elastic`` section when the call returned."""


def check_resizable(job_dir: str | Path) -> JobDir:
    """The job, if its driver can resize it now; ``ElasticError`` naming why not otherwise."""
    jd = JobDir(Path(job_dir).expanduser())
    state = jd.read_state()
    name = jd.path.name
    attached = state.get("attached_to") or {}
    if attached:
        raise ElasticError(
            f"job {name} is attached to standing fleet {attached.get('fleet')!r} and has no engines of its "
            f"own: resize the fleet (rl-launch fleet grow {attached.get('fleet')} --nodes N)"
        )
    if state.get("torn_down") or jd.read_result() is not None:
        raise ElasticError(f"job {name} has ended ({state.get('phase')}): nothing to resize")
    if jd.driver_alive() is False:
        raise ElasticError(f"job {name}'s driver is not running: nothing to resize")
    try:
        from launcher.gateways.kinds import front_kind
        from launcher.spec.snapshot import read_spec

        why = front_kind(read_spec(jd).router.kind).no_elastic_why
    except (OSError, ValueError):
        why = ""
    if why:
        raise ElasticError(why)
    if "elastic" not in state:
        raise ElasticError(
            f"job {name}'s fleet is not serving yet (phase {state.get('phase')}); try again once it is"
        )
    return jd


def request(job_dir: str | Path, req: ElasticRequest, timeout_s: float = ANSWER_TIMEOUT_S) -> ElasticAnswer:
    """Send ``req`` and return the driver's answer (``ElasticError`` when it refused or did not answer)."""
    jd = check_resizable(job_dir)
    shapes.send(jd.path, req)
    reply = shapes.wait_answer(jd.path, req.id, timeout_s)
    if reply is None:
        raise ElasticError(
            f"job {jd.path.name}'s driver did not answer within {timeout_s:g} s (is it still running? "
            "`rl-launch status`)"
        )
    if not reply.ok:
        raise ElasticError(reply.message)
    return reply


def grow(
    job_dir: str | Path,
    nodes: int,
    time_limit_s: float | None = None,
    wait: bool = False,
    timeout_s: float = 1800.0,
    by: str = "python",
) -> ResizeResult:
    """Ask for ``nodes`` more generation nodes; with ``wait``, until their engines joined the fleet."""
    reply = request(job_dir, ElasticRequest("grow", nodes=nodes, time_limit_s=time_limit_s, by=by))
    if not wait:
        return ResizeResult(reply, _elastic(job_dir))
    return ResizeResult(reply, wait_grow(job_dir, reply.grow_id, timeout_s))


def cancel(job_dir: str | Path, grow_id: str, by: str = "python") -> ResizeResult:
    reply = request(job_dir, ElasticRequest("cancel", grow_id=grow_id, by=by))
    return ResizeResult(reply, _elastic(job_dir))


def shrink(
    job_dir: str | Path,
    nodes: int = 0,
    node_names: list[str] | None = None,
    drain_timeout_s: float | None = None,
    wait: bool = False,
    timeout_s: float = 1800.0,
    by: str = "python",
) -> ResizeResult:
    """Drain ``node_names`` (or ``nodes`` the driver picks) and hand them back; with ``wait``, until they
    are given back."""
    req = ElasticRequest(
        "shrink", nodes=nodes, node_names=list(node_names or []), drain_timeout_s=drain_timeout_s, by=by
    )
    reply = request(job_dir, req)
    if not wait:
        return ResizeResult(reply, _elastic(job_dir))
    return ResizeResult(reply, wait_released(job_dir, reply.nodes, timeout_s))


def _elastic(job_dir: str | Path) -> dict[str, Any]:
    return dict(JobDir(Path(job_dir).expanduser()).read_state().get("elastic") or {})


def wait_grow(job_dir: str | Path, grow_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        elastic = _elastic(job_dir)
        g = next((g for g in elastic.get("grows", []) if g["id"] == grow_id), None)
        if g is not None and g["state"] == shapes.GROW_JOINED:
            return elastic
        if g is not None and g["state"] in shapes.GROW_FINAL:
            raise ElasticError(f"grow {grow_id} {g['state']}: {g.get('detail')}")
        if time.monotonic() > deadline:
            where = f"{g['state']} ({g.get('reason') or g.get('detail')})" if g else "unknown"
            raise ElasticError(f"grow {grow_id} has not joined within {timeout_s:g} s: {where}")
        time.sleep(0.5)


def wait_released(job_dir: str | Path, names: list[str], timeout_s: float) -> dict[str, Any]:
    """Until the nodes the shrink drained are given back (the driver answered with their names)."""
    deadline = time.monotonic() + timeout_s
    while True:
        elastic = _elastic(job_dir)
        draining = [n["name"] for n in elastic.get("nodes", []) if n["state"] == shapes.NODE_DRAINING]
        if not any(name in draining for name in names):
            return elastic
        if time.monotonic() > deadline:
            raise ElasticError(f"nodes {', '.join(names)} still draining after {timeout_s:g} s")
        time.sleep(0.5)
