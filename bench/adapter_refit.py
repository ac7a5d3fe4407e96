"""What an adapter refit costs beside a full refit, and two tenants' fair share, on real vLLM CPU engines.

Starts --engines real vLLM CPU engines with the LoRA flags (``router.adapters.plan.LoraPlan``: --enable-lora,
--max-loras, --max-lora-rank, --max-cpu-loras, runtime LoRA updating) on OS-chosen ports, makes rank-8 peft
adapters of the tiny model with the vLLM venv's peft, and runs two parts against routers started in this
process; every engine it started is stopped (its process group) however it ends.

1. ``refit``: one router (LoRA plan, an admin token and an API key). ``policy-a`` is loaded once, then
   --rounds rounds of (a) ``FleetClient.load_adapter("policy-a", dir, version="step-k")`` and (b) a full
   refit ``FleetClient.load_weights(copy, version="w-k")`` from one of two copies of the model, each timed,
   while --bg-clients closed-loop clients per kind keep sending base-model and ``policy-a`` requests.
   Per kind of refit: median / max seconds of the call, the longest a base-model (and an adapter) request
   overlapping the call took (the full refit's pause holds them; an adapter refit must not), requests
   failed. It also checks every answer: an adapter answer's ``model`` and ``x-rl-weight-version`` name the
   same version, one that was current at some moment of the request; a base answer started after refit
   ``w-k`` ended (and before the next began) carries ``w-k``.
2. ``tenants``: a router with a consumers file: tenant-a owns ``policy-a``, tenant-b ``policy-b`` (each
   with a client key and an admin key), ``fair_share_capacity`` --capacity. Each tenant loads its own
   adapter with its admin key, tenant-b's key calling ``policy-a`` must get 403 (and its admin key loading
   ``policy-a`` too), then each sends --tenant-concurrency closed-loop requests for --tenant-seconds with
   its client key. Per tenant: requests completed, completion tokens, share of the total, failures, and
   answers whose ``model`` is not its own adapter's version (must be 0). Repeated for each --weights.

Bounded: every loop has a count bound and a deadline; each request at most 120 s; a refit call at most
--refit-deadline s. Default run: ~3-4 minutes on a 2-core machine (engine start-up is most of it).

    .venv/bin/python bench/adapter_refit.py                       # both parts, defaults
    .venv/bin/python bench/adapter_refit.py --part refit --rounds 10
    .venv/bin/python bench/adapter_refit.py --part tenants --weights 1:1 --weights 3:1 --tenant-seconds 60

vLLM's python: --vllm-python, else $RL_LAUNCH_VLLM_PYTHON, else the CI cache's
(/root/.cache/rl-launch-ci/venv-vllm-*/bin/python). Model: --vllm-model DIR, else the tests' tiny model
(~/.cache/rl-launch/tiny-llama-v1, built with tests/support/tiny_model.py when missing).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from launcher.engines.base import EngineSpec, start_all
from launcher.engines.vllm.engine import VllmEngine
from launcher.fleet.client import FleetClient, FleetHttpError
from router import GenerationRouter
from router.adapters.plan import RUNTIME_LORA_ENV, LoraPlan
from router.config import RouterConfig
from router.consumers import add_admin_key, add_consumer, new_key

REPO = Path(__file__).resolve().parent.parent
SERVED = "tiny"
ADMIN = "bench-adapter-admin-" + "a" * 20
API_KEY = "bench-adapter-key-" + "k" * 22
VERSION_HEADER = "x-rl-weight-version"
REQUEST_TIMEOUT_S = 120.0
MAX_REQUESTS_PER_CLIENT = 100_000  # the count bound of every closed loop (the deadline comes first)

MAKE_ADAPTERS = """
import sys, torch
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
base, rank = sys.argv[1], int(sys.argv[2])
for i, out in enumerate(sys.argv[3:]):
    torch.manual_seed(1000 + i)
    m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    p = get_peft_model(m, cfg)
    for n, t in p.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(t, std=0.5)
    p.save_pretrained(out)
