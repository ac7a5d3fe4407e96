"""The probe steps of ``rl-launch check``: one short ``srun`` per group (training, generation) on a node
like the job's, and the verdicts made from what each saw (``launcher.check.probe``).

Bounded: every probe has one deadline; a probe still pending or running at it is reported as such (with
Slurm's reason while pending) and cancelled by its unique job name, and the queue is watched until Slurm
no longer lists it, so no probe outlives the command. Both groups' probes run at once: a check costs
one probe's time, not two.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from launcher.check.outcome import Check, fail, ok
from launcher.check.probe import CONFIG_ENV, RESULT_MARK
from launcher.check.site import user_name
from launcher.slurm.nodes import natural_key

Group = Literal["training", "generation"]
MODEL_ENGINES = ("vllm", "dynamo-vllm")
"""Engine kinds that load ``generation.model`` on the node."""
PROBE_TIME_S = 300
"""The probe step's own time limit (``srun --time``), far above what it needs."""
_FIX_SHARED_INSTALL = (
    "install rl-launch on storage every node mounts, at the same path, and run check from that install"
)


@dataclass
class ProbeRun:
    """One probe step: what it printed, how it ended."""

    group: str
    job_name: str
    argv: list[str]
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    elapsed_s: float = 0.0
    timed_out: bool = False
    queue_state: str = ""
    """``STATE|REASON|NODE`` from squeue when the deadline came (empty: not in the queue)."""
    result: dict[str, Any] | None = field(default=None)


def parse_result(stdout: str) -> dict[str, Any] | None:
    for line in stdout.splitlines():
        if line.startswith(RESULT_MARK):
            try:
                value = json.loads(line[len(RESULT_MARK) :])
            except ValueError:
                return None
            return value if isinstance(value, dict) else None
    return None


def _squeue_by_name(name: str) -> str:
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-n", name, "-u", user_name(), "-o", "%T|%r|%N"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""


