"""One owner per kind: each front and engine kind declares itself, and nothing outside it names a kind.

* every example's front and engine kind are labelled right (``rl-launch validate examples/local-dynamo.yaml``
  used to say ``2 sim`` and ``router: cache_aware`` of a Dynamo fleet of mocker workers);
* the declarations answer what callers used to ask of kind names (cache reset route, ``/fleet`` routes,
  teardown), and each names a running class that exists;
* no module switches on a kind's name outside that kind's package and the registries;
* a sixth front and a fifth engine kind need only their declaration and a registry entry: the spec takes
  their sections and refuses their fields elsewhere (run in a fresh interpreter, where the registries are
  extended before the spec is built).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from launcher.engines.kinds import ENGINE_KINDS, engine_kind
from launcher.gateways.base import Gateway, gateway_class
from launcher.gateways.kinds import GATEWAY_KINDS, front_kind
from launcher.spec import SpecError, load_resolved

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))

# example -> (the front's label, the engines' label): what `rl-launch validate` must say of it.
LABELS = {
    "local.yaml": ("builtin router: cache_aware", "4 sim"),
    "local-replay.yaml": ("builtin router: cache_aware", "4 sim"),
    "local-grpo-vllm.yaml": ("builtin router: round_robin", "2 vllm examples/grpo/tiny-llama (on CPUs)"),
    "slurm-sim.yaml": ("builtin router: cache_aware", "8 sim"),
    "slurm-vllm.yaml": ("builtin router: cache_aware", "vllm engines the trainer registers"),
    "slurm-vllm-fleet-client.yaml": (
        "builtin router: cache_aware",
        "8 vllm /lustre/my-project/models/Qwen3-8B (TP 2 x PP 1 = 2 GPUs each)",
    ),
    "local-dynamo.yaml": ("dynamo: --router-mode kv", "2 dynamo-mocker workers of ./tiny-model"),
    "local-ray-serve.yaml": ("ray-serve: cache_aware over Serve", "4 sim"),
    "local-vllm-router.yaml": ("vllm-router (managed): cache_aware", "4 sim"),
    "fleet-local.yaml": ("builtin router: cache_aware", "4 sim"),
    "fleet-lora-vllm.yaml": ("builtin router: round_robin", "2 vllm examples/grpo/tiny-llama (on CPUs)"),
    "lora-tenant-a.yaml": ("the router of standing fleet 'lora-fleet'", "standing fleet 'lora-fleet'"),
    "lora-tenant-b.yaml": ("the router of standing fleet 'lora-fleet'", "standing fleet 'lora-fleet'"),
}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_each_example_labels_its_front_and_engine_kind(example: Path) -> None:
    assert example.name in LABELS, f"add the labels {example.name} must show to LABELS"
    r = load_resolved(example)
    front, engine = front_kind(r.router.kind), engine_kind(r.generation.engine)
    if r.generation.fleet is not None:  # an attached job: the standing fleet serves it
        assert (r.kind_labels()["front"], r.kind_labels()["engines"]) == LABELS[example.name]
        return
    assert (front.label(r.router), r.kind_labels()["engines"]) == LABELS[example.name]
    if not r.generation.trainer_owned:  # the trainer's engines are labelled by who registers them
        assert engine.label(r.generation) == LABELS[example.name][1]
    assert front.label(r.router).startswith(r.router.kind)
    assert r.generation.engine in r.kind_labels()["engines"]
    lo, hi = r.router.port_range
    assert front.summary(r.router) == f"{LABELS[example.name][0]}, port in {lo}-{hi}"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_cli_validate_names_the_front_and_engine_kind(example: Path) -> None:
    from launcher.cli.main import main

    # --spec-only: the vLLM examples' model is made by a helper first (validate without it says so)
    result = CliRunner().invoke(main, ["validate", "--spec-only", str(example)])
    assert result.exit_code == 0, result.output
    r = load_resolved(example)
    front, engine = front_kind(r.router.kind), engine_kind(r.generation.engine)
    lines = result.stdout.splitlines()
    if r.generation.fleet is not None:  # an attached job: no router or engines of its own
        assert f"  generation: standing fleet {r.generation.fleet!r}" in lines, result.stdout
        return
    assert f"  router: {front.summary(r.router)}" in lines, result.stdout
    if r.generation.trainer_owned:
        assert f", {r.kind_labels()['engines']} at $RL_ROUTER_REGISTRATION_URL" in result.stdout
    else:
        assert (
            f"= {engine.label(r.generation)}, served as {r.generation.served_model_name!r}" in result.stdout
        )


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_list_and_status_name_the_front_and_engine_kind_of_a_queued_job(
    example: Path, tmp_path: Path
) -> None:
    """``list`` and ``status`` said only the router's policy: a Dynamo or Ray Serve job looked like our
    router's. They show the labels ``submit`` records (the driver records the same once the job runs)."""
    import json
    import time

    from launcher.cli.main import main
    from launcher.jobdir import JobDir, SubmittedJob

    r = load_resolved(example)
    job = JobDir(tmp_path / "jobs" / f"{r.name}-local-1").create()
    record = SubmittedJob(job_id="", name=r.name, cluster="local", t=time.time(), **r.kind_labels())
    job.write_submitted(record)
    want = (LABELS[example.name][0], LABELS[example.name][1])
    listed = CliRunner().invoke(main, ["list", "--json", "--root", str(tmp_path / "jobs")])
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.stdout)
    assert (row["front"], row["engines"]) == want
    status = CliRunner().invoke(main, ["status", str(job.path), "--json"])
    assert status.exit_code == 0, status.output
    snap = json.loads(status.stdout)
    assert (snap["job"]["front"], snap["job"]["engines"]) == want