"""


# ------------------------------------------------------------------------------------------------ setup
def vllm_python(given: str | None) -> str:
    found = given or os.environ.get("RL_LAUNCH_VLLM_PYTHON")
    if not found:
        cands = sorted(glob.glob("/root/.cache/rl-launch-ci/venv-vllm-*/bin/python"))
        if not cands:
            sys.exit("no vLLM python: give --vllm-python or set RL_LAUNCH_VLLM_PYTHON")
        found = cands[-1]
    return found


def tiny_model(python: str, given: str | None) -> str:
    if given:
        return str(Path(given).resolve())
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    out = Path(base) / "rl-launch" / "tiny-llama-v1"
    if not (out / "config.json").is_file():
        print(f"building the tiny model into {out} ...", flush=True)
        subprocess.run(
            [python, str(REPO / "tests/support/tiny_model.py"), str(out)],
            check=True,
            timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
    return str(out)


def make_adapters(python: str, model: str, work: Path, rank: int, n: int) -> list[str]:
    outs = [str(work / f"adapter-{i}") for i in range(n)]
    subprocess.run(
        [python, "-c", MAKE_ADAPTERS, model, str(rank), *outs],
        check=True,
        timeout=600,
        capture_output=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    return outs


def start_vllm(python: str, model: str, n: int, plan: LoraPlan, logs: Path) -> list[VllmEngine]:
    cpus = sorted(os.sched_getaffinity(0))
    engines = []
    for i in range(n):
        env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1", **RUNTIME_LORA_ENV}
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[i % len(cpus)])
        spec = EngineSpec(
            model=model,
            served_name=SERVED,
            extra_args=["--max-model-len", "512", "--dtype", "bfloat16", *plan.engine_flags()],
            env=env,
            log_path=str(logs / f"engine{i}.log"),
            startup_timeout_s=900,
        )
        engines.append(VllmEngine(spec, python=python))
    t0 = time.monotonic()
    start_all(engines, 900)
    print(
        f"{n} vLLM engines ready in {time.monotonic() - t0:.0f} s: {[e.url for e in engines]} (logs {logs})"
    )
    return engines


# ------------------------------------------------------------------------------------------------ load
@dataclass
class Answer:
    kind: str  # "base" or an adapter name
    t0: float
    t1: float
    status: int
    model: str = ""
    header: str = ""
    tokens: int = 0
    error: str = ""


@dataclass
class Load:
    url: str
    key: str
    max_tokens: int
    answers: list[Answer] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def one(
        self, session: aiohttp.ClientSession, kind: str, model: str, key: str | None = None
    ) -> Answer:
        body = {
            "model": model,
            "prompt": f"bench {kind} " * 8,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
        }
        headers = {"Authorization": f"Bearer {key or self.key}"}
        t0 = time.monotonic()
        try:
            async with session.post(self.url + "/v1/completions", json=body, headers=headers) as r:
                data = await r.json(content_type=None)
                a = Answer(kind, t0, time.monotonic(), r.status, header=r.headers.get(VERSION_HEADER, ""))
                if r.status == 200:
                    a.model = data.get("model", "")
                    a.tokens = (data.get("usage") or {}).get("completion_tokens", 0)
                else:
                    a.error = str(data)[:200]
        except Exception as exc:  # timeouts, resets: counted as failures
            a = Answer(kind, t0, time.monotonic(), 0, error=f"{type(exc).__name__}: {exc}"[:200])
        return a

    async def loop(self, kind: str, model: str, key: str | None, deadline: float) -> None:
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for _ in range(MAX_REQUESTS_PER_CLIENT):
                if self.stop.is_set() or time.monotonic() > deadline:
                    return
                self.answers.append(await self.one(session, kind, model, key))


# ------------------------------------------------------------------------------------- part 1: refits
@dataclass
class Call:
    kind: str  # "adapter" or "full"
    version: str
    t0: float
    t1: float
    report: dict[str, Any]


def refit_rounds(
    fc: FleetClient, rounds: int, adapters: list[str], copies: list[str], deadline_s: float
) -> list[Call]:
    calls = []
    for k in range(1, rounds + 1):
        time.sleep(1.0)  # let load build up between refits
        t0 = time.monotonic()
        rep = fc.load_adapter("policy-a", adapters[k % 2], version=f"step-{k}", deadline_s=deadline_s)
        calls.append(Call("adapter", f"step-{k}", t0, time.monotonic(), rep))
        time.sleep(1.0)
        t0 = time.monotonic()
        rep = fc.load_weights(copies[k % 2], version=f"w-{k}", deadline_s=deadline_s)
        calls.append(Call("full", f"w-{k}", t0, time.monotonic(), rep))
    return calls


def overlapping(answers: list[Answer], c: Call) -> list[Answer]:
    return [a for a in answers if a.t0 < c.t1 and a.t1 > c.t0]


def check_versions(answers: list[Answer], calls: list[Call], first_adapter: Call) -> list[str]:
    """Wrong versions (module doc); each problem as a line."""
    problems = []
    adapter_calls = [first_adapter, *[c for c in calls if c.kind == "adapter"]]
    full_calls = [c for c in calls if c.kind == "full"]
    for a in answers:
        if a.status != 200:
            continue
        if a.kind == "policy-a":
            served_version = a.model.rpartition("@")[2] if "@" in a.model else ""
            if a.header != served_version:
                problems.append(f"adapter answer model {a.model!r} but {VERSION_HEADER} {a.header!r}")
            # version i was current from the end of call i's stamp (<= its t1) to the start of call i+1's
            # stamp (>= its t0): the answer's must be current at some moment of the request
            ok = False
            for i, c in enumerate(adapter_calls):
                if c.version != served_version:
                    continue
                nxt = adapter_calls[i + 1] if i + 1 < len(adapter_calls) else None
                ok = a.t1 >= c.t0 and (nxt is None or a.t0 <= nxt.t1)
            if not ok:
                problems.append(
                    f"adapter answer {a.model!r} (request {a.t0:.3f}-{a.t1:.3f}) was not current during it"
                )
        elif a.kind == "base":
            for i, c in enumerate(full_calls):
                nxt = full_calls[i + 1] if i + 1 < len(full_calls) else None
                if a.t0 > c.t1 and (nxt is None or a.t1 < nxt.t0) and a.header != c.version:
                    problems.append(
                        f"base answer after refit {c.version} carries {VERSION_HEADER} {a.header!r}"
                    )
    return problems


def router_config(plan: LoraPlan, **more: Any) -> RouterConfig:
    """The benches' router: on 127.0.0.1, the bench's tokens, the fleet's LoRA plan, no probing."""
    return RouterConfig(
        host="127.0.0.1",
        port=0,
        admin_token=ADMIN,
        api_key=API_KEY,
        lora=plan,
        policy="round_robin",
        probe_interval_s=0,
        backend_timeout_s=300,
        **more,
    )


