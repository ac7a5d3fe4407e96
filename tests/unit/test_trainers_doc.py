"""docs/trainers.md and examples/trainers/ stay true (``tests/unit/test_docs.py`` runs the page's
``rl-launch validate`` lines and checks its links; this checks what that cannot).

* Every spec under ``examples/trainers/`` validates (``rl-launch validate``, as a user runs it) and the
  page names it; every example the page names exists.
* Every variable a training command or a config block of the page reads is one the driver hands the
  training command (found by running the driver's own ``wire_gym`` on a job directory), and a key is
  only ever named (``api_key_env_var: RL_CONTROL_API_KEY``), never expanded into argv or a config
  NeMo-RL prints.
* The NeMo-RL block is a valid ``remote_vllm_cfg`` by the rules of NeMo-RL's ``RemoteVllmServiceConfig``
  (fields, required ones, types and validators, as read from NVIDIA-NeMo/RL
  ``nemo_rl/models/generation/remote_vllm/config.py`` at b8ddf674: NeMo-RL is not installed here), with
  the values a job hands over; each call NeMo-RL makes with it (its URL rule: the origin of the URL plus
  the path setting, ``tests.support.trainer_replays.service_url``) lands on a route the router's control
  URL serves; and ``examples/trainers/nemo-rl-remote-vllm.yaml`` passes that same block.
* The prime-rl command of the page is the example's.

What the calls then do on a router is ``tests/component/test_trainers_doc_replay.py`` (the page's block
replayed against a router keyed as a job's is) and ``tests/vllm/test_control_api_vllm.py``.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner

from launcher.cli.main import main
from launcher.driver.gym_wiring import wire_gym
from launcher.jobdir import JobDir, StateWriter
from launcher.spec import load_resolved
from launcher.spec.snapshot import write_spec
from router.fleet.vllm_control import PREFIX, READS, REFIT, ROOT_SHARED
from tests.support.trainer_replays import NEMO_RL_PATHS, service_url
from tests.support.trainers_doc import NEMO_RL_EXAMPLE, PAGE, ROOT, fences, nemo_rl_block, resolved

EXAMPLES = sorted((ROOT / "examples" / "trainers").glob("*.yaml"))
PRIME_RL_EXAMPLE = ROOT / "examples" / "trainers" / "prime-rl.yaml"
ROUTER = "http://10.0.0.7:20123"
"""The router URL the wiring is given (nothing listens: only the environment is read)."""

ENV_REF = re.compile(
    r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\}|\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)"
)
KEY_VARS = ("RL_CONTROL_API_KEY", "RL_POLICY_API_KEY")

# NeMo-RL's RemoteVllmServiceConfig / RemoteVllmRefitConfig (extra="forbid"), read at b8ddf674.
REMOTE_VLLM_REQUIRED = {"base_url", "served_model_name", "max_model_len", "refit"}
REMOTE_VLLM_OPTIONAL = {
    "control_base_url",
    *NEMO_RL_PATHS,
    "request_timeout_s",
    "connect_timeout_s",
    "api_key_env_var",
}
REFIT_REQUIRED = {"checkpoint_dir"}
REFIT_OPTIONAL = {"inflight_policy", "timeout_s", "keep_versions"}
INFLIGHT_POLICIES = ("abort", "wait", "keep")


@pytest.fixture(scope="module")
def handed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """What the driver hands a builtin-router job's training command (its ``RL_*`` variables), engines the
    trainer owns included (``RL_ROUTER_REGISTRATION_URL``)."""
    spec = load_resolved(NEMO_RL_EXAMPLE)
    job = JobDir(tmp_path_factory.mktemp("jobs") / "job").create()
    write_spec(job, spec)
    job.new_api_key()
    job.new_admin_token()
    job.new_registration_capability()
    state = StateWriter(job)
    state.update(router_url=ROUTER, fleet_url=ROUTER)
    env = wire_gym(spec, job, state, {})
    return {k: v for k, v in env.items() if k.startswith("RL_")}


def env_refs(text: str) -> set[str]:
    return {next(g for g in m.groups() if g) for m in ENV_REF.finditer(text)}


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_each_trainer_example_validates_and_the_page_names_it(example: Path) -> None:
    result = CliRunner().invoke(main, ["validate", str(example)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"OK {example}")
    assert f"examples/trainers/{example.name}" in PAGE.read_text(), (
        f"docs/trainers.md does not name {example}"
    )


def test_every_example_the_page_names_exists() -> None:
    named = set(re.findall(r"examples/[\w./-]+\.(?:yaml|py)", PAGE.read_text()))
    assert {f"examples/trainers/{p.name}" for p in EXAMPLES} <= named
    missing = sorted(n for n in named if not (ROOT / n).exists())
    assert not missing, missing


def test_commands_and_blocks_read_only_what_the_driver_hands_over_and_never_expand_a_key(
    handed: dict[str, str],
) -> None:
    assert {"RL_CONTROL_BASE_URL", "RL_CONTROL_API_KEY_FILE", "RL_POLICY_BASE_URL"} <= set(handed)
    assert "RL_CONTROL_API_KEY" not in handed  # the admin token itself: only its file's path is handed
    texts = {p.name: load_resolved(p).training.command for p in EXAMPLES}
    texts |= {f"docs/trainers.md block {i}": b for i, b in enumerate(fences("yaml") + fences("bash"))}
    read: set[str] = set()
    for where, text in texts.items():
        refs = {r for r in env_refs(text) if r.startswith("RL_")}
        assert refs <= set(handed), f"{where}: {sorted(refs - set(handed))} is not handed to the command"
        assert not refs & set(KEY_VARS), f"{where}: a key expanded into argv or a printed config"
        admin = Path(handed["RL_CONTROL_API_KEY_FILE"]).read_text().strip()
        secrets = [admin, handed["RL_POLICY_API_KEY"], handed["RL_ROUTER_REGISTRATION_URL"]]
        assert "Bearer" not in text and not any(v in text for v in secrets), where
        read |= refs
    assert {"RL_CONTROL_BASE_URL", "RL_POLICY_BASE_URL", "RL_JOB_DIR"} <= read  # the rule matched things


def check_remote_vllm_cfg(cfg: dict[str, Any]) -> None:
    """``RemoteVllmServiceConfig.model_validate`` by the rules read from NeMo-RL's config.py."""
    assert REMOTE_VLLM_REQUIRED <= set(cfg), f"missing {REMOTE_VLLM_REQUIRED - set(cfg)}"
    assert set(cfg) <= REMOTE_VLLM_REQUIRED | REMOTE_VLLM_OPTIONAL, (
        f"NeMo-RL forbids {set(cfg) - REMOTE_VLLM_REQUIRED - REMOTE_VLLM_OPTIONAL}"
    )
    for name in ("base_url", "control_base_url"):
        if name in cfg:
            assert str(cfg[name]).startswith(("http://", "https://")), name
    assert isinstance(cfg["served_model_name"], str) and cfg["served_model_name"]
    assert isinstance(cfg["max_model_len"], int) and cfg["max_model_len"] > 0
    for name in NEMO_RL_PATHS:
        assert str(cfg.get(name, "/")).startswith("/"), f"{name} must be an absolute HTTP path"
    assert cfg.get("connect_timeout_s", 5.0) <= cfg.get("request_timeout_s", 600.0)
    refit = cfg["refit"]
    assert REFIT_REQUIRED <= set(refit) and set(refit) <= REFIT_REQUIRED | REFIT_OPTIONAL, refit
    assert Path(refit["checkpoint_dir"]).is_absolute(), "checkpoint_dir must be absolute"
    assert refit.get("inflight_policy", "keep") in INFLIGHT_POLICIES


