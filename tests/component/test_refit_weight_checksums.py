"""The checksum the refit verifies (issue 38, finding 11): the launcher's worker extension, read through
``/collective_rpc``, with vLLM's ``/weight_checker`` as the fallback that names what it cannot see; the
extension module loads in the engine's interpreter with nothing of rl-launch's dependencies; its probe
reads a CPU kernel's hidden weight back exactly. Real vLLM CPU engines: ``tests/vllm/test_refit_vllm.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from launcher.engines.base import EngineSpec
from launcher.engines.vllm.engine import VllmEngine
from launcher.engines.vllm.worker_ext import EXTENSION_CLS, METHOD, WORKER_EXT_DIR
from router.fleet.engine import EngineClient
from router.fleet.weight_checksums import CHECKSUM_METHOD, EMPTY_DIGEST, merge_workers

NO_METHOD = (
    "Call to collective_rpc method failed: Worker failed with error ''CPUWorker' object has no attribute "
    f"'{CHECKSUM_METHOD}'', please check the stack trace above for the root cause"
)
META = (
    "Call to collective_rpc method failed: "
    "Worker failed with error 'Cannot copy out of meta tensor; no data!'"
)


async def _engine(rpc: tuple[int, Any]) -> AsyncIterator[str]:
    """An engine whose ``/collective_rpc`` answers ``rpc`` and whose ``/weight_checker`` is vLLM 0.32
    CPU's: zero bytes for a linear weight."""

    async def collective_rpc(request: web.Request) -> web.Response:
        return web.json_response(rpc[1], status=rpc[0])

    async def weight_checker(request: web.Request) -> web.Response:
        table = {"tp0:model.norm.weight": "ab" * 32, "tp0:model.layers.0.mlp.down_proj.weight": EMPTY_DIGEST}
        return web.json_response({"checksums": table})

    app = web.Application()
    app.router.add_post("/collective_rpc", collective_rpc)
    app.router.add_post("/weight_checker", weight_checker)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _checksum(rpc: tuple[int, Any]) -> Any:
    async for url in _engine(rpc):
        async with EngineClient.open(None, 10.0) as engines:
            return await engines.checksum(url)


async def test_the_checksum_is_the_extensions_merged_over_its_workers() -> None:
    workers = [
        {"checksums": {"tp0:model.layers.0.mlp.down_proj.weight": "01" * 32}, "kernels": 8},
        {"checksums": {"tp1:model.layers.0.mlp.down_proj.weight": "02" * 32}, "kernels": 8},
    ]
    got = await _checksum((200, {"results": workers}))
    assert got.ok and got.body["source"] == "rl_launch" and got.body["kernels"] == 16, got
    assert len(got.body["checksums"]) == 2 and got.body["uncovered"] == []


async def test_an_engine_without_the_extension_falls_back_and_names_what_it_cannot_see() -> None:
    got = await _checksum((500, {"error": {"message": NO_METHOD}}))
    assert got.ok and got.body["source"] == "weight_checker", got
    assert got.body["uncovered"] == ["tp0:model.layers.0.mlp.down_proj.weight"]


async def test_detached_weights_fail_the_read_without_a_fallback() -> None:
    """A failed reload leaves vLLM's weights on the meta device: "unreadable" must stay a failure (the
    refit's canary and the restore read it as "no weights"), never become the checker's blind table."""
    got = await _checksum((500, {"error": {"message": META}}))
    assert not got.ok and "meta tensor" in got.detail, got


def test_workers_that_disagree_on_one_name_are_no_table() -> None:
    same = {"checksums": {"a": "01"}}
    assert merge_workers({"results": [same, same]})[0] is not None  # one worker per rank, same answer
    bad, why = merge_workers({"results": [same, {"checksums": {"a": "02"}}]})
    assert bad is None and "disagree" in why
    assert merge_workers({"results": []})[0] is None and merge_workers({"results": [None]})[0] is None


def test_every_vllm_engine_gets_the_extension_unless_it_names_its_own() -> None:
    spec = EngineSpec(model="/m", served_name="m", port=8000, api_key="k")
    engine = VllmEngine(spec, python=sys.executable)
    argv = engine.command()
    assert argv[argv.index("--worker-extension-cls") + 1] == EXTENSION_CLS
    assert engine.environment({})["PYTHONPATH"].split(":")[0] == WORKER_EXT_DIR
    own = EngineSpec(model="/m", port=8000, extra_args=["--worker-extension-cls=my.Ext"])
    assert VllmEngine(own, python=sys.executable).command().count("--worker-extension-cls=my.Ext") == 1
    assert "--worker-extension-cls" not in VllmEngine(own, python=sys.executable).command()
    assert METHOD == CHECKSUM_METHOD  # the router calls the method the extension defines


def test_the_extension_imports_nothing_but_the_standard_library() -> None:
    """The engine's interpreter (vLLM's venv) has no rl-launch dependencies; torch is imported only when
    the method runs, so the launcher's own tests import it too."""
    code = (
        f"import sys; sys.path.insert(0, {WORKER_EXT_DIR!r}); import rl_launch_weights; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'click', 'aiohttp', 'pydantic', 'rich', 'launcher', 'router', 'numpy')); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


PROBE = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from rl_launch_weights import weight_checksums, _digest
torch.manual_seed(0)
hidden = torch.randn(6, 4).to(torch.bfloat16)       # what the kernel computes with
packed = hidden.t().contiguous()                     # kept in its closure only, as vLLM's CPU build does
linear = torch.nn.Linear(4, 6, bias=False)
linear.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
linear.output_size_per_partition, linear.input_size_per_partition = 6, 4
linear.cpu_linear = lambda x, weight, bias: x @ packed
head = torch.nn.Linear(4, 6, bias=False).to(torch.bfloat16)
stale = head.weight.detach().clone() + 1             # a kernel copy the parameter no longer matches
head.cpu_linear = lambda x, weight, bias: x @ stale.t()
model = torch.nn.ModuleDict({"proj": linear, "head": head})
table = weight_checksums(model, "tp0:")
print(json.dumps({"table": table, "hidden": _digest(hidden), "param": _digest(head.weight),
                  "stale": _digest(stale)}))
"""


@pytest.mark.vllm
def test_the_probe_reads_an_emptied_layers_weight_back_through_its_kernel(vllm_python: str) -> None:
    out = subprocess.run(
        [vllm_python, "-c", PROBE, WORKER_EXT_DIR], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    table = got["table"]
    assert table["tp0:proj.weight"] == got["hidden"] != EMPTY_DIGEST  # the emptied parameter's real weight
    assert table["tp0:head.weight"] == got["param"]  # a parameter still there: as vLLM's checker hashes it
    assert table["tp0:head.weight:kernel"] == got["stale"]  # and the kernel's other copy, named