async def part_refit(
    urls: list[str], args: argparse.Namespace, plan: LoraPlan, adapters: list[str], copies: list[str]
) -> None:
    router = GenerationRouter(router_config(plan), urls)
    base_url = router.serve_in_background()
    load = Load(base_url, API_KEY, args.max_tokens)
    tasks: list[asyncio.Task[None]] = []
    try:
        fc = FleetClient(base_url, ADMIN, timeout_s=args.refit_deadline + 30)
        t0 = time.monotonic()
        rep = await asyncio.to_thread(fc.load_adapter, "policy-a", adapters[0], "step-0", args.refit_deadline)
        first = Call("adapter", "step-0", t0, time.monotonic(), rep)
        end = time.monotonic() + args.rounds * (4 * args.refit_deadline) + 60
        for kind, model in (("base", SERVED), ("policy-a", "policy-a")):
            for _ in range(args.bg_clients):
                tasks.append(asyncio.create_task(load.loop(kind, model, None, end)))
        await asyncio.sleep(2.0)  # warm: every client has a request in flight
        calls = await asyncio.to_thread(refit_rounds, fc, args.rounds, adapters, copies, args.refit_deadline)
        await asyncio.sleep(1.0)
        load.stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S + 10)
        try:
            await asyncio.to_thread(fc.unload_adapter, "policy-a")  # free the engines' slots for part 2
        except FleetHttpError as exc:
            print(f"  (unloading policy-a: {exc})")
    finally:
        load.stop.set()
        for t in tasks:
            t.cancel()
        router.stop()
    answers = load.answers
    in_windows = [a for a in answers if any(a.t0 < c.t1 and a.t1 > c.t0 for c in calls)]
    quiet = [a for a in answers if a not in in_windows]
    print(
        f"\n== adapter refit vs full refit: {len(urls)} engines, {args.rounds} rounds, "
        f"{args.bg_clients} base + {args.bg_clients} adapter clients, max_tokens {args.max_tokens}"
    )
    for kind in ("base", "policy-a"):
        lat = [a.t1 - a.t0 for a in quiet if a.kind == kind and a.status == 200]
        if lat:
            print(
                f"  {kind:8} requests outside any refit: {len(lat)}, latency median "
                f"{statistics.median(lat):.3f} s  max {max(lat):.3f} s"
            )
    print(
        f"  {'refit':8} {'n':>2} {'call med':>9} {'call max':>9} {'router med':>10} {'base wait max':>14}"
        f" {'adapter wait max':>17} {'reqs overlapping':>16} {'base done inside':>16} {'failed':>7}"
        f" {'held (router)':>14}"
    )
    for kind in ("adapter", "full"):
        cs = [c for c in calls if c.kind == kind]
        took = [c.t1 - c.t0 for c in cs]
        base_w = [a.t1 - a.t0 for c in cs for a in overlapping(answers, c) if a.kind == "base"]
        ad_w = [a.t1 - a.t0 for c in cs for a in overlapping(answers, c) if a.kind == "policy-a"]
        inwin = {id(a): a for c in cs for a in overlapping(answers, c)}
        failed = sum(1 for a in inwin.values() if a.status != 200)
        held = [c.report.get("held", {}).get("released", 0) for c in cs] if kind == "full" else []
        inside = sum(1 for c in cs for a in answers if a.kind == "base" and c.t0 < a.t1 < c.t1)
        router_s = statistics.median(c.report.get("elapsed_s", 0.0) for c in cs)
        print(
            f"  {kind:8} {len(cs):>2} {statistics.median(took):>8.3f}s {max(took):>8.3f}s {router_s:>9.3f}s"
            f" {max(base_w, default=0):>13.3f}s {max(ad_w, default=0):>16.3f}s {len(inwin):>16}"
            f" {inside:>16} {failed:>7} {('max ' + str(max(held))) if held else '-':>14}"
        )
    steps: dict[str, list[float]] = {}
    for c in calls:
        for s in c.report.get("steps", []):
            steps.setdefault(f"{c.kind}:{s['phase']}", []).append(s["took_s"])
    print(
        "  steps (router's report), median s: "
        + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in steps.items())
    )
    failed = [a for a in answers if a.status != 200]
    statuses: dict[str, int] = {}
    for a in answers:
        statuses[f"{a.kind}:{a.status}"] = statuses.get(f"{a.kind}:{a.status}", 0) + 1
    print(f"  answers by kind:status: {statuses}")
    for a in failed[:5]:
        print(f"    failed {a.kind} at +{a.t0 - first.t0:.2f} s: {a.status} {a.error}")
    not_ok = [c for c in calls if not c.report.get("ok", False)]
    for c in not_ok:
        print(
            f"    refit {c.kind} {c.version} not ok: {c.report.get('error')} "
            f"missing={c.report.get('missing')}"
        )
    problems = check_versions(answers, calls, first)
    print(f"  version checks: {len(problems)} problem(s)")
    for p in problems[:10]:
        print("    " + p)