def _cancel_by_name(name: str, wait_s: float = 20.0) -> None:
    """``scancel`` this user's job of that name, then wait until Slurm no longer lists it."""
    try:
        subprocess.run(["scancel", "-n", name, "-u", user_name()], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return
    deadline = time.monotonic() + wait_s
    while _squeue_by_name(name) and time.monotonic() < deadline:
        time.sleep(0.5)


def _exit_on_sigterm() -> Any:
    """SIGTERM raises ``SystemExit`` (143) while the probes run, so the cleanup runs as for Ctrl-C, and
    SIGINT raises ``KeyboardInterrupt`` even where it was ignored when check started (a background job
    of a non-interactive shell, CI's: Python then installs no handler and a SIGINT sent to check alone
    was lost while its probes stayed queued); the previous handlers, or None off the main thread (where
    Python lets no handler be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, _raise), signal.signal(signal.SIGINT, signal.default_int_handler)


def _stop(run: ProbeRun, proc: subprocess.Popen[bytes]) -> None:
    """End a probe still going: its ``srun`` and, by its unique name, its job."""
    proc.terminate()
    if run.argv[0] == "srun":
        _cancel_by_name(run.job_name)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def run_steps(runs: list[ProbeRun], config_of: dict[str, dict[str, Any]], timeout_s: float) -> None:
    """Start every probe at once and wait for all of them, at most ``timeout_s``; fills each ``ProbeRun``."""
    started: list[tuple[ProbeRun, subprocess.Popen[bytes], IO[bytes], IO[bytes]]] = []
    t0 = time.monotonic()
    for run in runs:
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        env = {**os.environ, CONFIG_ENV: json.dumps(config_of[run.group])}
        try:
            proc = subprocess.Popen(run.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env)
        except OSError as exc:
            run.stderr = f"{run.argv[0]} could not be run: {exc.strerror or exc}"
            run.returncode = 127
            continue
        started.append((run, proc, out, err))
    deadline = t0 + timeout_s
    ended: dict[int, float] = {}
    previous = _exit_on_sigterm()
    try:
        while time.monotonic() < deadline:
            for _, p, _, _ in started:
                if p.pid not in ended and p.poll() is not None:
                    ended[p.pid] = time.monotonic()
            if len(ended) == len(started):
                break
            time.sleep(0.2)
    except BaseException:  # Ctrl-C, kill: a pending srun would wait on in the queue after we are gone
        for run, proc, _, _ in started:
            if proc.poll() is None:
                _stop(run, proc)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous[0])
            signal.signal(signal.SIGINT, previous[1])
    for run, proc, out, err in started:
        if proc.poll() is None:
            run.timed_out = True
            run.queue_state = _squeue_by_name(run.job_name) if run.argv[0] == "srun" else ""
            _stop(run, proc)
        run.returncode = proc.returncode
        run.elapsed_s = ended.get(proc.pid, time.monotonic()) - t0
        for stream, attr in ((out, "stdout"), (err, "stderr")):
            stream.seek(0)
            setattr(run, attr, stream.read().decode(errors="replace"))
            stream.close()
        run.result = parse_result(run.stdout)


def _srun_error(stderr: str) -> str:
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x.lower()]
    return (errors or lines or ["no output"])[-1][:300]


def judge_step(run: ProbeRun, timeout_s: float, on_host: bool) -> Check:
    """The ``<group> probe`` line: where it ran, or why it did not."""
    name = f"{run.group} probe"
    if run.timed_out:
        state, _, rest = run.queue_state.partition("|")
        reason, _, node = rest.partition("|")
        if state == "PENDING":
            return fail(
                name,
                f"still PENDING ({reason}) after {timeout_s:g} s; cancelled",
                "the nodes are busy or cannot meet the request: run check again later, or give it longer "
                "(--timeout)",
            )
        where = f" on {node}" if node else ""
        return fail(
            name,
            f"started{where} but did not answer within {timeout_s:g} s; cancelled",
            "a slow shared filesystem or a hanging import: run check again with a longer --timeout",
        )
    if run.result is None:
        text = run.stderr + run.stdout
        if "execve" in text or "No such file or directory" in text:
            return fail(
                name,
                f"the launcher's python {run.argv[run.argv.index('-m') - 1]} cannot run on the node "
                f"({_srun_error(text)})",
                _FIX_SHARED_INSTALL,
            )
        if "pyxis" in text:
            return fail(
                name,
                f"the container did not start: {_srun_error(text)}",
                "check slurm.container.image (and the enroot credentials for its registry)",
            )
        return fail(
            name,
            f"Slurm refused or ended the probe (exit {run.returncode}): {_srun_error(text)}",
            "fix what Slurm says in the spec's slurm section (partition, account, qos, time)",
        )
    host = run.result.get("host", "?")
    job = f"Slurm job {run.result['job_id']}, " if run.result.get("job_id") else ""
    note = "; on the host, without the container (see container runtime)" if on_host else ""
    return ok(name, f"ran on {host} ({job}{run.elapsed_s:.1f} s){note}")


def judge_result(group: str, config: dict[str, Any], result: dict[str, Any]) -> list[Check]:
    """The verdicts on what one group's probe saw of its role: GPUs, engines, model, router port."""
    host = result.get("host", "?")
    checks = []
    if config.get("gpus"):
        checks.append(_gpus(group, host, int(config["gpus"]), result["gpus"]))
    if "engine" in result:
        checks.append(_engine(group, host, result["engine"]))
    if "model" in result:
        checks.append(_model(group, host, config["model"], result["model"]))
    if "ports" in result:
        checks.append(_ports(group, host, config["port_range"], result["ports"]))
    return checks


def judge_nodes(results: list[dict[str, Any]], job_root: str, here: dict[str, str]) -> list[Check]:
    """What every probed node must share with this one, one line each for all of them (a job root
    that is not shared is one defect, whichever groups see it): the launcher and the job root."""
    if not results:
        return []
    checks = [_launcher(results, here)]
    if all("share" in r for r in results):
        checks.append(_share(results, job_root))
    return checks


def _hosts(results: list[dict[str, Any]]) -> str:
    return ", ".join(sorted({str(r.get("host", "?")) for r in results}, key=natural_key))


def _run_s(results: list[dict[str, Any]]) -> str:
    return "run" if len({r.get("host") for r in results}) > 1 else "runs"


def _launcher(results: list[dict[str, Any]], here: dict[str, str]) -> Check:
    mine = f"{here['version']} at {here['launcher']}"
    other = [
        r for r in results if (r.get("version"), r.get("launcher")) != (here["version"], here["launcher"])
    ]
    if other:
        r = other[0]
        return fail(
            "launcher",
            f"{_hosts(other)} {_run_s(other)} rl-launch {r.get('version')} at {r.get('launcher')}, "
            f"this node {mine}",
            _FIX_SHARED_INSTALL,
        )
    return ok("launcher", f"{_hosts(results)} {_run_s(results)} the same rl-launch as this node ({mine})")


def _share_error(share: dict[str, Any]) -> str | None:
    """Why the node and this one do not see the same job root; None when each read the other's token."""
    if share.get("error") or not share.get("node_token"):
        return str(share.get("error"))
    try:
        back = Path(share["node_file"]).read_text().strip()
    except OSError:
        return f"this node cannot read {share['node_file']}, which the node wrote"
    return None if back == share["node_token"] else f"{share['node_file']} holds another token here"


def _share(results: list[dict[str, Any]], job_root: str) -> Check:
    errors = [(r, e) for r in results if (e := _share_error(r["share"])) is not None]
    if errors:
        return fail(
            "job root shared",
            f"{job_root} is not shared with {_hosts([r for r, _ in errors])}: {errors[0][1]}",
            "set job_root to a directory on storage every node mounts at the same path (the job's "
            "directory, logs and records live there)",
        )
    return ok(
        "job root shared", f"{job_root} is shared with {_hosts(results)} (each read what the other wrote)"
    )


def _gpus(group: str, host: str, asked: int, gpus: dict[str, Any]) -> Check:
    name = f"{group} GPUs"
    visible = f"CUDA_VISIBLE_DEVICES={gpus.get('cuda_visible') or '(unset)'}"
    listed = gpus.get("nvidia_smi")
    fix = "check how this site hands out GPUs (slurm.gpu_request: gres or gpus-per-node) with your site"
    if int(gpus.get("count") or 0) < asked:
        return fail(name, f"the step on {host} sees {visible}, fewer than the {asked} asked", fix)
    if listed is not None and len(listed) < asked:
        return fail(name, f"nvidia-smi on {host} lists {len(listed)} GPU(s), {asked} asked", fix)
    smi = f"; nvidia-smi lists {len(listed)}" if listed is not None else "; no nvidia-smi on the node"
    return ok(name, f"{visible} on {host} ({asked} asked){smi}")


def _engine(group: str, host: str, engine: dict[str, Any]) -> Check:
    name = f"{group} engine python"
    if engine.get("version"):
        return ok(name, f"vLLM {engine['version']} in {engine['python']} ({engine['source']}) on {host}")
    python = engine.get("python")
    what = f"{python} ({engine['source']}) cannot import vllm on {host}" if python else f"on {host}"
    from launcher.engines.vllm.presence import INSTALL  # the fix, in the words a local submit uses

    return fail(name, f"{what}: {engine.get('error')}", f"{INSTALL}, in the shell you check and submit from")


def _model(group: str, host: str, model: str, seen: dict[str, Any]) -> Check:
    name = f"{group} model"
    if seen["kind"] == "path":
        if not seen["found"]:
            return fail(
                name,
                f"generation.model {seen['where']} does not exist on {host}",
                "put the model on storage every node mounts (same path) and set generation.model to it",
            )
        note = "" if seen.get("config") in (True, None) else " (no config.json in it)"
        return ok(name, f"{seen['where']} is there on {host}{note}")
    if seen["found"]:
        return ok(name, f"{model} is in {host}'s Hugging Face cache ({seen['where']})")
    if not seen["offline"]:
        return ok(name, f"{model} is not in {host}'s cache; the engines download it (HF_HUB_OFFLINE is off)")
    return fail(
        name,
        f"{model} is a Hugging Face id, the engines run offline (HF_HUB_OFFLINE=1) and {host}'s cache "
        f"({seen['where']}) does not have it",
        f"download it first (hf download {model} --local-dir DIR, DIR on shared storage) and set "
        "generation.model: DIR",
    )


def _ports(group: str, host: str, port_range: list[int], ports: dict[str, Any]) -> Check:
    name = f"{group} router port"
    lo, hi = port_range
    if ports.get("port") is None:
        return fail(
            name,
            f"no port of router.port_range {lo}-{hi} can be bound on {host}: {ports.get('error')}",
            "set router.port_range to a range that is free on the nodes",
        )
    return ok(name, f"port {ports['port']} of {lo}-{hi} is free on {host} ({ports['host']})")


def launcher_argv() -> list[str]:
    """How a node runs the probe: this installation's python (which must exist there, at this path)."""
    return [sys.executable, "-m", "launcher.check.probe"]
