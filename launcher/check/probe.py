"""The node side of ``rl-launch check``: ``python -m launcher.check.probe``, run as a one-node Slurm step.

It looks at what a job would meet on a node of its group and prints one line, ``RESULT_MARK`` followed by a
JSON object; the login side (``launcher.check.probe_job``) turns that into the lines the user reads. It
judges nothing itself: the verdicts, and the fixes they name, are made in one place, on the login node.

Why its arguments come in the environment (``CONFIG_ENV``, exported by ``srun``) and its answer goes to
stdout (which ``srun`` forwards to the login node) rather than through files in the job root: the job root
not being shared is one of the things it checks, and a probe that could not read its own arguments there
would report nothing else. Nothing secret goes in either way: the token it reads back is a random name for
one check, not a credential.

Standard library only (plus ``router.ports`` and the version), so it starts fast and says something even in
a broken environment; every wait it makes is bounded.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

CONFIG_ENV = "RL_LAUNCH_CHECK_PROBE"
RESULT_MARK = "RL-LAUNCH-CHECK-RESULT "
VLLM_PYTHON_ENV = "RL_LAUNCH_VLLM_PYTHON"  # launcher.engines.vllm.kind's, not imported: it loads pydantic
_TRUE = {"1", "on", "yes", "true"}


def _tail(text: str, limit: int = 300) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return (lines[-1] if lines else "")[-limit:]


def launcher_identity() -> dict[str, str]:
    import launcher

    return {
        "version": launcher.__version__,
        "launcher": str(Path(launcher.__file__).resolve().parent),
        "python": sys.executable,
    }


def share_probe(share_dir: str, login_token: str, name: str) -> dict[str, Any]:
    """Read the token the login node wrote into the job root, and write one back for it to read.

    Nothing is created when the directory is missing (a job root on a node-local disk would otherwise
    leave a copy there)."""
    out: dict[str, Any] = {"seen_login": False, "node_token": None, "node_file": None, "error": None}
    login_file = Path(share_dir) / "login.token"
    if not Path(share_dir).is_dir():
        out["error"] = f"{share_dir} does not exist on the node"
        return out
    try:
        seen = login_file.read_text().strip()
    except OSError as exc:
        out["error"] = f"the node cannot read {login_file}: {exc.strerror or exc}"
        return out
    out["seen_login"] = seen == login_token
    if not out["seen_login"]:
        out["error"] = f"{login_file} holds another token (a different directory of the same name)"
        return out
    token = os.urandom(8).hex()
    node_file = Path(share_dir) / f"{name}.token"
    try:
        node_file.write_text(token)
    except OSError as exc:
        out["error"] = f"the node cannot write {node_file}: {exc.strerror or exc}"
        return out
    out["node_token"], out["node_file"] = token, str(node_file)
    return out


def gpu_probe() -> dict[str, Any]:
    """What the step sees: ``CUDA_VISIBLE_DEVICES`` (Slurm sets it from the GPUs asked) and, where
    ``nvidia-smi`` exists, the devices it lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x for x in (visible or "").split(",") if x.strip()]
    out: dict[str, Any] = {"cuda_visible": visible, "count": len(ids), "nvidia_smi": None, "error": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
            if proc.returncode == 0:
                out["nvidia_smi"] = [x.strip() for x in proc.stdout.splitlines() if x.strip()]
            else:
                out["error"] = f"nvidia-smi -L exited {proc.returncode}: {_tail(proc.stderr or proc.stdout)}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["error"] = f"nvidia-smi -L did not answer: {exc}"
    return out


def engine_python() -> tuple[str | None, str]:
    """The interpreter the vLLM engines would run (``launcher.engines.vllm``): ``$RL_LAUNCH_VLLM_PYTHON``,
    else the one in the shebang of the ``vllm`` console script on PATH; with where it came from."""
    given = os.environ.get(VLLM_PYTHON_ENV)
    if given:
        return given, f"${VLLM_PYTHON_ENV}"
    script = shutil.which("vllm")
    if script is None:
        return None, f"${VLLM_PYTHON_ENV} is not set and no `vllm` is on PATH"
    try:
        first = Path(script).read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None, f"cannot read {script}"
    if not first.startswith("#!"):
        return None, f"{script} has no #! line"
    return first[2:].strip().split()[0], f"`vllm` on PATH ({script})"


def vllm_probe(env_overrides: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Import vLLM with the engine's interpreter and environment (the spec's ``generation.env`` on top)."""
    python, source = engine_python()
    out: dict[str, Any] = {"python": python, "source": source, "version": None, "error": None}
    if python is None:
        out["error"] = source
        return out
    env = {**os.environ, **env_overrides}
    code = "import vllm; print('VLLM-VERSION', vllm.__version__)"
    try:
        proc = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout_s, env=env
        )
    except FileNotFoundError:
        out["error"] = f"{python} does not exist on the node"
        return out
    except OSError as exc:
        out["error"] = f"{python} cannot run: {exc.strerror or exc}"
        return out
    except subprocess.TimeoutExpired:
        out["error"] = f"`import vllm` did not finish in {timeout_s:g} s"
        return out
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM-VERSION "):
            out["version"] = line.split(" ", 1)[1].strip()
    if out["version"] is None:
        out["error"] = _tail(proc.stderr) or f"exited {proc.returncode}"
    return out


def is_model_path(model: str) -> bool:
    """A local path rather than a Hugging Face id (``org/name``): absolute, ``~`` or ``.``-relative."""
    return model.startswith(("/", "~", "./", "../")) or model in (".", "..")


def hub_cache_dir(env: dict[str, str]) -> Path:
    """huggingface_hub's cache: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``XDG_CACHE_HOME`` or
    ``~/.cache`` + ``huggingface/hub``."""
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    base = env.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "huggingface" / "hub"


def model_probe(model: str, env_overrides: dict[str, str]) -> dict[str, Any]:
    """Whether the engines on this node would find ``model``: the directory, or for a hub id with offline
    engines (``HF_HUB_OFFLINE`` defaults to 1 there) a snapshot in the node's cache."""
    env = {**os.environ, **env_overrides}
    if is_model_path(model):
        path = Path(model).expanduser().absolute()
        return {
            "kind": "path",
            "where": str(path),
            "found": path.exists(),
            "config": (path / "config.json").is_file() if path.is_dir() else None,
            "offline": None,
        }
    offline = env.get("HF_HUB_OFFLINE", "1").strip().lower() in _TRUE
    cache = hub_cache_dir(env)
    snapshots = cache / ("models--" + model.replace("/", "--")) / "snapshots"
    found = snapshots.is_dir() and any(p.is_dir() and any(p.iterdir()) for p in snapshots.iterdir())
    return {"kind": "hub", "where": str(cache), "found": found, "config": None, "offline": offline}


def node_address() -> str:
    """The address the router binds on a node (``launcher.steps.processes.node_address``)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def ports_probe(port_range: tuple[int, int], host: str) -> dict[str, Any]:
    """A port of the router's range bindable on this node's address now (``router.ports``)."""
    from router.ports import NoFreePort, free_port_in

    try:
        return {"host": host, "port": free_port_in(host, port_range, order="random"), "error": None}
    except NoFreePort as exc:
        return {"host": host, "port": None, "error": str(exc)}
    except OSError as exc:
        return {"host": host, "port": None, "error": f"cannot bind on {host}: {exc.strerror or exc}"}


def run_probe(config: dict[str, Any]) -> dict[str, Any]:
    """Every look the config asks for; the keys it does not ask for are absent from the answer."""
    host = socket.gethostname()
    result: dict[str, Any] = {
        "host": host,
        "job_id": os.environ.get("SLURM_JOB_ID"),
        **launcher_identity(),
        "gpus": gpu_probe(),
    }
    if config.get("share_dir"):
        name = f"{config.get('group', 'node')}-{host}"
        result["share"] = share_probe(config["share_dir"], config["login_token"], name)
    env_overrides = {str(k): str(v) for k, v in (config.get("engine_env") or {}).items()}
    if config.get("vllm"):
        result["engine"] = vllm_probe(env_overrides, float(config.get("import_timeout_s", 150)))
    if config.get("model"):
        result["model"] = model_probe(config["model"], env_overrides)
    if config.get("port_range"):
        lo, hi = config["port_range"]
        result["ports"] = ports_probe((int(lo), int(hi)), config.get("bind_host") or node_address())
    return result


def main() -> int:
    raw = os.environ.get(CONFIG_ENV)
    if not raw:
        print(f"{CONFIG_ENV} is not set: this probe is started by `rl-launch check`", file=sys.stderr)
        return 2
    result = run_probe(json.loads(raw))
    print(RESULT_MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