# ------------------------------------------------------------------------------------ part 2: tenants
async def part_tenants(
    urls: list[str], args: argparse.Namespace, plan: LoraPlan, adapters: list[str], work: Path
) -> None:
    cfile = work / "consumers.json"
    keys = {t: new_key() for t in ("tenant-a", "tenant-b")}
    admins = {t: new_key() for t in keys}
    owns = {"tenant-a": "policy-a", "tenant-b": "policy-b"}
    for t in keys:
        add_consumer(cfile, t, keys[t], 1.0, adapters=(owns[t],), replace=True)
        add_admin_key(cfile, t, admins[t])
    router = GenerationRouter(
        router_config(plan, consumers_file=str(cfile), fair_share_capacity=args.capacity),
        urls,
    )
    base_url = router.serve_in_background()
    try:
        print(
            f"\n== two tenants, fair_share_capacity {args.capacity}, {args.tenant_concurrency} closed-loop "
            f"clients each, {args.tenant_seconds:g} s per run, max_tokens {args.max_tokens}"
        )
        expected = {}
        for i, t in enumerate(keys):
            fc = FleetClient(base_url, admins[t], timeout_s=args.refit_deadline + 30)
            version = f"{owns[t].rpartition('-')[2]}-1"
            rep = await asyncio.to_thread(
                fc.load_adapter, owns[t], adapters[2 if i else 0], version, args.refit_deadline
            )
            expected[t] = rep["served_name"]
            print(
                f"  {t} loaded {owns[t]} as {rep['served_name']} in {rep['elapsed_s']:.3f} s, ok={rep['ok']}"
            )
        probe = Load(base_url, keys["tenant-b"], 4)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as s:
            a = await probe.one(s, "policy-a", "policy-a")
            print(
                f"  tenant-b's key calling policy-a: {a.status} "
                f"{'(expected 403) ' if a.status != 403 else ''}{a.error[:120]}"
            )
        try:
            await asyncio.to_thread(
                FleetClient(base_url, admins["tenant-b"]).load_adapter, "policy-a", adapters[1], "b-steal", 60
            )
            print("  tenant-b's admin key loading policy-a: ACCEPTED (expected 403)")
        except FleetHttpError as exc:
            print(f"  tenant-b's admin key loading policy-a: {exc.status} {str(exc)[:120]}")
        for spec in args.weights:
            wa, wb = (float(x) for x in spec.split(":"))
            for t, w in (("tenant-a", wa), ("tenant-b", wb)):
                add_consumer(cfile, t, keys[t], w, adapters=(owns[t],), replace=True)
            await asyncio.sleep(1.5)  # the router re-reads the file within 0.5 s
            await tenant_run(base_url, keys, owns, expected, args, f"{wa:g}:{wb:g}")
    finally:
        router.stop()


