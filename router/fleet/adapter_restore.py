"""A restarted engine gets each adapter version back only as it was checked and served: the adapter restore.

An engine the fleet controller restarts comes back without its LoRA adapters; the router reloads every
version the table routes (``AdapterRefits.restore`` runs this for each engine that enters the serving
set). Before, it reloaded each version's recorded path as it stood then, checking nothing: measured in
issue 38 (finding 3), another user swapped the directory after the load, the restarted engine loaded
theirs, and half of a tenant's rollouts of one version, all labelled with it, came from that user's
adapter. The same happens without another user when a trainer rewrites its adapter directory in place.
The full-weight restore (``router.fleet.restore``) re-checks its directory and compares checksums; this
mirrors it for adapters, which have no checksum on vLLM, by the digest of their files:

    the version's directory passes the same check as a fresh load (``read_adapter``, off the loop under
    the ``CheckpointGuard``; never ``allow_foreign``) -> its digest is the one recorded when the version
    was loaded (``AdapterVersion.digest``) -> the engine loads it -> it lists the name with that
    directory as its root and answers ``/health`` -> the directory is checked and its digest read
    again, still the same -> only then is the engine added to the version's engines (routed)

Any step that fails leaves the engine without that version: it serves the base model and every other
adapter, the version's requests go to the engines that hold it, the name is unloaded again if the load
got that far, and the version's last transaction (``GET /fleet/adapters``, ``rl-launch fleet refit
--adapter``) lists the engine as ``missing`` with the reason. Why these choices:

* **The path as the version was given, not its realpath.** Every engine of a version lists the same
  root, which the table's rebuild after a router restart (``router.adapters.adoption``) matches; and
  the check refuses any path another user could redirect (``router.fleet.trusted_path``), so
  the path and its realpath name the same files for everyone but this user and root.
* **The digest after the load as well as before.** The engine reads the directory itself, after the
  check; reading the digest again once it has loaded closes that window: a rewrite meanwhile (this user,
  or root) is caught before any request is routed to the engine, not after.
* **Never another user's directory.** A version loaded with ``allow_foreign_checkpoint`` was an
  operator's decision at one moment; a restore runs unattended, maybe hours later, so it is not repeated:
  such a version is missing on the restarted engine until its owner refits it.
* **No digest, no restore.** A version the table adopted from the engines after a router restart has
  no digest (what the engines loaded was never read by this router): it stays on the engines that hold
  it and is missing on the restarted one, rather than loading bytes nobody compared; the tenant's next
  load brings it everywhere.

The engines that left the fleet (a dead engine's URL, when its replacement came back on another port)
leave every version's engine list here too: the list is what ``GET /fleet/adapters`` and the dashboard
show, and a URL nobody serves on is no place the version is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from router.adapters.table import AdapterVersion
from router.fleet.adapter_check import read_adapter
from router.fleet.checkpoint import CheckpointRefused
from router.fleet.engine import EngineClient
from router.fleet.txn import QUARANTINED, VERIFIED, EngineState

if TYPE_CHECKING:
    from router.fleet.adapter_refit import AdapterRefits

log = logging.getLogger(__name__)

RESTORE_TIMEOUT_S = 120.0
"""The most one engine call of a restore may take (a load of an adapter of a few MB takes seconds)."""


def leave_departed(refits: AdapterRefits) -> None:
    """Drop the URLs of engines no longer in the fleet from every version's engine list."""
    members = set(refits.fleet.backends.members)
    for adapter in refits.table.adapters.values():
        for v in (adapter.current, *adapter.draining):
            if v is not None:
                v.engines &= members


async def restore(refits: AdapterRefits, url: str) -> None:
    """Give ``url`` (it entered the serving set without its adapters) every version the table routes,
    each only after it passes (module doc); the others are reported missing there."""
    leave_departed(refits)
    root = await refits.served_root()
    async with EngineClient.open(refits.fleet.engine_key, RESTORE_TIMEOUT_S) as engines:
        listed = await engines.models(url)
        have = listed.value or {}
        for adapter in list(refits.table.adapters.values()):
            for v in (adapter.current, *adapter.draining):
                if v is None or url not in refits.fleet.backends.serving:
                    continue
                if v.served in have:
                    why = None if have[v.served] == v.path else f"it serves the name from {have[v.served]}"
                else:
                    why = await _reload(refits, engines, url, v, root)
                if why is None:
                    v.engines.add(url)
                    _report(refits, adapter.name, v, url, None)
                else:
                    _report(refits, adapter.name, v, url, why)


async def _reload(
    refits: AdapterRefits, engines: EngineClient, url: str, v: AdapterVersion, root: str | None
) -> str | None:
    """Check, load and verify ``v`` on ``url``; ``None`` when it passed, else why not (the engine is left
    without the name)."""
    if not v.digest:
        return (
            f"no digest of {v.path} was recorded when {v.served} was loaded (adopted from the engines after "
            "a router restart): nothing to compare the directory with; refit the adapter"
        )
    try:
        checked = await refits.guard.run(read_adapter, v.path, refits.table.plan, root, False)
    except CheckpointRefused as exc:  # AdapterRefused, or the guard's own (a check that timed out)
        return f"{v.path} fails the check of a fresh load (run without allow_foreign_checkpoint): {exc}"
    if checked.digest != v.digest:
        return _changed(v, checked.digest, "since it was loaded")
    why = await load_and_verify(engines, url, v.served, v.path)
    if why is None:
        try:
            after = await refits.guard.run(read_adapter, v.path, refits.table.plan, root, False)
        except CheckpointRefused as exc:
            why = f"{v.path} no longer passes the check after the load: {exc}"
        else:
            if after.digest != v.digest:
                why = _changed(v, after.digest, "while the engine loaded it")
    if why is not None:
        await engines.unload_adapter(url, v.served)
    return why


async def load_and_verify(engines: EngineClient, url: str, served: str, path: str) -> str | None:
    """Load the adapter directory ``path`` on ``url`` as ``served`` and check it there: the engine lists
    the name with ``path`` as its root (vLLM lists the path as it was given) and answers ``/health``.
    ``None`` when it passed, else why not (the name may be left on the engine: the caller unloads it).
    The one load-and-verify of an adapter: an adapter refit's canary and load steps run it, and so does
    the restore here."""
    loaded = await engines.load_adapter(url, served, path)
    if not loaded.ok:
        return f"load failed: {loaded.detail}"
    models = await engines.models(url)
    root = (models.value or {}).get(served)
    if root is None:
        return f"not verified: {models.error or f'/v1/models does not list {served!r} after the load'}"
    if root != path:
        return f"serves {served!r} from {root}, not {path}"
    health = await engines.health(url)
    return None if health.ok else f"/health failed after the load: {health.detail}"


def _changed(v: AdapterVersion, now: str, when: str) -> str:
    return (
        f"the files of {v.path} changed {when} (digest {now[:16]}, {v.served} was loaded as "
        f"{v.digest[:16]}): another adapter would be served under {v.version!r}; refit it"
    )


def _report(refits: AdapterRefits, name: str, v: AdapterVersion, url: str, why: str | None) -> None:
    """Record the outcome on the version's last transaction (what ``GET /fleet/adapters`` shows)."""
    txn = refits.last.get(name)
    if why is not None:
        log.warning("adapter %s not restored on %s: %s", v.served, url, why)
    if txn is None or txn.version != v.version:
        return
    if why is None:
        txn.engines[url] = EngineState(url, VERIFIED)
    else:
        txn.engines[url] = EngineState(url, QUARANTINED, reason=f"not restored after a restart: {why}")