def test_declarations_name_their_kind_and_running_class() -> None:
    for name, front in GATEWAY_KINDS.items():
        assert front.name == name and front.section.model_fields["kind"].default == name
        cls = gateway_class(name)
        assert issubclass(cls, Gateway) and cls.kind == name
    for name, engine in ENGINE_KINDS.items():
        assert engine.name == name
    with pytest.raises(ValueError, match=r"unknown engine kind 'tpu' \(vllm, sim, dynamo-vllm, dynamo-"):
        engine_kind("tpu")


@pytest.mark.parametrize(
    ("front", "engine", "route"),
    [
        # what `rl-launch fleet reset-cache` did by kind name: our router's own route (falling back to the
        # engines when the job records no fleet URL), Dynamo's workers without a key, the others' engines
        # with the job's key
        ("builtin", "sim", (True, "/reset_prefix_cache", True)),
        ("builtin", "vllm", (True, "/reset_prefix_cache", True)),
        ("vllm-router", "vllm", (False, "/reset_prefix_cache", True)),
        ("ray-serve", "sim", (False, "/reset_prefix_cache", True)),
        ("dynamo", "dynamo-vllm", (False, "/engine/flush_cache", False)),
        ("dynamo", "dynamo-mocker", (False, "/engine/flush_cache", False)),
    ],
)
def test_cache_reset_reaches_the_engines_the_way_the_kinds_declare(
    front: str, engine: str, route: tuple[bool, str, bool]
) -> None:
    got = front_kind(front).cache_reset(engine_kind(engine))
    assert (got.via_fleet_route, got.engine_path, got.with_api_key) == route


def test_what_callers_asked_of_kind_names_is_declared() -> None:
    fronts = GATEWAY_KINDS
    assert [n for n, f in fronts.items() if f.has_fleet_routes] == ["builtin", "vllm-router", "ray-serve"]
    assert [n for n, f in fronts.items() if f.serves_consumers] == ["builtin"]  # standing fleets
    assert [n for n, f in fronts.items() if f.dies_with_ray] == ["builtin"]  # the driver's hurried teardown
    assert [n for n, f in fronts.items() if f.owns_engines] == ["ray-serve"]
    assert [n for n, f in fronts.items() if f.forwards_client_key] == ["vllm-router"]
    assert [n for n, e in ENGINE_KINDS.items() if not e.uses_gpus] == ["sim", "dynamo-mocker"]


def test_a_field_of_another_front_is_refused_naming_its_kinds(tmp_path: Path) -> None:
    def errors(router: str) -> str:
        path = tmp_path / "spec.yaml"
        path.write_text(
            "name: t\ncluster: local\ntraining: {command: 'true'}\ngeneration: {engine: sim}\nrouter:\n"
            + textwrap.indent(router, "  ")
        )
        with pytest.raises(SpecError) as info:
            load_resolved(path)
        # the router's issues: every problem is reported at once, and a sim engine suits no dynamo front
        router = [i for i in info.value.issues if i.path.startswith("router")]
        return str(SpecError(str(path), router)).replace(str(path), "SPEC")

    assert errors("kind: dynamo\nmode: managed\n") == (
        "SPEC:7: router.mode: only for router.kind: vllm-router, not dynamo; remove it"
    )
    assert errors("kind: dynamo\npolicy: cache_aware\n") == (
        "SPEC:7: router.policy: only for router.kind: builtin or ray-serve, not dynamo; remove it "
        "(set router.dynamo.router_mode)"
    )
    assert errors("polcy: round_robin\n").startswith(
        "SPEC:6: router.polcy: unknown field; did you mean 'policy'? known fields here: policy, "
    )
    assert errors("kind: nginx\n") == (
        "SPEC:6: router.kind: must be one of 'builtin', 'vllm-router', 'dynamo' or 'ray-serve' (got 'nginx')"
    )
    assert errors("kind: ray-serve\ndynamo: {router_mode: kv}\n") == (
        "SPEC:7: router.dynamo: only for router.kind: dynamo, not ray-serve; remove it"
    )


# -- nothing outside a kind's package switches on its name ------------------------------------------------
_CLI = (
    "launcher/cli.py", "launcher/cli_", "launcher/cli/", "launcher/status/cli.py", "launcher/bench/cli.py"
)  # fmt: skip