async def sample_consumers(base_url: str, end: float, names: list[str]) -> dict[str, list[int]]:
    """The router's own ledger (``GET /fleet/consumers``) every 0.5 s until ``end``: in flight per
    consumer (what the fair share hands out), to tell a slot split from an engine's."""
    out: dict[str, list[int]] = {n: [] for n in names}
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
        for _ in range(100_000):
            await asyncio.sleep(0.5)
            if time.monotonic() > end:
                break
            try:
                async with s.get(base_url + "/fleet/consumers", headers=headers) as r:
                    rows = (await r.json())["consumers"]
            except Exception:  # a missed sample is a missed sample
                continue
            for n in names:
                out[n].append(rows.get(n, {}).get("in_flight", 0))
    return out


async def tenant_run(
    base_url: str,
    keys: dict[str, str],
    owns: dict[str, str],
    expected: dict[str, str],
    args: argparse.Namespace,
    label: str,
) -> None:
    load = Load(base_url, "", args.max_tokens)
    end = time.monotonic() + args.tenant_seconds
    tasks = [
        asyncio.create_task(load.loop(t, owns[t], keys[t], end))
        for t in keys
        for _ in range(args.tenant_concurrency)
    ]
    samples = await sample_consumers(base_url, end, list(keys))
    load.stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), REQUEST_TIMEOUT_S + 10)
    # count only answers completed within the window (the drain after it runs without contention)
    done = {t: [a for a in load.answers if a.kind == t and a.status == 200 and a.t1 <= end] for t in keys}
    total_tokens = sum(a.tokens for t in keys for a in done[t]) or 1
    total_n = sum(len(done[t]) for t in keys) or 1
    print(f"  weights {label}:")
    print(
        f"    {'tenant':9} {'completed':>9} {'tokens':>7} {'share(tok)':>10} {'share(req)':>10}"
        f" {'failed':>6} {'wrong model':>11} {'latency med':>11} {'in flight (router, mean)':>25}"
    )
    for t in keys:
        mine = [a for a in load.answers if a.kind == t]
        wrong = [a for a in mine if a.status == 200 and a.model != expected[t]]
        failed = [a for a in mine if a.status != 200]
        lat = [a.t1 - a.t0 for a in done[t]]
        toks = sum(a.tokens for a in done[t])
        print(
            f"    {t:9} {len(done[t]):>9} {toks:>7} {toks / total_tokens:>10.1%}"
            f" {len(done[t]) / total_n:>10.1%}"
            f" {len(failed):>6} {len(wrong):>11} {statistics.median(lat) if lat else 0:>10.2f}s"
            f" {statistics.mean(samples[t]) if samples[t] else 0:>25.2f}"
        )
        for a in wrong[:3]:
            print(f"      {t} got model {a.model!r}, expected {expected[t]!r}")
        for a in failed[:3]:
            print(f"      {t} failed: {a.status} {a.error}")


