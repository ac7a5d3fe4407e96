"""Build a tiny random Llama model + tokenizer that real vLLM (CPU build) can serve.

Why this exists: the e2e tests need a real vLLM server, but nothing may be downloaded, so the model is
made here from scratch: a byte-level BPE tokenizer trained on a few lines of generated text (vocab ~512,
with a chat template so ``/v1/chat/completions`` works) and a randomly initialised ``LlamaForCausalLM``.
Its output is noise, which is fine: tests fix lengths with ``max_tokens`` and ``ignore_eos``.

This script needs torch/transformers/tokenizers, which only the vLLM venv has, so it runs as a
subprocess of that venv's python::

    $RL_LAUNCH_VLLM_PYTHON tests/support/tiny_model.py OUTDIR [--paced]

The main venv only imports the pure-python helpers (``default_model_dir``, ``ensure_tiny_model``), which
call this file that way. The model is built into a temp dir next to ``OUTDIR`` and renamed into place,
so a concurrent or interrupted build never leaves a half-written model that vLLM would then load.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Bump when the recipe changes so old caches are not reused.
MODEL_VERSION = "tiny-llama-v1"

# Head dim must be >= 64: the CPU attention backend rejects smaller heads
# ("Unsupported CPU attention configuration"). hidden 128 / 2 heads = 64.
CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
PACED_CONFIG = {
    **CONFIG,
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
"""``--paced``: the same tokenizer, a model big enough that one CPU core decodes it at about 6 to 9 ms a
token (the tiny one: about 2 ms). A test that must act in the middle of a generation (take its engine
away after some tokens) needs the engine slower than the router and the client read: with the tiny model
the engine core finished 1000-token answers before a loaded 2-core machine's router had read a few of
them."""
PACED_DTYPE = "float32"
"""The paced model's weights (serve it with ``--dtype float32``): in bfloat16 the same greedy request,
batched differently on the same engine, gave logprobs 0.03 apart at hidden size 512, more than the
differences a continuation itself makes; a test comparing a continued answer with an uninterrupted one
needs them far apart."""
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

# A minimal chat template: role marker, content, end marker; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def default_model_dir() -> Path:
    """Where a build goes when no directory is given (``~/.cache/rl-launch/tiny-llama-v1``; the tests
    give a session temp directory instead)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rl-launch" / MODEL_VERSION


def is_complete(outdir: Path) -> bool:
    """Builds land by an atomic rename, so a dir holding these files is a finished build."""
    return (outdir / "config.json").is_file() and (outdir / "tokenizer.json").is_file()


def ensure_tiny_model(
    python: str, outdir: Path | None = None, timeout_s: float = 600.0, paced: bool = False
) -> Path:
    """Return a built model dir, building it with ``python`` (a venv with torch) if it is missing
    (``paced``: ``PACED_CONFIG``'s model, in ``PACED_DTYPE``).

    Called from the main venv (no torch there), hence the subprocess.
    """
    outdir = Path(outdir) if outdir is not None else default_model_dir()
    if is_complete(outdir):
        return outdir
    proc = subprocess.run(
        [python, str(Path(__file__).resolve()), str(outdir), *(["--paced"] if paced else [])],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
    )
    if proc.returncode != 0 or not is_complete(outdir):
        raise RuntimeError(
            f"building the tiny model failed (rc={proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    return outdir


def _corpus() -> list[str]:
    """Deterministic English-ish text so BPE learns enough merges to reach ~512; content does not matter."""
    syllables = "ka lo mi ne ru sa to vi be da fo gu he ji pe qu ro si te wa xe yo zu".split()
    pseudo = [syllables[i % 23] + syllables[(i * 7) % 23] + syllables[(i * 13) % 23] for i in range(400)]
    words = (
        pseudo
        + (
            "the a an of to in and or for with on at by from is are was were be been this that these those "
            "model token engine router cache prefix request response user assistant system reply answer "
            "question think step reason policy reward train sample rollout batch gradient value loss "
            "hello world one two three four five six seven eight nine ten"
        ).split()
    )
    lines = []
    for i in range(2000):
        n = 5 + (i * 7) % 13
        lines.append(" ".join(words[(i * 31 + j * 17) % len(words)] for j in range(n)) + ".")
    return lines


def build(outdir: Path, config: dict[str, Any] = CONFIG, dtype: str = "bfloat16") -> None:
    """Build tokenizer + random model (``config``, weights in ``dtype``) into a temp dir beside
    ``outdir`` and atomically rename it."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    outdir = Path(outdir)
    if is_complete(outdir):
        return
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.tmp-", dir=outdir.parent))
    try:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        trainer = trainers.BpeTrainer(
            vocab_size=VOCAB_SIZE,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(_corpus(), trainer=trainer)
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token="<|bos|>",
            eos_token="<|eos|>",
            pad_token="<|pad|>",
            additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
            model_max_length=config["max_position_embeddings"],
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(tmp)

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(fast),
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
            torch_dtype=dtype,
            **config,
        )
        model = LlamaForCausalLM(config).to(getattr(torch, dtype))
        model.save_pretrained(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared by other users/jobs
        try:
            os.rename(tmp, outdir)
        except OSError:
            # Someone else finished first (rename onto a non-empty dir fails): theirs is as good as ours.
            if not is_complete(outdir):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3) or argv[2:] not in ([], ["--paced"]):
        print(f"usage: {argv[0]} OUTDIR [--paced]", file=sys.stderr)
        return 2
    if argv[2:]:
        build(Path(argv[1]), PACED_CONFIG, PACED_DTYPE)
    else:
        build(Path(argv[1]))
    print(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
