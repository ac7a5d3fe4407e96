"""Build a tiny random Llama model + tokenizer that real vLLM (CPU build) can serve.

Why this exists: the e2e tests need a real vLLM server, but nothing may be downloaded, so the model is
made here from scratch: a byte-level BPE tokenizer trained on a few lines of generated text (vocab ~512,
with a chat template so ``/v1/chat/completions`` works) and a randomly initialised ``LlamaForCausalLM``.
Its output is noise, which is fine: tests fix lengths with ``max_tokens`` and ``ignore_eos``.

This script needs torch/transformers/tokenizers, which only the vLLM venv has, so it runs as a
subprocess of that venv's python::

    $RL_LAUNCH_VLLM_PYTHON tests/support/tiny_model.py OUTDIR

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


def ensure_tiny_model(python: str, outdir: Path | None = None, timeout_s: float = 600.0) -> Path:
    """Return a built model dir, building it with ``python`` (a venv with torch) if it is missing.

    Called from the main venv (no torch there), hence the subprocess.
    """
    outdir = Path(outdir) if outdir is not None else default_model_dir()
    if is_complete(outdir):
        return outdir
    proc = subprocess.run(
        [python, str(Path(__file__).resolve()), str(outdir)],
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


def build(outdir: Path) -> None:
    """Build tokenizer + random model into a temp dir beside ``outdir`` and atomically rename it."""
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
            model_max_length=CONFIG["max_position_embeddings"],
        )
        fast.chat_template = CHAT_TEMPLATE
        fast.save_pretrained(tmp)

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(fast),
            bos_token_id=fast.bos_token_id,
            eos_token_id=fast.eos_token_id,
            pad_token_id=fast.pad_token_id,
            torch_dtype="bfloat16",
            **CONFIG,
        )
        model = LlamaForCausalLM(config).to(torch.bfloat16)
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
    if len(argv) != 2:
        print(f"usage: {argv[0]} OUTDIR", file=sys.stderr)
        return 2
    build(Path(argv[1]))
    print(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
