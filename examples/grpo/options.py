"""The example GRPO trainer's command line: its options, their defaults, and the LoRA settings they make.

Why a module of its own: the options are the trainer's interface to a job spec (``training.command`` in
``examples/local.yaml``, ``examples/local-grpo-vllm.yaml``, ``examples/lora-tenant-*.yaml``), and the
defaults that depend on the mode (``--lr``: LoRA or full weights; ``--lora-alpha``: 2 x rank) are
settled here, once, so the loop in ``train.py`` reads finished values and never a ``None`` it must
interpret.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"
"""Every linear layer of a Llama, ``lm_head`` included (the module docstring says why, and when not to)."""
LORA_LR, FULL_LR = 0.05, 3e-3
REFIT_VIA = ("fleet-client", "vllm-api")
"""How a step's refit reaches the fleet: ``FleetClient`` (rl-launch's client), or vLLM's own control API
as an outside trainer (NeMo-RL) sends it (``vllm_api.py``)."""


def parse_args(argv: list[str] | None, description: str) -> argparse.Namespace:
    """The options of ``argv`` (``sys.argv`` for None), ``--lr`` filled with its mode's default."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument(
        "--seed", type=int, default=0, help="the prompts' and samples' seed (two tenants: two different runs)"
    )
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"Adam's learning rate (default {FULL_LR:g}, LoRA mode {LORA_LR:g})",
    )
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument(
        "--reload",
        action="store_true",
        help="load the served model's own weights as step-0 first (full weights only): a second run in the "
        "same job then starts from the weights the first started from, not from where it ended",
    )
    ap.add_argument("--out", default="grpo", help="the metrics' directory under the job directory")
    ap.add_argument(
        "--torch-python",
        default=os.environ.get("RL_LAUNCH_VLLM_PYTHON") or None,
        help="a python with torch, transformers and safetensors for the update (default "
        "$RL_LAUNCH_VLLM_PYTHON); "
        "without one, or when the served model is not a directory (sim engines), no gradient step runs",
    )
    ap.add_argument(
        "--model", type=Path, default=None, help="the served model's directory (default: the job's)"
    )
    ap.add_argument(
        "--lora-adapter",
        default=os.environ.get("RL_LORA_ADAPTER") or None,
        metavar="NAME",
        help="LoRA mode: train the adapter NAME (one the fleet reserved for this job: "
        "fleet.consumers.<job>.adapters) instead of the full weights (default $RL_LORA_ADAPTER)",
    )
    ap.add_argument("--lora-rank", type=int, default=8, help="LoRA mode: the adapter's rank r")
    ap.add_argument(
        "--lora-alpha", type=float, default=None, help="LoRA mode: peft's lora_alpha (default 2 x rank)"
    )
    ap.add_argument(
        "--lora-targets",
        default=LORA_TARGETS,
        help="LoRA mode: the modules the adapter changes, comma-separated (default: %(default)s)",
    )
    ap.add_argument(
        "--refit-via",
        choices=REFIT_VIA,
        default="fleet-client",
        help="fleet-client: one FleetClient.load_weights call a step; vllm-api: vLLM's own control API "
        "over plain HTTP in NeMo-RL's order (examples/grpo/vllm_api.py; $RL_CONTROL_BASE_URL, "
        "$RL_CONTROL_API_KEY_FILE). Full weights only (default: %(default)s)",
    )
    ap.add_argument(
        "--inflight-policy",
        choices=("keep", "wait", "abort"),
        default="keep",
        help="vllm-api mode: the /pause mode, NeMo-RL's refit.inflight_policy (default: %(default)s)",
    )
    ap.add_argument(
        "--reset-after-resume",
        action="store_true",
        help="vllm-api mode: POST /reset_prefix_cache after each /resume, as NeMo-RL does with "
        "recompute_kv_cache_after_weight_updates: true (the router resets inside the refit regardless)",
    )
    args = ap.parse_args(argv)
    if args.refit_via == "vllm-api" and args.lora_adapter:
        ap.error(
            "--refit-via vllm-api refits full weights; a LoRA adapter refits with --refit-via fleet-client"
        )
    if args.lr is None:
        args.lr = LORA_LR if args.lora_adapter else FULL_LR
    return args


def lora_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """LoRA mode's adapter settings, as the torch worker's ``init`` takes them (``policy.py``); None for
    full weights."""
    if not args.lora_adapter:
        return None
    return {
        "rank": args.lora_rank,
        "alpha": args.lora_alpha if args.lora_alpha is not None else 2.0 * args.lora_rank,
        "target_modules": [t.strip() for t in args.lora_targets.split(",") if t.strip()],
    }
