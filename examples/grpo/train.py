"""An example GRPO trainer for rl-launch: rollouts through the router, a policy-gradient step, a refit.

It runs as a job's training command (``training.command``) and shows, in a few hundred lines, the loop an
RL stack runs on top of rl-launch:

1. **rollouts** through the job's router (``$RL_POLICY_BASE_URL``, key ``$RL_POLICY_API_KEY``, model
   ``$RL_POLICY_MODEL_NAME``: what ``launcher.driver.gym_wiring`` hands the training command), ``--group``
   samples of every prompt. Each sample asks ``/v1/completions`` for the prompt as token ids with
   ``logprobs: 0`` and ``return_tokens_as_token_ids: true``, so the answer names the sampled token ids
   (``"token_id:N"``) and their log-probabilities under the weights that sampled them: the trainer never
   re-tokenizes text (a round trip through text is not the identity for a byte-level BPE);
2. **the version filter**: every response carries ``x-rl-weight-version``, the weights of the engine
   that served it. The step expects the version its last refit stamped; a sample of another version
   (an engine that restarted on the old weights, a refit that straddled it) is dropped and counted,
   because its log-probabilities belong to another policy;
3. **rewards** (``reward``): a verifiable reward, the fraction of completion tokens in a fixed target
   set. Why this one: a tiny random model learns it within minutes on a CPU (moving probability mass
   onto a set of tokens is what one lm_head update does at once), and nothing judges it but arithmetic,
   so a rising curve is the loop working, not a grader's mood. Its optimum is degenerate (repeat one
   target token), and the example run (lr 0.02, 16 samples a step) finds it within 12 steps for every
   seed measured, some seeds only after a slow start of 4-5 steps (``target_mass`` below says when the
   climb begins): a reward sized for a smoke test of the loop, not a model worth keeping;
4. **group-relative advantages** (``group_advantages``, GRPO): each sample's reward minus its group's
   mean, over the group's standard deviation. No value network: the other samples of the same prompt
   are the baseline;
5. **the update** (torch, in a worker process: ``policy.py``): the clipped policy-gradient loss with the
   importance ratio between the trainer's log-probabilities and the rollout's (vLLM samples in bf16
   while the trainer keeps fp32 weights, so even on-policy the ratio is not exactly 1; the clip bounds
   what that mismatch can do);
6. **save** a Hugging Face checkpoint (``config.json`` + ``model.safetensors``) under the job directory,
   and **refit**: ``FleetClient.load_weights(dir, version=f"step-{n}")``, one call in which the router
   pauses every engine, reloads, verifies checksums, resets prefix caches, stamps the version, resumes.
   Or, with ``--refit-via vllm-api``, as a trainer that knows only vLLM's API refits (NeMo-RL's
   ``remote_vllm`` order, plain HTTP: ``vllm_api.py``): ``/pause``, ``/collective_rpc reload_weights``,
   ``/resume`` (and ``/reset_prefix_cache`` after it with ``--reset-after-resume``) on
   ``$RL_CONTROL_BASE_URL``, and the version is the one the router derived and named in its answers.

Per step it prints the time split (rollouts, update, save, refit and the pause inside it) and the
``target mass``: the probability the trainer's weights put on a target token as the next token of 16 fixed
held-out prompts, the expected reward without the sampling noise of 16 completions. A slow seed is one
whose mass stays near 0.125 for its first updates (seed 7: 0.129 0.117 0.128, then 0.155 0.21 0.29...):
the early batches moved the weights little, in no steady direction. It writes the rewards to
``$RL_JOB_DIR/grpo/metrics.json`` and ``metrics.csv`` and, at the end, ``reward.png`` (``--out`` names
another directory; ``--reload`` first loads the served model's own weights as ``step-0``, so a second run
in one job, e.g. another ``--seed``, starts where the first did).

**LoRA mode** (``--lora-adapter NAME``, or ``$RL_LORA_ADAPTER``): a tenant of a shared fleet trains a LoRA
adapter of its own on the fleet's frozen base model, beside other tenants training theirs
(``examples/fleet-lora-vllm.yaml``, ``examples/lora-tenant-a.yaml``). What changes:

* the worker wraps the model with ``peft`` (rank ``--lora-rank``, alpha ``--lora-alpha``, the linear
  layers of ``--lora-targets``) and trains only the adapter; ``save`` writes the adapter directory
  (``adapter_config.json`` + ``adapter_model.safetensors``) under ``$RL_JOB_DIR/adapters/step-N``;
* before step 1 the fresh adapter (B = 0: exactly the base model) is saved and loaded as ``step-0``, so
  the first rollouts already go through the adapter;
* rollouts ask for ``"model": NAME``; the router answers each with the adapter's current version, whose
  name is in the response's ``x-rl-weight-version`` (the adapter's version, ``step-k``) and body
  (``"model": "NAME@step-k"``). The version filter keeps a sample only if both name the version the
  last load stamped; the per-step metrics count the served names (``served_seen``);
* the refit is ``FleetClient.load_adapter(NAME, dir, version=f"step-{n}")``: the router checks the
  adapter, loads it into a canary engine, then into every engine, and moves ``NAME``'s requests to it.
  Nothing pauses (other tenants keep sampling), so the time split names an ``adapter refit`` and no
  pause. The base weights' version is never stamped: the fleet's base is not this tenant's;
* the adapter's default modules are every linear layer, ``lm_head`` included (rank 8, alpha 16, lr 0.05:
  0.115 -> 1.0 in the 12 steps of ``examples/lora-tenant-a.yaml`` on 2 real vLLM CPU engines, with
  ``lora-tenant-b.yaml`` (``--seed 1``: 0.078 -> 1.0) on the same fleet; seeds 2 and 3 0.172 and 0.177
  -> 1.0). Why ``lm_head``: the tiny model's
  final RMSNorm fixes the norm of the last hidden state and its ``lm_head`` rows are small (init 0.02), so
  no change below ``lm_head`` can put more than 0.171 of the probability on the target set (measured by
  optimizing the last hidden state directly; a random policy scores 0.125). vLLM 0.32 serves an ``lm_head``
  LoRA target (not ``modules_to_save``: refused), with one flaw on its CPU build: its logits kernel indexes
  the adapter slots with the request's slot, and a request of the *base* model (slot -1) gets the last
  slot's ``lm_head`` delta. So on CPU engines the router loads an ``lm_head`` adapter only into a fleet that
  serves adapters only (``generation.lora.base_model: false``, as the LoRA example's); on a CPU fleet that
  also serves the base model, train without ``lm_head`` (``--lora-targets``);
* ``--lr`` defaults to 0.05 in LoRA mode (3e-3 for full weights): Adam moves each LoRA factor by about
  lr a step, and the product ``B @ A`` (scaled by alpha / r) grows from zero, so the adapter needs a
  larger step than the weights themselves to move the policy as far. Not 0.1: a step that large can
  overshoot onto tokens outside the target set, and a policy with no target token in any sample gets no
  advantage, so no gradient, and stays there. At 0.1 seed 0 climbed 0.115 -> 0.917 or collapsed to 0.0
  (target mass 0.151 -> 0.001 in one step) depending on the engines' logprobs in their 7th digit (one
  engine's core binding apart); at 0.05 seeds 0-3 start to climb at steps 3-6 and reach 1.0 within 12 steps.

This file runs in the launcher's python (``FleetClient``, matplotlib); torch lives in the vLLM venv only,
so the update runs in ``policy.py`` under that venv's python (``--torch-python``, default
``$RL_LAUNCH_VLLM_PYTHON``), over a pipe (``examples/local-grpo-vllm.yaml``).
Beside it, in this directory: ``rollouts.py`` (the samples, rewards, advantages and version filter: no
torch and no fleet, so unit-tested in the main venv), ``metrics.py`` (the per-step record and the files it
is written to) and ``options.py`` (the command line); this file keeps the policies and the loop.

**Without torch** (the README's first job: simulated engines, the main venv has no torch) the same loop
runs in sim mode: rollouts, rewards, advantages, version checks, a checkpoint written as valid
safetensors (the simulator's loader checks headers; in LoRA mode an adapter directory: an
``adapter_config.json`` beside it), the refit and the per-step files; there is no
gradient step, and the output says so. The reward stays flat there: a simulated engine's text is a hash
of the prompt and the loaded checkpoint's digest, not a function of the weights' values, and its token
ids (4 bytes each) never fall in the target set.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script (``python examples/grpo/train.py``): the launcher is imported from the checkout this
# file is in, whatever the current directory; the trainer's own parts (``rollouts``, ``metrics``,
# ``options``) from this file's directory, also when a test loads this file by its path.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from metrics import StepRecord, write_outputs, write_plot
from options import lora_config, parse_args
from rollouts import (  # the pure parts' names too: tests/vllm/test_grpo_example.py reads them here
    FIRST_TARGET,
    TARGET_SIZE,
    Router,
    Sample,
    greedy,
    group_advantages,
    parse_completion,
    reward,
    rollouts,
    score,
    split_by_version,
    token_weights,
)
from vllm_api import VllmControl

from launcher.fleet.client import FleetClient

__all__ = [
    "FIRST_TARGET",
    "TARGET_SIZE",
    "Router",
    "Sample",
    "group_advantages",
    "main",
    "parse_completion",
    "reward",
    "rollouts",
    "score",
    "split_by_version",
    "token_weights",
]

FLAT_WHY = (
    "the reward is flat by design here: simulated engines' text is a hash of the prompt and the loaded "
    "checkpoint's digest, not a function of the weights' values (and their 4-byte token ids never fall "
    "in the target set), and no gradient step ran (no torch: --torch-python). "
    "examples/local-grpo-vllm.yaml runs the same trainer on real vLLM engines, where the reward climbs."
)


# -- the policy: a torch worker, or none -----------------------------------------------------------------
class WorkerPolicy:
    """The torch half (``examples/grpo/policy.py``) in a process of the vLLM venv's python: the launcher's
    venv has no torch, and the vLLM venv not every dependency of the launcher (see policy.py's doc)."""

    def __init__(
        self, python: str, model_dir: Path, lr: float, clip: float, lora: dict[str, Any] | None = None
    ) -> None:
        import subprocess

        self.proc = subprocess.Popen(
            [python, str(Path(__file__).with_name("policy.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        init: dict[str, Any] = {"op": "init", "model_dir": str(model_dir), "lr": lr, "clip": clip}
        if lora is not None:
            init["lora"] = lora
        self.params: dict[str, int] = dict(self._call(init).get("params") or {})

    def _call(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        reply = json.loads(line) if line else {"ok": False, "error": f"worker exited ({self.proc.poll()})"}
        if not reply.get("ok"):
            raise RuntimeError(f"torch worker, {req['op']}: {reply.get('error')}")
        return dict(reply)

    def update(self, samples: list[Sample]) -> dict[str, float]:
        fields = ("prompt", "tokens", "logprobs", "advantage", "weights")
        rows = [{k: getattr(s, k) for k in fields} for s in samples]
        return dict(self._call({"op": "update", "samples": rows})["stats"])

    def save(self, directory: Path) -> None:
        self._call({"op": "save", "dir": str(directory)})

    def target_mass(self, prompts: list[list[int]]) -> float | None:
        """The weights' own expected share of target tokens as a first token (``policy.py``)."""
        req = {"op": "target_mass", "prompts": prompts, "lo": FIRST_TARGET, "hi": FIRST_TARGET + TARGET_SIZE}
        return float(self._call(req)["mass"])

    def close(self) -> None:
        """End the worker (its stdin closes). A trainer that dies closes it too, and the job's teardown
        stops the training command's whole process group, the worker with it."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)


class NoTorchPolicy:
    """Sim mode: no gradient, and a checkpoint the simulator loads (valid safetensors headers; other
    bytes every step, so every refit moves the fleet to weights with another checksum); in LoRA mode an
    adapter directory instead (``adapter_config.json`` of the given rank, the same bytes as
    ``adapter_model.safetensors``)."""

    def __init__(self, lora: dict[str, Any] | None = None) -> None:
        self.saved = 0
        self.lora = lora
        self.params: dict[str, int] = {}

    def update(self, samples: list[Sample]) -> dict[str, float]:
        return {}

    def target_mass(self, prompts: list[list[int]]) -> float | None:
        return None  # no weights here

    def save(self, directory: Path) -> None:
        from launcher.engines.sim.checkpoint import write_checkpoint

        self.saved += 1
        directory.parent.mkdir(parents=True, exist_ok=True)
        write_checkpoint(str(directory), fill=bytes([self.saved % 255 + 1]))
        if self.lora is not None:
            config = {
                "peft_type": "LORA",
                "r": self.lora["rank"],
                "lora_alpha": self.lora["alpha"],
                "target_modules": self.lora["target_modules"],
                "bias": "none",
            }
            (directory / "model.safetensors").rename(directory / "adapter_model.safetensors")
            (directory / "config.json").unlink()
            (directory / "adapter_config.json").write_text(json.dumps(config))
            (directory / "adapter_config.json").chmod(0o644)

    def close(self) -> None:
        pass


# -- the loop ---------------------------------------------------------------------------------------------
def served_model_dir(job_dir: Path) -> Path | None:
    """The directory the engines serve (the job's ``generation.model``), relative paths from the cwd the
    job runs in, as the engines resolve them; None for a name that is not a directory (sim)."""
    from launcher.jobdir import JobDir
    from launcher.spec.snapshot import read_spec

    model = read_spec(JobDir(job_dir)).generation.model
    path = Path(model).expanduser().absolute() if model else None
    return path if path is not None and path.is_dir() else None


def lost_engines(txn: dict[str, Any]) -> dict[str, str]:
    """The engines a refit left behind, ``{url: why}``: a full refit's ``quarantined``; an adapter
    load's ``quarantined`` or ``missing`` (engines that did not take it, a list or a map)."""
    lost = txn.get("quarantined") or txn.get("missing") or {}
    return (
        {str(k): str(v) for k, v in lost.items()}
        if isinstance(lost, dict)
        else {str(u): "missing" for u in lost}
    )


SLOW_START = (
    "a seed whose reward is slow to climb has a mass that stays near 0.125 (a random policy's) for its "
    "first updates: 16 samples of a near-uniform policy moved the weights little, in no steady direction; "
    "its reward climbs once the mass does"
)
MASS_PROMPTS = 16
"""Held-out prompts (their own random stream: the training prompts stay those of the seed) on which every
step reads ``target_mass``."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.split("\n")[0])

    job_dir = Path(os.environ["RL_JOB_DIR"])
    out = job_dir / args.out
    out.mkdir(parents=True, exist_ok=True)
    adapter: str | None = args.lora_adapter
    lora = lora_config(args)
    # LoRA mode asks for the adapter by its name; the router answers with its current version.
    router = Router(
        os.environ["RL_POLICY_BASE_URL"],
        os.environ["RL_POLICY_API_KEY"],
        adapter or os.environ["RL_POLICY_MODEL_NAME"],
    )
    # --refit-via vllm-api: every refit through vLLM's own control API, nothing of FleetClient (vllm_api.py).
    try:
        control = (
            VllmControl.from_env(router.base_url, router.model, args.inflight_policy, args.reset_after_resume)
            if args.refit_via == "vllm-api"
            else None
        )
    except ValueError as exc:  # the variable it needs, named, in one line
        raise SystemExit(f"grpo: {exc}") from None
    fleet = FleetClient.from_job_dir(job_dir) if control is None else None
    model_dir = args.model or served_model_dir(job_dir)
    if model_dir is not None:
        model_dir = model_dir.expanduser().absolute()  # the adapter names its base by this path
    sim = not (args.torch_python and model_dir is not None)
    policy: WorkerPolicy | NoTorchPolicy = (
        NoTorchPolicy(lora) if sim else WorkerPolicy(args.torch_python, model_dir, args.lr, args.clip, lora)
    )
    why = (
        "no python with torch (--torch-python)"
        if not args.torch_python
        else "the engines serve no model directory"
    )
    trains = (
        f"LoRA adapter {adapter!r} (rank {lora['rank']}, alpha {lora['alpha']:g}, "
        f"{','.join(lora['target_modules'])}"
        + (f"; {policy.params['trainable']} of {policy.params['total']} parameters" if policy.params else "")
        + ")"
        if lora
        else "full weights"
    )
    print(
        f"grpo: {f'sim mode ({why}): no gradient step' if sim else 'torch update in ' + args.torch_python}, "
        f"model {model_dir or os.environ['RL_POLICY_MODEL_NAME']}, {trains}, "
        f"{args.steps} steps x {args.prompts} prompts x {args.group} samples x {args.max_tokens} tokens"
        + (f"; refits through vLLM's API at {control.control_base_url}" if control else "")
    )

    rng = random.Random(args.seed)
    # Prompts are random token ids of the served vocabulary, clear of the special tokens at its bottom
    # (the simulator takes any id; 512 is the tiny model's size, the default without a config).
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"] if model_dir else 512
    probe = [rng.randrange(8, vocab) for _ in range(args.prompt_len)]
    # Every sample of step 0 must carry a version too: stamp the weights the engines started on, or in
    # LoRA mode load the fresh adapter (B = 0: the base model's distribution) as step-0.
    version = "step-0"
    if control is not None:
        # NeMo-RL's preflight, once; the fleet names the version (the trainer sends none): the one it
        # serves now, or the one a first reload of the served model's own weights moved it to (--reload,
        # or a fleet no refit has named yet: vLLM's API stamps a version only with new weights).
        info = control.preflight()
        first_reload = args.reload or not info.get("_version")
        start = control.refit(str(model_dir)) if first_reload and model_dir is not None else None
        version = str((start or {}).get("version") or info.get("_version") or version)
        print(f"grpo: vLLM API preflight passed; the fleet serves {version}", flush=True)
    elif adapter:
        first = job_dir / "adapters" / version
        policy.save(first)
        loaded = fleet.load_adapter(adapter, first, version=version)
        print(
            f"grpo: adapter {adapter!r} {version} loaded as {loaded.get('served_name')} in "
            f"{float(loaded.get('elapsed_s') or 0.0):.2f}s"
            + (f"; engines without it: {lost_engines(loaded)}" if lost_engines(loaded) else ""),
            flush=True,
        )
    elif args.reload and model_dir is not None:
        fleet.load_weights(model_dir, version=version)
    else:
        fleet.set_weight_version(version)
    # A run with its own --out keeps its checkpoints apart too: a second run in the job reuses the names.
    ckpt_root = job_dir / ("adapters" if adapter else "checkpoints")
    if args.out != "grpo":
        ckpt_root = ckpt_root / args.out
    held_out = random.Random(args.seed + 1_000_003)
    mass_prompts = [
        [held_out.randrange(8, vocab) for _ in range(args.prompt_len)] for _ in range(MASS_PROMPTS)
    ]
    greedy_first = greedy(router, probe, args.max_tokens)
    records: list[StepRecord] = []
    extra: dict[str, Any] = {
        "mode": "sim" if sim else "torch",
        "target": [FIRST_TARGET, FIRST_TARGET + TARGET_SIZE],
        "title": f"GRPO, {'simulated engines (flat by design)' if sim else 'tiny Llama on vLLM CPU'}"
        + (f", LoRA adapter {adapter} (r {lora['rank']})" if lora else ""),
        "greedy_first": greedy_first,
        "seed": args.seed,
        "refit_via": args.refit_via,
        "target_mass_start": policy.target_mass(mass_prompts),
    }
    if lora:
        extra["lora"] = {"adapter": adapter, **lora, "lr": args.lr, **policy.params}
    refit_key = "adapter_refit" if adapter else "refit"
    for step in range(args.steps):
        t0 = time.perf_counter()
        prompts = [[rng.randrange(8, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
        samples = rollouts(router, prompts, args.group, args.max_tokens, args.seed * 1_000 + step)
        t1 = time.perf_counter()
        kept, dropped = split_by_version(samples, version, f"{adapter}@{version}" if adapter else None)
        seen: dict[str, int] = {}
        served_seen: dict[str, int] = {}
        for s in samples:
            seen[str(s.version)] = seen.get(str(s.version), 0) + 1
            if adapter:
                served_seen[str(s.served)] = served_seen.get(str(s.served), 0) + 1
        if not adapter:  # the spans name the engines' versions; an adapter's is in the served name
            for s in kept:  # a token another version made (a keep-mode refit, a move) is masked
                s.weights = token_weights(s, version)
            masked = sum(w == 0.0 for s in kept for w in s.weights or ())
            if masked:
                print(f"grpo: step {step}: {masked} tokens made by another version masked", flush=True)
        score(kept)
        stats = policy.update(kept) if kept else {}
        mass = policy.target_mass(mass_prompts)
        t2 = time.perf_counter()
        next_version = f"step-{step + 1}"
        ckpt = ckpt_root / next_version
        policy.save(ckpt)
        t3 = time.perf_counter()
        if control is not None:  # pause, reload_weights, resume (vllm_api.py): the router names the version
            txn = control.refit(str(ckpt))
            next_version = str(txn.get("version") or next_version)
        elif adapter:
            # No pause: the other tenants (and this adapter's requests still in flight) keep sampling.
            txn = fleet.load_adapter(adapter, ckpt, version=next_version)
        else:
            txn = fleet.load_weights(ckpt, version=next_version)
        t4 = time.perf_counter()
        phases: dict[str, float] = {}
        for st in txn.get("steps", []):
            phases[st["phase"]] = phases.get(st["phase"], 0.0) + float(st.get("took_s") or 0.0)
        seconds = {"rollouts": t1 - t0, "update": t2 - t1, "save": t3 - t2, refit_key: t4 - t3}
        if adapter:
            # The router's own clock of the load (check, canary, every engine): the rest of
            # ``adapter_refit`` is the call's overhead. Nothing paused.
            seconds["router"] = float(txn.get("elapsed_s") or 0.0)
        else:
            # The fleet is paused from the transaction's start to its resume (the router's clock): the
            # part of the refit no rollout can run in; the rest of ``refit`` is the call's own overhead.
            seconds["pause"] = float(txn.get("elapsed_s") or 0.0)
        seconds["total"] = t4 - t0
        rec = StepRecord(
            step=step,
            version=version,
            reward_mean=statistics.fmean(s.reward for s in kept) if kept else math.nan,
            samples=len(kept),
            dropped=len(dropped),
            seconds=seconds,
            update=stats,
            versions_seen=seen,
            refit_phases=phases,
            served_seen=served_seen,
            quarantined=lost_engines(txn),
            target_mass=mass,
        )
        records.append(rec)
        sec = rec.seconds
        of = f"{adapter}@{version}" if adapter else version
        refit = (
            f"adapter refit {sec['adapter_refit']:.2f}s (router {sec['router']:.2f}s, no pause)"
            if adapter
            else f"refit {sec['refit']:.2f}s (pause {sec['pause']:.2f}s)"
        )
        print(
            f"grpo step {step}: reward {rec.reward_mean:.3f} on {rec.samples} samples of {of} "
            f"(dropped {rec.dropped}) | rollouts {sec['rollouts']:.2f}s update {sec['update']:.2f}s "
            f"save {sec['save']:.2f}s {refit}"
            + (f" | ratio {stats['ratio_mean']:.3f} max {stats['ratio_max']:.3f}" if stats else "")
            + (f" | target mass {mass:.3f}" if mass is not None else "")
            + (f" | engines left behind: {rec.quarantined}" if rec.quarantined else ""),
            flush=True,
        )
        version = next_version
        write_outputs(out, records, extra)
    policy.close()
    extra["greedy_last"] = greedy(router, probe, args.max_tokens)
    extra["final_version"] = version
    write_outputs(out, records, extra)
    png = write_plot(out, records, extra["title"])
    first, last = records[0].reward_mean, records[-1].reward_mean
    on = f"adapter {adapter} on {version}" if adapter else f"fleet on {version}"
    print(
        f"grpo: reward {first:.3f} -> {last:.3f} over {len(records)} steps; {on}; "
        f"dropped {sum(r.dropped for r in records)} samples of another version; {out / 'metrics.json'}"
        + (f", {png}" if png else "")
    )
    if sim:
        print(f"grpo: {FLAT_WHY}")
    elif records[-1].target_mass is not None:
        masses = " ".join(f"{r.target_mass:.2f}" for r in records if r.target_mass is not None)
        print(
            f"grpo: target mass (the weights' expected share of target tokens, no sampling noise) "
            f"{extra['target_mass_start']:.3f} -> {masses}: {SLOW_START}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