# ----------------------------------------------------------------------------------------------- main
async def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    p.add_argument(
        "--part", choices=("all", "refit", "tenants"), default="all", help="what to run (default all)"
    )
    p.add_argument("--engines", type=int, default=2, help="real vLLM CPU engines to start (default 2)")
    p.add_argument(
        "--vllm-python", default=None, help="the vLLM venv's python (default $RL_LAUNCH_VLLM_PYTHON)"
    )
    p.add_argument("--vllm-model", default=None, help="the model directory (default the tests' tiny model)")
    p.add_argument(
        "--rounds", type=int, default=5, help="refit rounds, each an adapter and a full refit (default 5)"
    )
    p.add_argument(
        "--bg-clients", type=int, default=2, help="closed-loop clients per kind (base, adapter) in part 1"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="completion tokens per request (ignore_eos)")
    p.add_argument("--refit-deadline", type=float, default=120.0, help="deadline_s of every refit call")
    p.add_argument("--capacity", type=int, default=8, help="the tenants' router's fair_share_capacity")
    p.add_argument("--tenant-concurrency", type=int, default=12, help="closed-loop clients per tenant")
    p.add_argument("--tenant-seconds", type=float, default=25.0, help="seconds of each tenants run")
    p.add_argument(
        "--weights",
        action="append",
        default=None,
        help="tenant-a:tenant-b weights of a run (repeatable; default 1:1 and 2:1)",
    )
    args = p.parse_args()
    args.weights = args.weights or ["1:1", "2:1"]
    for spec in args.weights:
        parts = spec.split(":")
        if len(parts) != 2 or not all(x.replace(".", "", 1).isdigit() and float(x) > 0 for x in parts):
            p.error(f"--weights {spec!r}: give A:B, two positive numbers")
    if not (1 <= args.rounds <= 100 and 1 <= args.engines <= 8 and 0 < args.tenant_seconds <= 3600):
        p.error("--rounds 1-100, --engines 1-8, --tenant-seconds up to 3600")
    python = vllm_python(args.vllm_python)
    model = tiny_model(python, args.vllm_model)
    plan = LoraPlan(max_adapters=2, max_lora_rank=8)
    work = Path(tempfile.mkdtemp(prefix="adapter-refit-"))
    engines: list[VllmEngine] = []
    try:  # every engine this bench started is stopped however it ends
        t0 = time.monotonic()
        adapters = make_adapters(python, model, work, 8, 3)
        copies = [str(shutil.copytree(model, work / f"checkpoint-{tag}")) for tag in ("a", "b")]
        print(f"3 rank-8 adapters and 2 model copies in {time.monotonic() - t0:.0f} s under {work}")
        engines = start_vllm(python, model, args.engines, plan, work)
        urls = [e.url for e in engines]
        if args.part in ("all", "refit"):
            await part_refit(urls, args, plan, adapters, copies)
        if args.part in ("all", "tenants"):
            await part_tenants(urls, args, plan, adapters, work)
    finally:
        for e in engines:
            e.stop()
        shutil.rmtree(work / "checkpoint-a", ignore_errors=True)
        shutil.rmtree(work / "checkpoint-b", ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
