"""Checks on an adapter directory before any engine is asked to load it.

What vLLM 0.32 does with a bad one, measured on its CPU build: a rank above ``--max-lora-rank`` is a 500
from the engine's worker ("LoRA rank 16 is greater than max_lora_rank 8"), a damaged
``adapter_model.safetensors`` a 500 ("Error while deserializing header"), a missing directory a 404; the
engine stays up each time. So a bad directory costs no engine, but it does cost the tenant a failed
refit in the middle of a step, and the owner of a shared fleet a log full of tracebacks. The router
refuses what it can see before that, naming the file and the reason:

* the directory is absolute, there, readable, this user's and not writable by others, and no other user
  can rename or re-point anything on the way to it (the checkpoint check's rules,
  ``router.fleet.checkpoint``: whoever can write it, or swap it, chooses what every rollout of the
  tenant samples from), unless the caller allows a foreign one;
* ``adapter_config.json`` is a JSON object of a LoRA adapter (``peft_type`` ``LORA``) whose rank (``r``,
  and every value of ``rank_pattern``) is within the fleet's ``max_lora_rank``;
* its weights are ``adapter_model.safetensors`` (a whole safetensors file: header parsed, data region
  exactly as long as the header says) or ``adapter_model.bin``;
* where the adapter names its base model by an absolute directory the router can read, that model's
  architecture and sizes are the served model's (``router.fleet.checkpoint.mismatches``): an adapter
  trained on another base would load and produce garbage.

The check also returns the digest of the two files the engines read (``adapter_digest``: the config and
the weights, a few MB), which the router keeps with the version it loads: vLLM has no checksum of an
adapter, and the engines re-read the directory whenever they load the version again (a restarted engine's
restore, ``router.fleet.adapter_restore``), so the digest is how the router knows that what they read
then is what was checked and served under that version (issue 38: a restore reloaded a directory swapped
since, and half of a tenant's rollouts of one version came from another user's adapter).

What is not checked: that the tensors fit the served model's modules (the engine's loader checks that;
the canary engine finds it before any other engine is touched).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

from router.adapters.plan import LoraPlan
from router.fleet.checkpoint import (
    MAX_CONFIG_BYTES,
    CheckpointRefused,
    _open_regular,
    check_weight_file,
    mismatches,
    read_json,
    reference_config,
    trusted_directory,
)

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterRefused(CheckpointRefused):
    """An adapter directory no engine is asked to load; the message says which file and why."""


@dataclass(frozen=True)
class AdapterDir:
    """A directory that passed: its rank, the modules it adapts, its weight file, and what its base
    model was compared with (``base``: empty when not compared, ``note`` says why)."""

    path: str
    rank: int
    target_modules: list[str]
    weights: str
    base: str = ""
    note: str = ""
    lm_head: bool = False
    """It adapts ``lm_head`` (refused on CPU engines serving the base model: ``adapter_refit``)."""
    digest: str = ""
    """``adapter_digest`` of the files as this check read them (kept with the version it is loaded as)."""

    def summary(self) -> str:
        compared = f"base compared with {self.base}" if self.base else self.note
        return f"rank {self.rank}, {self.weights}; {compared}"


def _rank(config: dict[str, Any], path: str, plan: LoraPlan) -> int:
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise AdapterRefused(f'{path}: "r" must be the adapter\'s rank, a positive integer, got {r!r}')
    pattern = config.get("rank_pattern") or {}
    if not isinstance(pattern, dict):
        raise AdapterRefused(f'{path}: "rank_pattern" must be an object, got {type(pattern).__name__}')
    ranks = [r, *pattern.values()]
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in ranks):
        raise AdapterRefused(f"{path}: every rank_pattern value must be a positive integer")
    top = max(ranks)
    if top > plan.max_lora_rank:
        raise AdapterRefused(
            f"{path}: rank {top} is above the fleet's max_lora_rank {plan.max_lora_rank} "
            "(generation.lora.max_lora_rank): train with a smaller r, or plan a larger rank"
        )
    return top


def read_adapter(
    path: str, plan: LoraPlan, served_root: str | None, allow_foreign: bool = False
) -> AdapterDir:
    """The adapter at ``path`` after every check above, or ``AdapterRefused``. Blocking (the caller runs
    it off the loop, under ``router.fleet.checkpoint.CheckpointGuard``)."""
    try:
        real, names = trusted_directory(path, allow_foreign, kind="adapter")
        if CONFIG_FILE not in names:
            raise AdapterRefused(
                f"adapter directory {path} has no {CONFIG_FILE} (is it a full checkpoint? refit the base "
                "model with `rl-launch fleet refit --from` instead)"
            )
        config_path = os.path.join(real, CONFIG_FILE)
        config = read_json(real, CONFIG_FILE, MAX_CONFIG_BYTES, allow_foreign)
        if not isinstance(config, dict):
            raise AdapterRefused(f"{config_path} is not a JSON object")
        kind = config.get("peft_type")
        if kind != "LORA":
            raise AdapterRefused(
                f"{config_path}: peft_type is {kind!r}; the engines serve LORA adapters only"
            )
        rank = _rank(config, config_path, plan)
        targets = config.get("target_modules")
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise AdapterRefused(f"{config_path}: target_modules must name the modules the adapter changes")
        weights = next((w for w in WEIGHT_FILES if w in names), None)
        if weights is None:
            raise AdapterRefused(f"adapter directory {path} holds neither {' nor '.join(WEIGHT_FILES)}")
        check_weight_file(real, weights, allow_foreign)
        digest = adapter_digest(real, weights)
    except AdapterRefused:
        raise
    except CheckpointRefused as exc:
        raise AdapterRefused(str(exc)) from None
    except OSError as exc:
        raise AdapterRefused(f"adapter directory {path}: {exc}") from None
    base, note = _compare_base(config, path, served_root)
    lm_head = any(t == "lm_head" or t.endswith(".lm_head") for t in targets)
    return AdapterDir(path, rank, sorted(targets), weights, base, note, lm_head, digest)


def adapter_digest(directory: str, weights: str) -> str:
    """The hex SHA-256 of the adapter's ``adapter_config.json`` and its weight file ``weights`` (names and
    bytes) in the (checked, real) ``directory``: every byte vLLM's LoRA loader reads. Each file is
    opened as the check opens it (a regular file, no symlink followed at the last step). Blocking."""
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, weights):
        path = os.path.join(directory, name)
        fh, _ = _open_regular(os.path.realpath(path), path)
        with fh:
            digest.update(name.encode() + b"\0")
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
            digest.update(b"\0")
    return digest.hexdigest()


def _compare_base(config: dict[str, Any], path: str, served_root: str | None) -> tuple[str, str]:
    """Compare the adapter's base model (when it names a directory) with the served model's config."""
    served, why = reference_config(served_root)
    if served is None:
        return "", f"base model not compared: {why}"
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not os.path.isabs(base):
        return "", f"base model not compared: the adapter names {base!r}, no absolute directory"
    trained_on, why_base = reference_config(base)
    if trained_on is None:
        return "", f"base model not compared: {why_base}"
    bad = mismatches(served, trained_on)
    if bad:
        raise AdapterRefused(
            f"adapter {path} was trained on {base}, which is not the served model ({served_root}): "
            + "; ".join(bad)
        )
    return base, ""