def test_the_nemo_rl_block_is_a_remote_vllm_cfg_whose_calls_land_on_the_control_url(
    handed: dict[str, str],
) -> None:
    block = nemo_rl_block()
    assert block["env"]["should_use_nemo_gym"] is True and block["policy"]["megatron_cfg"]["enabled"] is True
    generation = block["policy"]["generation"]
    assert generation["backend"] == "remote_vllm" and generation["colocated"]["enabled"] is False
    cfg = resolved(generation["remote_vllm_cfg"], handed)
    check_remote_vllm_cfg(cfg)
    assert cfg["api_key_env_var"] == "RL_CONTROL_API_KEY"  # NeMo-RL's one Bearer, for every call
    assert cfg["control_base_url"] == handed["RL_CONTROL_BASE_URL"]
    assert cfg["served_model_name"] == handed["RL_POLICY_MODEL_NAME"]
    assert cfg["base_url"] == handed["RL_POLICY_BASE_URL"]
    # Every call NeMo-RL makes (preflight on both URLs, the refit, the cache reset), with its one key (the
    # admin token), lands on a route the builtin router serves that key at: the control routes, mounted at
    # the root of the fleet URL's origin (and under PREFIX), and the generation URL's /health (open) and
    # /v1/models (ROOT_SHARED: Access.LISTING takes the admin token too).
    control = cfg.get("control_base_url") or cfg["base_url"]
    paths = {name: cfg.get(name, default) for name, default in NEMO_RL_PATHS.items()}
    calls = {
        "health (generation URL)": service_url(cfg["base_url"], paths["health_path"]),
        "health (control URL)": service_url(control, paths["health_path"]),
        "models (generation URL)": service_url(cfg["base_url"], paths["models_path"]),
        **{name: service_url(control, paths[name]) for name in NEMO_RL_PATHS if name != "models_path"},
    }
    served = {p for p in (*READS, *REFIT)} | {PREFIX + p for p in (*READS, *REFIT)}
    origin = handed["RL_CONTROL_BASE_URL"]
    assert urlsplit(origin).path == "", f"the control URL {origin} is an origin (NeMo-RL keeps no more)"
    for what, url in calls.items():
        assert url.startswith(origin + "/"), f"{what}: {url} is not on {origin}"
        assert urlsplit(url).path in served, f"{what}: {url} is not a route of the control URL"
    assert {urlsplit(calls[k]).path for k in calls if k.startswith(("health", "models"))} <= set(ROOT_SHARED)


