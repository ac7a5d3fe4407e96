"""A restarted engine's adapters come back only as they were checked and served (issue 38, finding 3).

Before, the restore reloaded each version's recorded path into the restarted engine as it stood, checking
nothing: after the directory was swapped (by another user, in the finding) or rewritten in place (by the
trainer), the restarted engine served other weights under the version's name, and the fleet answered one
tenant's requests of one version from two different adapters. The dead engine's URL also stayed in the
version's engine list.

Each case loads ``policy-a`` v1 on two simulated engines (vLLM 0.32's adapter routes, the adapter's text
derived from its files), changes the directory, kills one engine and brings a fresh one back on another
port, as the fleet controller does. What must hold: the restarted engine does not get v1 unless its
files are the ones loaded (``GET /fleet/adapters`` reports it ``missing`` there, with the reason), every
request for the adapter is answered from v1's own bytes by the engines that hold them, the dead URL has
left the version's list, and the engine serves the base model all along. One case lands its rewrite
between the restore's check and the restarted engine's own read of the files, by making the simulator's
read do the rewrite first (the one moment no timing from outside hits reliably): the digest read again
after the load catches it, and the engine is unloaded before any request is routed to it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from launcher.engines.sim import SimServer
from launcher.engines.sim import lora as sim_lora
from router import GenerationRouter
from tests.support.adapter_tenants import call
from tests.support.adapters import write_adapter
from tests.support.http_backends import router_factory
from tests.support.other_user import OtherUser, other_user
from tests.support.refit_calls import TOKEN
from tests.support.shared_dir import shared_dir

__all__ = ["shared_dir"]  # the fixture

API = "client-key-of-the-owner-0123456789"
LORA = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8, "max_cpu_loras": 4}
LORA.update(allow_runtime_lora_updating=True, model_name="tiny")
SYSTEM_PYTHON = "/usr/bin/python3"
RENAMES = "import os, sys\nos.chdir(sys.argv[1])\nfor a, b in zip(sys.argv[2::2], sys.argv[3::2]):\n"
RENAMES += "    os.rename(a, b)\n"


@pytest.fixture
def routers() -> Iterator[Callable[..., GenerationRouter]]:
    with router_factory(policy="round_robin", probe_interval_s=0, admin_token=TOKEN, api_key=API) as make:
        yield make


async def load(url: str, path: Path, **extra: Any) -> tuple[int, Any]:
    body = {"adapter": "policy-a", "from": str(path), "version": "v1", **extra}
    for _ in range(100):  # a router that just started reads what its engines hold first (409 meanwhile)
        status, answer = await call(url, "/fleet/adapters/load", TOKEN, body)
        if status != 409 or "retry in a moment" not in str(answer):
            return status, answer
        await asyncio.sleep(0.05)
    return status, answer


async def texts(url: str, model: str, n: int) -> list[str]:
    out = []
    for _ in range(n):
        body = {"model": model, "prompt": "hello world", "max_tokens": 4, "temperature": 0}
        status, answer = await call(url, "/v1/completions", API, body)
        assert status == 200, answer
        out.append(answer["choices"][0]["text"])
    return out


async def served_on(engine: SimServer) -> set[str]:
    async with aiohttp.ClientSession() as s, s.get(engine.url + "/v1/models") as r:
        return {m["id"] for m in (await r.json())["data"]}


def as_other_user(probe: OtherUser, where: Path, *names: str) -> None:
    """Rename ``names`` pairwise in ``where`` as the other user (the kernel judges each rename)."""
    done = subprocess.run(
        [SYSTEM_PYTHON, "-c", RENAMES, str(where), *names],
        user=probe.uid,
        group=probe.gid,
        extra_groups=[],
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr


def change(
    how: str, tmp_path: Path, shared: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, dict[str, Any], Callable[[], None]]:
    """The adapter's directory, the load's extra fields, and the change made to it after the load."""
    if how == "another user swaps its team scratch":  # the finding's repro, loaded with the opt-in
        probe = other_user()
        team = shared / "team"
        team.mkdir()
        probe.chown(team)
        team.chmod(0o1777)
        theirs = write_adapter(team / "evil", fill=b"z")
        probe.chown(theirs, *theirs.iterdir())
        return (
            write_adapter(team / "a-v1"),
            {"allow_foreign_checkpoint": True},
            lambda: as_other_user(probe, team, "a-v1", "a-v1.orig", "evil", "a-v1"),
        )
    d = write_adapter(tmp_path / "a-v1")

    def swap() -> None:
        d.rename(tmp_path / "a-v1.orig")
        write_adapter(d, fill=b"z")

    def rewrite() -> None:  # the trainer saves its next step over the same directory
        f = d / "adapter_model.safetensors"
        raw = f.read_bytes()
        f.write_bytes(raw[: len(raw) // 2] + b"z" * (len(raw) - len(raw) // 2))

    def during_the_load() -> None:  # after the restore's check, as the restarted engine reads the files
        other = write_adapter(tmp_path / "next", fill=b"z") / "adapter_model.safetensors"
        engine_read = sim_lora.read_adapter

        def rewritten_first(path: str, max_rank: int) -> tuple[str, int, bool]:
            if Path(path) == d and other.exists():  # a save lands between the check and this read
                os.replace(other, d / "adapter_model.safetensors")
            return engine_read(path, max_rank)

        monkeypatch.setattr(sim_lora, "read_adapter", rewritten_first)

    return (
        d,
        {},
        {
            "swapped": swap,
            "rewritten in place": rewrite,
            "rewritten while the engine loads it": during_the_load,
            "unchanged": lambda: None,
        }[how],
    )


CASES = [
    "swapped",
    "rewritten in place",
    "another user swaps its team scratch",
    "rewritten while the engine loads it",
    "unchanged",
]


@pytest.mark.parametrize("how", CASES)
async def test_a_restarted_engine_gets_an_adapter_back_only_as_it_was_loaded(
    how: str,
    sims: Callable[..., Any],
    routers: Callable[..., GenerationRouter],
    tmp_path: Path,
    shared_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = await sims(2, **LORA)
    r = routers([e.url for e in engines], lora={"max_adapters": 2, "max_lora_rank": 8})
    url = r.base_url()
    directory, extra, changed = change(how, tmp_path, shared_dir, monkeypatch)
    status, answer = await load(url, directory, **extra)
    assert status == 200 and answer["ok"], answer
    own = set(await texts(url, "policy-a", 4))
    assert len(own) == 1, own  # both engines serve v1's bytes
    changed()
    dead, kept = engines[1], engines[0]
    await dead.stop()  # the engine dies; the fleet controller brings a fresh one back on another port
    (back,) = await sims(1, **LORA)
    r.set_serving_backends([kept.url, back.url])
    view: dict[str, Any] = {}
    for _ in range(200):  # the restore runs when the engine enters the serving set
        _, view = await call(url, "/fleet/adapters", TOKEN)
        engines_of_v1 = set(view["adapters"]["policy-a"]["current"]["engines"])
        if back.url in engines_of_v1 or back.url in view["last"]["policy-a"]["missing"]:
            break
        await asyncio.sleep(0.05)
    missing = view["last"]["policy-a"]["missing"]
    seen = {
        "restarted engine lists": sorted(await served_on(back)),
        "v1 engines": sorted(view["adapters"]["policy-a"]["current"]["engines"]),
        "missing": missing,
        "texts": sorted(set(await texts(url, "policy-a", 8))),
    }
    print(json.dumps({how: seen}, indent=1))
    assert seen["texts"] == sorted(own), seen  # every answer of v1 from v1's own bytes
    if how == "unchanged":
        assert "policy-a@v1" in seen["restarted engine lists"], seen
        assert seen["v1 engines"] == sorted([kept.url, back.url]) and not missing, seen
    else:
        assert "policy-a@v1" not in seen["restarted engine lists"], seen
        assert seen["v1 engines"] == [kept.url], seen  # the dead URL left, the restarted one not added
        why = missing.get(back.url, "")
        assert why.startswith("not restored after a restart: "), seen
        if how == "another user swaps its team scratch":
            assert f"{directory} is owned by uid {other_user().uid}" in why, why  # its, now
        elif how == "rewritten while the engine loads it":  # it passed the check, then the engine read it
            assert f"the files of {directory} changed while the engine loaded it" in why, why
        else:
            assert f"the files of {directory} changed since it was loaded" in why, why
    await texts(url, "tiny", 4)  # the base model is served on every engine all along (each 200)
