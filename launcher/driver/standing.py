"""The driver's two sides of a standing fleet (``launcher.fleet.standing`` owns the files both read).

* ``StandingFleet`` (a ``fleet:`` spec, ``rl-launch fleet up``): once the engines and the router serve, it
  records the fleet under its name and serves until ``rl-launch fleet down`` (a request file in the job
  directory), its time limit or a cancel, revoking the key of every consumer whose job ended on the way.
* ``StandingAttachment`` (a job whose spec says ``generation: {fleet: NAME}``): before anything else it
  checks the fleet again (it may have ended while this job was queued), waits (bounded) while it is still
  starting, registers a consumer key of its own (a client key; and, for a consumer the fleet's spec marks
  admin, the job's admin token as its admin key: ``launcher.fleet.standing.attach``) and points the job
  at the fleet's URL; at teardown it removes its keys. Whatever the job held on the fleet ends with its
  keys, not here: the router aborts a refit transaction or resumes a pause whose holder's key is revoked
  (``router.fleet.revocation``), and a SIGKILLed driver, which runs no teardown, is revoked by the fleet's
  driver when it sees the job ended (``prune_ended``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from launcher.fleet import standing
from launcher.fleet.standing import FleetRecord, FleetRefused
from launcher.jobdir import JobDir, StateWriter
from launcher.spec import ResolvedSpec
from launcher.spec.snapshot import read_spec

_TICK_S = 1.0
_PRUNE_EVERY_S = 2.0


class StandingFleet:
    def __init__(
        self, spec: ResolvedSpec, job: JobDir, state: StateWriter, say: Callable[[str], None]
    ) -> None:
        self.spec, self.job, self.state, self.say = spec, job, state, say
        slurm_id = job.slurm_job_id() if spec.cluster == "slurm" else None
        self.record = standing.new_record(
            spec.name, job.path, spec.cluster, spec.generation.served_model_name, slurm_id
        )

    def serve(self, check: Callable[[], None]) -> tuple[int, str]:
        """Serve until brought down; ``check`` raises when the fleet cannot go on (every engine lost, the
        front failed, the time limit): that unwinds through the driver's teardown like a training
        command's failure."""
        self.state.update(fleet_record=self.record.to_json(), fleet_serving_since=time.time())
        standing.write_record(self.spec.job_root, self.record)
        url = self.state.snapshot().get("router_url")
        self.state.event(
            "fleet_serving",
            f"standing fleet {self.record.name!r} serving {url}/v1 until `rl-launch fleet down "
            f"{self.record.name}`",
            fleet=self.record.name,
        )
        self.say(f"standing fleet {self.record.name!r} serving; bring it down with rl-launch fleet down")
        next_prune = 0.0
        while True:
            why = standing.down_requested(self.job.path)
            if why is not None:
                return 0, f"fleet brought down ({why})"
            check()
            if time.monotonic() >= next_prune:
                self._prune()
                next_prune = time.monotonic() + _PRUNE_EVERY_S
            time.sleep(_TICK_S)

    def _prune(self) -> None:
        try:
            removed = standing.prune_ended(self.job.path)
        except Exception as exc:  # a consumers file that cannot be read now is read on the next tick
            self.say(f"fleet consumers: {exc}")
            return
        for name, why in removed.items():
            self.job.log_event("consumer_revoked", f"consumer {name}: key revoked ({why})", consumer=name)

    def close(self) -> None:
        standing.remove_record(self.spec.job_root, self.record)


class StandingAttachment:
    def __init__(
        self, spec: ResolvedSpec, job: JobDir, state: StateWriter, say: Callable[[str], None]
    ) -> None:
        self.spec, self.job, self.state, self.say = spec, job, state, say
        self.record: FleetRecord
        self.name: str | None = None

    def attach(self) -> None:
        gen = self.spec.generation
        assert gen.fleet is not None
        t = time.monotonic()
        try:
            self.record = standing.resolve_fleet(
                gen.fleet,
                self.spec.job_root,
                cluster=self.spec.cluster,
                model_name=self.spec.gym.model_name or gen.served_model_name or None,
            )
            fleet_state = standing.wait_serving(self.record, gen.fleet_wait_s, self.say)
        except FleetRefused as exc:
            raise RuntimeError(str(exc)) from None
        fleet_job = JobDir(self.record.job_dir)
        rules = read_spec(fleet_job).fleet
        if rules is None:
            raise RuntimeError(f"generation.fleet {gen.fleet!r}: {fleet_job.path} is not a standing fleet")
        mine = rules.consumer(self.spec.name)
        self.name = standing.attach(
            self.record, self.job, self.spec.name, mine.weight, mine.admin, mine.adapters
        )
        fields: dict[str, Any] = {
            "router_url": fleet_state["router_url"],
            "attached_to": {
                "fleet": self.record.name,
                "job_dir": self.record.job_dir,
                "consumer": self.name,
                "weight": mine.weight,
                "admin": mine.admin,
            },
        }
        if mine.admin and fleet_state.get("fleet_url"):
            # the job's own admin token is its admin key there (its client key is not)
            fields["fleet_url"] = fleet_state["fleet_url"]
        self.state.update(**fields)
        took = round(time.monotonic() - t, 2)
        detail = (
            f"attached to standing fleet {self.record.name!r} at {fleet_state['router_url']}/v1 as consumer "
            f"{self.name} (weight {mine.weight:g}{', may refit' if mine.admin else ''}) in {took} s"
        )
        self.state.event("attached", detail, fleet=self.record.name, consumer=self.name)
        self.say(detail)
        fleet_job.log_event("consumer_attached", f"consumer {self.name} attached", consumer=self.name)

    def close(self) -> None:
        if self.name is None:
            return
        try:
            standing.detach(self.record.job_dir, self.name)
        except Exception as exc:  # the fleet's own pruning revokes it when this job's result is written
            self.say(f"detaching from fleet {self.record.name!r} failed: {exc}")
            return
        JobDir(self.record.job_dir).log_event(
            "consumer_detached", f"consumer {self.name} detached", consumer=self.name
        )
