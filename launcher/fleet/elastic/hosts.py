"""What the elastic manager needs of the driver's engine hosts, as Protocols.

The driver (floor 4) owns the engine-host steps; the fleet wing (floor 3) only drives them. Typing the
manager against the driver's ``EngineHostLauncher`` made the fleet import the driver, which runs the
floors backwards and ties the two packages into one knot; the fleet controller already takes its
``EngineHosts`` the same way.
"""

from __future__ import annotations

from typing import Any, Protocol


class HostSteps(Protocol):
    """One engine-host step per generation node, by node index."""

    def launch(self, node_index: int) -> Any:
        """Start node ``node_index``'s engine host (a grown node's first start)."""

    def exited(self, node_index: int) -> int | None:
        """The host's exit status if its step has ended, else None."""

    def describe(self, node_index: int) -> str:
        """Node name and log tail, for a refusal or an event."""

    def stop(self, node_index: int, grace_s: float = 15.0) -> None:
        """Stop the host for good (its node leaves the fleet)."""


class EngineHostFleet(Protocol):
    """The generation nodes and their hosts, which a grow appends to and a shrink stops."""

    generation_nodes: list[str]
    """Node names by index; a grown node gets the next index, never a reused one."""
    node_jobs: dict[int, str]
    """Node index -> the Slurm job that holds it when that is not the driver's (a grow job)."""

    @property
    def hosts(self) -> HostSteps: ...
