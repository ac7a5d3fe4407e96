"""What the engines hold, taken into the adapter table: after a router restart, and from an engine that
joins holding names the table does not know.

The table (``router.adapters.table``) lives in the router's memory, and the engines keep every adapter
version loaded until the router unloads it. A restarted router (a Ray actor restarts with
``max_restarts=-1``) began with an empty table: each tenant's own name was an engine 404 mid-rollout,
every served name went to the engines unchecked (another tenant sampled them), ``max_adapters`` counted
nothing the engines held and the old versions were never unloaded. Here each engine's ``/v1/models``
list (vLLM lists the adapters in the order they were loaded, each with the directory it came from as
its ``root``) is merged into the table:

* **owner**: the consumer the fleet's spec reserved the adapter for (the consumers file), else the
  fleet's owner. Who first loaded an unreserved adapter is not written anywhere the router reads, and
  handing it to the fleet's owner fails closed: no tenant samples it, the owner may unload it.
* **current**: the version the most engines hold, the one loaded last among equals; every other version
  of the adapter is returned to be drained and unloaded (nothing is in flight on it: the requests of
  the router that died died with it).
* an engine that serves a known name from another directory is not counted as holding it.

Names the table accounts for already are not touched (a version it routes, one being loaded, one being
unloaded): a rejoining engine's versions are checked and restored by the adapter refit's ``restore``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from router.adapters.names import split_served
from router.adapters.table import Adapter, AdapterTable, AdapterVersion
from router.consumers import OWNER


@dataclass
class _Found:
    root: str
    engines: set[str] = field(default_factory=set)
    order: int = 0


def adopt(table: AdapterTable, listings: Mapping[str, Mapping[str, str]]) -> list[AdapterVersion]:
    """Merge ``listings`` (engine URL -> its ``/v1/models`` as ``{id: root}``, in the engine's order)
    into ``table``; returns the versions adopted as draining, for the caller to unload."""
    found: dict[str, dict[str, _Found]] = {}
    for url, listed in listings.items():
        for order, (served, root) in enumerate(listed.items()):
            parts = split_served(served)
            if parts is None or _known(table, served):
                continue
            name, version = parts
            seen = found.setdefault(name, {}).setdefault(version, _Found(root))
            if seen.root == root:
                seen.engines.add(url)
                seen.order = max(seen.order, order)
    drained: list[AdapterVersion] = []
    for name, versions in found.items():
        adapter = table.adapters.get(name)
        if adapter is None:
            owner = table.owner_of(name) or OWNER
            adapter = table.adapters[name] = Adapter(name, owner)
        made = {v: AdapterVersion(v, f"{name}@{v}", f.root, 0, set(f.engines)) for v, f in versions.items()}
        for served in (m.served for m in made.values()):
            table.names[served] = adapter.owner
        newest = max(versions, key=lambda v: (len(versions[v].engines), versions[v].order))
        for v in sorted(versions, key=lambda v: versions[v].order):
            if adapter.current is None and v == newest:
                continue
            adapter.draining.append(made[v])
            adapter.history.append(v)
            drained.append(made[v])
        if adapter.current is None:
            adapter.current = made[newest]
            adapter.history.append(newest)
    if found:
        table.announce()
    return drained


def _known(table: AdapterTable, served: str) -> bool:
    """A name the table accounts for already: a version it routes, one a refit is loading now, or one
    whose unload is under way (``AdapterTable.names``). Adopting a name being loaded would make it a
    stale version and unload it from under its refit."""
    if served in table.names:
        return True
    parts = split_served(served)
    adapter = table.adapters.get(parts[0]) if parts is not None else None
    return adapter is not None and parts is not None and adapter.version(parts[1]) is not None
