"""The torch half of the example GRPO trainer: the trainer's weights, the update, the checkpoint writer.

Why a process of its own: torch lives only in the vLLM venv (the launcher's venv has none: PyPI's torch
is a CUDA build of several GB), and the vLLM venv lacks some of the launcher's own dependencies, so
neither venv runs the whole trainer. ``train.py`` runs in the launcher's python (``FleetClient``, the
router, the plots) and starts this file with the vLLM venv's python (``--torch-python``); they speak one
JSON object a line over the worker's stdin/stdout (``init``, ``update``, ``target_mass``, ``save``), and
the worker's stray prints go to stderr, so they never corrupt the protocol.

The update is GRPO's clipped policy-gradient loss, token-level mean, with the importance ratio between
the trainer's log-probabilities and the rollout's. vLLM samples in the checkpoint's dtype (bf16 for the
tiny model) while the trainer keeps fp32 weights, so even on-policy the ratio is not exactly 1; the clip
bounds what that mismatch can do, and the ratio's mean and max are reported every step.

**LoRA mode** (``init`` with ``"lora": {"rank", "alpha", "target_modules"}``): the base weights stay
frozen and ``peft``'s ``get_peft_model`` wraps the model with a LoRA adapter; the optimizer sees only
the adapter's parameters, and ``save`` writes the adapter as ``peft`` does (``save_pretrained``:
``adapter_config.json`` + ``adapter_model.safetensors``), the directory vLLM's ``/v1/load_lora_adapter``
loads. A fresh adapter has B = 0 (peft's default), so the one saved before the first step serves exactly
the base model's distribution, through the adapter path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


class TorchPolicy:
    """The trainer's copy of the weights (fp32), its optimizer, the loss, and the checkpoint writer."""

    def __init__(self, model_dir: str, lr: float, clip: float, lora: dict[str, Any] | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        torch.set_num_threads(1)  # the engines share the machine's cores; the model is tiny
        self.torch = torch
        self.config_text = (Path(model_dir) / "config.json").read_text()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.serve_dtype = getattr(torch, json.loads(self.config_text).get("dtype") or "bfloat16")
        self.lora = lora
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            config = LoraConfig(
                r=int(lora["rank"]),
                lora_alpha=float(lora["alpha"]),
                target_modules=list(lora["target_modules"]),
                lora_dropout=0.0,
                bias="none",  # vLLM serves no LoRA biases
                task_type="CAUSAL_LM",
            )
            self.model = get_peft_model(self.model, config)  # freezes every base weight
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)
        self.clip = clip

    def trainable(self) -> dict[str, int]:
        """How many parameters the optimizer moves, of how many the model has."""
        return {
            "trainable": sum(p.numel() for p in self.params),
            "total": sum(p.numel() for p in self.model.parameters()),
        }

    def update(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One optimizer step over ``samples`` (``prompt``, ``tokens``, ``logprobs``, ``advantage``, and
        ``weights``: each token's weight, 0 for a token another version's weights made; absent: all 1)."""
        torch = self.torch
        self.model.train()
        self.opt.zero_grad()
        n_tokens = sum(
            sum(s["weights"]) if s.get("weights") is not None else len(s["tokens"]) for s in samples
        )
        n_tokens = max(n_tokens, 1e-9)  # every token masked: a step that moves nothing
        loss_sum, ratios = 0.0, []
        for s in samples:
            prompt, tokens = s["prompt"], s["tokens"]
            logits = self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            new = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            ratio = torch.exp(new - torch.tensor(s["logprobs"]))
            clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
            adv = float(s["advantage"])
            per_token = torch.minimum(ratio * adv, clipped * adv)
            if s.get("weights") is not None:
                per_token = per_token * torch.tensor(s["weights"])
            loss = -per_token.sum() / n_tokens
            loss.backward()
            loss_sum += loss.item()
            ratios.extend(ratio.detach().tolist())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, 1.0))
        self.opt.step()
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "ratio_mean": sum(ratios) / len(ratios),
            "ratio_max": max(ratios),
        }

    def target_mass(self, prompts: list[list[int]], lo: int, hi: int) -> float:
        """The probability the policy puts on token ids ``[lo, hi)`` as the next token of each prompt,
        averaged: the expected reward of a first token, read from the weights without sampling noise
        (the sampled reward of 16 completions moves by +-0.05 from noise alone)."""
        torch = self.torch
        self.model.eval()
        with torch.no_grad():
            masses = [
                float(torch.softmax(self.model(torch.tensor([p])).logits[0, -1].float(), -1)[lo:hi].sum())
                for p in prompts
            ]
        return sum(masses) / len(masses)

    def save(self, directory: str) -> None:
        """``config.json`` and ``model.safetensors`` in the served dtype (what vLLM's loader reads), or in
        LoRA mode the adapter (``save_pretrained``: ``adapter_config.json``, ``adapter_model.safetensors``
        in fp32, vLLM casts it); files 0644 in a 0755 directory: the router refuses a checkpoint others
        could write."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, mode=0o755)
        if self.lora is not None:
            # No copy of the base lm_head beside its adapter (peft saves one when lm_head is a target):
            # the engines serve the base weights they loaded.
            self.model.save_pretrained(str(d), save_embedding_layers=False)
            for f in d.iterdir():
                f.chmod(0o644)
            return
        sd = self.model.state_dict()
        tensors = {k: v.detach().to(self.serve_dtype).contiguous() for k, v in sd.items()}
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(self.config_text)
        for f in d.iterdir():
            f.chmod(0o644)


def serve() -> None:
    """Answer one JSON line per request line until stdin closes."""
    out = sys.stdout
    sys.stdout = sys.stderr  # transformers' and torch's prints must not land in the protocol
    policy: TorchPolicy | None = None
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "init":
                policy = TorchPolicy(req["model_dir"], req["lr"], req["clip"], req.get("lora"))
                reply: dict[str, Any] = {"ok": True, "params": policy.trainable()}
            elif policy is None:
                reply = {"ok": False, "error": "init first"}
            elif req["op"] == "update":
                reply = {"ok": True, "stats": policy.update(req["samples"])}
            elif req["op"] == "target_mass":
                reply = {"ok": True, "mass": policy.target_mass(req["prompts"], req["lo"], req["hi"])}
            elif req["op"] == "save":
                policy.save(req["dir"])
                reply = {"ok": True}
            else:
                reply = {"ok": False, "error": f"unknown op {req['op']!r}"}
        except Exception as exc:  # the trainer reports it and stops; the traceback is on stderr
            import traceback

            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    serve()