def test_the_nemo_rl_example_passes_the_pages_block() -> None:
    words = shlex.split(load_resolved(NEMO_RL_EXAMPLE).training.command)
    prefix = "++policy.generation.remote_vllm_cfg."
    overrides = dict(w[len(prefix) :].split("=", 1) for w in words if w.startswith(prefix))

    def flat(d: dict[str, Any], at: str = "") -> dict[str, str]:
        out: dict[str, str] = {}
        for k, v in d.items():
            out |= flat(v, f"{at}{k}.") if isinstance(v, dict) else {f"{at}{k}": str(v)}
        return out

    block = nemo_rl_block()
    assert overrides == flat(block["policy"]["generation"]["remote_vllm_cfg"])
    for setting in (
        "env.should_use_nemo_gym=true",
        "policy.megatron_cfg.enabled=true",
        "policy.generation.backend=remote_vllm",
        "policy.generation.colocated.enabled=false",
    ):
        assert setting in words, setting
    r = load_resolved(NEMO_RL_EXAMPLE)
    assert r.router.kind == "builtin"  # one origin for generation and control (the page says why)
    assert r.generation.env.get("VLLM_SERVER_DEV_MODE") == "1"
    assert f"--max-model-len={overrides['max_model_len']}" in r.generation.vllm_args


def test_the_prime_rl_command_of_the_page_is_the_examples() -> None:
    lines = [line for block in fences("bash") for line in block.splitlines() if " uv run rl " in line]
    assert len(lines) == 1, lines
    example = shlex.split(load_resolved(PRIME_RL_EXAMPLE).training.command)
    assert shlex.split(lines[0]) == example[: len(shlex.split(lines[0]))]
    assert example[example.index("--orchestrator.model.client.admin-base-url") + 1] == "$RL_CONTROL_BASE_URL"
