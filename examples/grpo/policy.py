"""The torch half of the example GRPO trainer: the trainer's weights, the update, the checkpoint writer.

Why a process of its own: torch lives only in the vLLM venv (the launcher's venv has none: PyPI's torch
is a CUDA build of several GB), and the vLLM venv lacks some of the launcher's own dependencies, so
neither venv runs the whole trainer. ``train.py`` runs in the launcher's python (``FleetClient``, the
router, the plots) and starts this file with the vLLM venv's python (``--torch-python``); they speak one
JSON object a line over the worker's stdin/stdout (``init``, ``update``, ``save``), and the worker's
stray prints go to stderr, so they never corrupt the protocol.

The update is GRPO's clipped policy-gradient loss, token-level mean, with the importance ratio between
the trainer's log-probabilities and the rollout's. vLLM samples in the checkpoint's dtype (bf16 for the
tiny model) while the trainer keeps fp32 weights, so even on-policy the ratio is not exactly 1; the clip
bounds what that mismatch can do, and the ratio's mean and max are reported every step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


class TorchPolicy:
    """The trainer's copy of the weights (fp32), its optimizer, the loss, and the checkpoint writer."""

    def __init__(self, model_dir: str, lr: float, clip: float) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        torch.set_num_threads(1)  # the engines share the machine's cores; the model is tiny
        self.torch = torch
        self.config_text = (Path(model_dir) / "config.json").read_text()
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.serve_dtype = getattr(torch, json.loads(self.config_text).get("dtype") or "bfloat16")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.clip = clip

    def update(self, samples: list[dict[str, Any]]) -> dict[str, float]:
        """One optimizer step over ``samples`` (``prompt``, ``tokens``, ``logprobs``, ``advantage``)."""
        torch = self.torch
        self.model.train()
        self.opt.zero_grad()
        n_tokens = sum(len(s["tokens"]) for s in samples)
        loss_sum, ratios = 0.0, []
        for s in samples:
            prompt, tokens = s["prompt"], s["tokens"]
            logits = self.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
            new = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            ratio = torch.exp(new - torch.tensor(s["logprobs"]))
            clipped = torch.clamp(ratio, 1 - self.clip, 1 + self.clip)
            adv = float(s["advantage"])
            loss = -torch.minimum(ratio * adv, clipped * adv).sum() / n_tokens
            loss.backward()
            loss_sum += loss.item()
            ratios.extend(ratio.detach().tolist())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0))
        self.opt.step()
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "ratio_mean": sum(ratios) / len(ratios),
            "ratio_max": max(ratios),
        }

    def save(self, directory: str) -> None:
        """``config.json`` and ``model.safetensors`` in the served dtype (what vLLM's loader reads), files
        0644 in a 0755 directory: the router refuses a checkpoint others could write."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, mode=0o755)
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
                policy = TorchPolicy(req["model_dir"], req["lr"], req["clip"])
                reply: dict[str, Any] = {"ok": True}
            elif policy is None:
                reply = {"ok": False, "error": "init first"}
            elif req["op"] == "update":
                reply = {"ok": True, "stats": policy.update(req["samples"])}
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
