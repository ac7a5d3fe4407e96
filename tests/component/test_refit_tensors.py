"""One version, one set of weights (issue 38, finding 11), on simulated engines behind a real router:
a checkpoint whose tensors are not the served model's is refused before anything pauses; a directory
written while a refit loads it is not verified; a directory rewritten after its refit is not restored
into an engine. ``tests/vllm/test_refit_vllm.py`` runs the same on real vLLM CPU engines, where the
first two were measured.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from launcher.fleet.client import FleetClient, RefitError
from router import GenerationRouter
from router.fleet.tensor_manifest import read_record
from tests.support.checkpoints import checkpoint, tensors_checkpoint
from tests.support.refit_calls import (
    TOKEN,
    checksums,
    in_thread,
    router_over_fixture,  # noqa: F401 (the fixture router_over)
    until,
)

SHAPES = {
    "model.embed_tokens.weight": [8, 4],
    "model.layers.0.mlp.down_proj.weight": [4, 4],
    "lm_head.weight": [8, 4],
}


def rewrite(directory: Path) -> None:
    """Save other values over the directory's weights in place (same file, same size)."""
    weights = directory / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-4:] = b"zzzz"
    weights.write_bytes(bytes(raw))


async def test_a_checkpoint_without_exactly_the_served_tensors_is_refused_before_the_pause(
    sims, router_over, tmp_path: Path
) -> None:
    engines = await sims(2)
    r: GenerationRouter = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    first = await in_thread(client.load_weights, tensors_checkpoint(tmp_path, "a", SHAPES, b"a"), "v1")
    assert first["ok"], first
    pauses, on_a = r.gate.pauses_total, checksums(engines)
    missing = {k: v for k, v in SHAPES.items() if "down_proj" not in k}
    cases = {  # the name, and what the refusal says of it (the client quotes the answer's bytes)
        "missing": (missing, "lacks 1 of the served model", "model.layers.0.mlp.down_proj.weight"),
        "extra": (
            {**SHAPES, "model.x.weight": [2]},
            "has 1 tensor(s) the served model does not have",
            "model.x",
        ),
        "reshaped": (
            {**SHAPES, "lm_head.weight": [9, 4]},
            "has 1 tensor(s) of another dtype",
            "F32 [9, 4] here",
        ),
    }
    for name, (shapes, words, what) in cases.items():
        d = tensors_checkpoint(tmp_path, name, shapes, b"b")
        with pytest.raises(ValueError) as refused:
            await in_thread(client.load_weights, d, "v2")
        assert f"checkpoint {d} {words}" in str(refused.value) and what in str(refused.value), str(
            refused.value
        )
    assert r.gate.pauses_total == pauses  # nothing paused
    assert checksums(engines) == on_a and {e.rl.weight_version for e in engines} == {"v1"}
    same = await in_thread(client.load_weights, tensors_checkpoint(tmp_path, "same", SHAPES, b"c"), "v2")
    assert same["ok"] and "3 tensors' names, dtypes and shapes compared with" in same["checkpoint_check"], (
        same
    )


async def test_a_directory_written_while_the_refit_loads_it_is_not_verified(
    sims, router_over, tmp_path: Path
) -> None:
    """The engines read it at different moments: what each loaded is not what was checked, and may not be
    what its neighbour loaded. Every engine that read it is held out, and the fleet restores them from the
    directory it verified before."""
    engines = await sims(2, reload_delay_s=20.0)  # each load takes 1 s at speed 20
    r: GenerationRouter = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    a, b = checkpoint(tmp_path, "a", b"a"), checkpoint(tmp_path, "b", b"b")
    assert (await in_thread(client.load_weights, a, "v1"))["ok"]
    on_a = checksums(engines)[0]
    refit = in_thread(client.load_weights, b, "v2")
    await asyncio.sleep(0.3)  # the canary is loading
    rewrite(b)
    with pytest.raises(RefitError) as failed:
        await refit
    txn = failed.value.txn
    assert not txn["moved"] and sorted(txn["quarantined"]) == sorted(e.url for e in engines), txn
    why = next(iter(txn["quarantined"].values()))
    assert f"checkpoint {b} changed while the refit loaded it: model.safetensors: modified" in why, why
    assert await until(lambda: sorted(r.backends.serving) == sorted(e.url for e in engines), 20)
    assert checksums(engines) == [on_a, on_a] and {e.rl.weight_version for e in engines} == {"v1"}


async def test_a_directory_rewritten_after_its_refit_is_not_restored(
    sims, router_over, tmp_path: Path
) -> None:
    """The fleet's version was verified from ``a``; ``a`` is saved over; an engine that restarts is not
    loaded from it (it would serve other weights under that version): it stays out, with the reason,
    without the directory ever reaching it."""
    engines = await sims(2)
    r: GenerationRouter = router_over([e.url for e in engines])
    client = FleetClient(r.base_url(), TOKEN)
    a = checkpoint(tmp_path, "a", b"a")
    assert (await in_thread(client.load_weights, a, "v1"))["ok"]
    rewrite(a)
    replacement = (await sims(1))[0]
    await engines[1].stop()
    r.set_serving_backends([engines[0].url, replacement.url])  # what the fleet controller pushes
    assert await until(lambda: "changed since version 'v1'" in r.backends.stale.get(replacement.url, "")), (
        r.backends.stale
    )
    why = r.backends.stale[replacement.url]
    assert "model.safetensors: modified (mtime)" in why and "refit the fleet" in why, why
    assert replacement.worker.model_path != str(a) and replacement.rl.weight_version == "default"
    assert list(r.backends.serving) == [engines[0].url]
    again = await in_thread(client.load_weights, a, "v2")  # a refit from what it holds now brings it in
    assert again["ok"] and sorted(again["verified"]) == sorted([engines[0].url, replacement.url]), again


def test_a_file_rewritten_with_its_mtime_set_back_is_still_a_change(tmp_path: Path) -> None:
    """The stamp a restore compares: a rewrite of the same size whose writer set the mtime back (``touch
    -d``, ``cp -p``) still changes the ctime, which no user can set; a file put in place by a rename is
    another inode; an untouched directory reads the same."""
    d = checkpoint(tmp_path, "a", b"a")
    record = read_record(str(d))
    assert record.changes(record.again()) == []
    weights = d / "model.safetensors"
    before = weights.stat()
    time.sleep(0.02)
    rewrite(d)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert record.changes(record.again()) == ["model.safetensors: changed (ctime; mtime was set back)"]
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(weights.read_bytes())
    os.replace(copy, weights)
    assert record.changes(record.again())[0].startswith("model.safetensors: replaced by another file")