def _own_package(name: str) -> Path:
    kind = GATEWAY_KINDS.get(name) or ENGINE_KINDS[name]
    return REPO.joinpath(*type(kind).__module__.split(".")[:-1])


def _kind_switches(path: Path) -> list[str]:
    """``x == "dynamo"``, ``x in ("sim", ...)``, ``{"builtin": ..., "dynamo": ...}`` and
    ``.startswith("dynamo-")`` in ``path``, for kind names other than those of the package ``path`` is in."""
    names = set(GATEWAY_KINDS) | set(ENGINE_KINDS)
    foreign = {n for n in names if _own_package(n) not in path.parents}
    found = []

    def kinds_in(node: ast.AST) -> set[str]:
        items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
        return {i.value for i in items if isinstance(i, ast.Constant) and i.value in foreign}

    for node in ast.walk(ast.parse(path.read_text())):
        hit: set[str] = set()
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                hit |= kinds_in(side)
        elif isinstance(node, ast.Dict) and len(node.keys) >= 2:
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            if len(keys) == len(node.keys) and keys <= names:
                hit |= keys & foreign
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and any(isinstance(a, ast.Constant) and str(a.value).rstrip("-") in foreign for a in node.args)
        ):
            hit.add(str(node.args[0].value))  # type: ignore[attr-defined]
        if hit:
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {sorted(hit)}")  # type: ignore[attr-defined]
    return found


def _modules(cli: bool) -> list[Path]:
    registries = {REPO / "launcher/gateways/kinds.py", REPO / "launcher/engines/kinds.py"}
    out = []
    for path in sorted((REPO / "launcher").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if path not in registries and rel.startswith(_CLI) == cli:
            out.append(path)
    return out


def test_no_module_outside_a_kinds_package_switches_on_its_name() -> None:
    found = [hit for path in _modules(cli=False) for hit in _kind_switches(path)]
    ask = "ask the kind's declaration instead (launcher.gateways.front, launcher.engines.kind):\n"
    assert not found, ask + "\n".join(found)


def test_no_cli_module_switches_on_a_kinds_name() -> None:
    found = [hit for path in _modules(cli=True) for hit in _kind_switches(path)]
    assert not found, "\n".join(found)


# -- a new kind is its declaration plus a registry entry --------------------------------------------------
NEW_KINDS = """
from typing import Any, Literal

from pydantic import Field

from launcher.engines.kind import EngineKind, EngineSettings
from launcher.gateways.front import FrontKind, FrontSection


class QueueSection(FrontSection):
    kind: Literal["queue"] = "queue"
    depth: int = Field(default=8, ge=1)


class QueueFront(FrontKind[QueueSection]):
    name = "queue"
    section = QueueSection
    gateway = "newkinds:QueueGateway"

    def label(self, router: QueueSection) -> str:
        return f"queue: depth {router.depth}"


class TurboSettings(EngineSettings):
    turbo_args: list[str] = Field(default_factory=list)
    refused_elsewhere = {"turbo_args": "only used with generation.engine: turbo; remove them"}


class TurboKind(EngineKind):
    name = "turbo"
    settings = (TurboSettings,)
    uses_gpus = False

    def label(self, gen: Any) -> str:
        return f"{gen.num_engines} turbo engines with {TurboSettings.of(gen).turbo_args}"
"""

PROBE = """
import sys
from launcher.engines.kinds import ENGINE_KINDS, engine_kind
from launcher.gateways.kinds import GATEWAY_KINDS, front_kind
import newkinds

GATEWAY_KINDS["queue"] = newkinds.QueueFront()  # the one registry entry each
ENGINE_KINDS["turbo"] = newkinds.TurboKind()

from launcher.spec import SpecError, parse_spec

def spec(router, generation):
    return {"name": "t", "cluster": "local", "training": {"command": "true"}, "generation": generation,
            "router": router}

r = parse_spec(spec({"kind": "queue", "depth": 3}, {"engine": "turbo", "turbo_args": ["--fast"]})).resolved()
print(front_kind(r.router.kind).summary(r.router))
print(engine_kind(r.generation.engine).label(r.generation))
for router, generation in (({"depth": 3}, {"engine": "sim"}), ({}, {"engine": "sim", "turbo_args": ["x"]})):
    try:
        parse_spec(spec(router, generation))
    except SpecError as exc:
        print(exc)
"""


def test_a_new_front_and_engine_kind_need_only_their_declaration_and_a_registry_entry(tmp_path: Path) -> None:
    (tmp_path / "newkinds.py").write_text(NEW_KINDS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "queue: depth 3, port in 20000-20999",
        "1 turbo engines with ['--fast']",
        "<spec>: router.depth: only for router.kind: queue, not builtin; remove it",
        "<spec>: generation.turbo_args: only used with generation.engine: turbo; remove them",
    ]
