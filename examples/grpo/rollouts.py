"""The rollout half of the example GRPO trainer: samples from the router, their rewards, advantages and
version check.

Why a module of its own: this is the part of ``train.py`` that needs neither torch nor the fleet's admin
surface (only the router's OpenAI URL and the standard library), so its pure functions are unit-tested in
the main venv (``tests/vllm/test_grpo_example.py``, through ``train.py``'s names) without a job; the
loop, the policies and the refit stay in ``train.py``. It is imported as a sibling of ``train.py``, which
runs as a script (``python examples/grpo/train.py``): ``train.py`` puts this directory on ``sys.path``.
"""

from __future__ import annotations

import json
import statistics
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

VERSION_HEADER = "x-rl-weight-version"
FIRST_TARGET, TARGET_SIZE = 256, 64
"""The target set: token ids 256..319, one eighth of the tiny model's 512 (so a random policy scores
about 0.125 and there is room to climb); clear of the special tokens at the bottom of the vocabulary."""
TARGET = frozenset(range(FIRST_TARGET, FIRST_TARGET + TARGET_SIZE))


# -- the pure parts (unit-tested in the main venv: tests/vllm/test_grpo_example.py) --------------------------
@dataclass
class Sample:
    """One completion of one prompt, as the router returned it."""

    group: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    version: str | None
    reward: float = 0.0
    advantage: float = 0.0
    served: str | None = None
    """The response body's ``model``: in LoRA mode the adapter version that sampled it, ``NAME@step-k``."""
    spans: list[list[Any]] | None = None
    """Which weights made which tokens, ``[[version, first, last], ...]`` (token indexes, inclusive): the
    body's ``weight_versions``, which the builtin router puts on every answer it follows
    (docs/continuation.md). None from a front that does not say."""
    weights: list[float] | None = None
    """Each token's weight in the loss (``token_weights``); None: every token weighs 1."""


def reward(tokens: Sequence[int], target: frozenset[int] = TARGET) -> float:
    """The fraction of ``tokens`` in ``target`` (0 for an empty completion: nothing to credit)."""
    return sum(t in target for t in tokens) / len(tokens) if tokens else 0.0


def group_advantages(rewards: Sequence[float], groups: Sequence[int], eps: float = 1e-6) -> list[float]:
    """GRPO's advantage: reward minus its group's mean, over the group's (population) std + ``eps``.
    A group whose samples all scored the same teaches nothing, and gets zeros rather than noise."""
    by_group: dict[int, list[float]] = {}
    for g, r in zip(groups, rewards, strict=True):
        by_group.setdefault(g, []).append(r)
    stats = {g: (statistics.fmean(rs), statistics.pstdev(rs)) for g, rs in by_group.items()}
    return [(r - stats[g][0]) / (stats[g][1] + eps) for g, r in zip(groups, rewards, strict=True)]


def split_by_version(
    samples: Sequence[Sample], expected: str, served: str | None = None
) -> tuple[list[Sample], list[Sample]]:
    """(kept, dropped): a sample is trained on only if the engine that served it carried ``expected``
    (and, given ``served``, the body named that model: in LoRA mode ``NAME@<expected>``). A missing
    header counts as another version: nothing says which weights sampled it."""

    def ok(s: Sample) -> bool:
        return s.version == expected and (served is None or s.served == served)

    return [s for s in samples if ok(s)], [s for s in samples if not ok(s)]


def token_weights(sample: Sample, expected: str, other: float = 0.0) -> list[float]:
    """Each token's weight in the loss: 1 for a token made by ``expected`` (the version the step's
    rollout logprobs and advantages are for), ``other`` for one made by any other version (0: masked).

    Why per token: an answer that crossed a keep-mode refit, or moved to an engine on another version when
    its own died or was drained, was made partly by other weights; its importance ratio is off for exactly
    those tokens, and dropping the whole sample throws away the rest. Without spans the sample's one
    version (its ``x-rl-weight-version``) decides for every token; a token no span covers is another
    version's."""
    n = len(sample.tokens)
    if not sample.spans:
        return [1.0 if sample.version == expected else other] * n
    out = [other] * n
    for version, first, last in sample.spans:
        if version == expected:
            for i in range(max(0, int(first)), min(n - 1, int(last)) + 1):
                out[i] = 1.0
    return out


def score(samples: list[Sample]) -> None:
    """Set every sample's reward, then its advantage within its group (of the samples kept: a group
    that lost samples to the version filter is compared among the ones left)."""
    for s in samples:
        s.reward = reward(s.tokens)
    advantages = group_advantages([s.reward for s in samples], [s.group for s in samples])
    for s, a in zip(samples, advantages, strict=True):
        s.advantage = a


def parse_completion(body: dict[str, Any]) -> tuple[list[int], list[float]]:
    """Token ids and log-probabilities of a ``/v1/completions`` answer made with
    ``return_tokens_as_token_ids`` (tokens spelled ``"token_id:N"``)."""
    lp = body["choices"][0]["logprobs"]
    ids = [int(str(t).rsplit(":", 1)[1]) for t in lp["tokens"]]
    return ids, [float(x) for x in lp["token_logprobs"]]


# -- rollouts ---------------------------------------------------------------------------------------------
@dataclass
class Router:
    """The policy as the training command sees it: the router's OpenAI URL, the client key, the model."""

    base_url: str
    api_key: str
    model: str

    def complete(
        self, prompt: list[int], max_tokens: int, temperature: float, seed: int
    ) -> tuple[Any, str | None]:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": True,  # fixed lengths: the reward is a fraction, the batch a fixed size
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "seed": seed,
        }
        req = urllib.request.Request(
            self.base_url.rstrip("/") + "/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"},
        )
        with urllib.request.urlopen(req, timeout=300) as resp:
            return json.loads(resp.read()), resp.headers.get(VERSION_HEADER)


def rollouts(
    router: Router, prompts: list[list[int]], group: int, max_tokens: int, seed: int, concurrency: int = 16
) -> list[Sample]:
    """``group`` samples of every prompt, sent concurrently (one request each: the router balances
    requests, and the simulator serves n=1 only); the seed differs per sample so a group is not one
    sample repeated."""

    def one(i: int) -> Sample:
        g = i // group
        body, version = router.complete(prompts[g], max_tokens, 1.0, seed * 100_003 + i)
        tokens, logprobs = parse_completion(body)
        spans = body.get("weight_versions")
        return Sample(g, prompts[g], tokens, logprobs, version, served=body.get("model"), spans=spans)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(len(prompts) * group)))


def greedy(router: Router, prompt: list[int], max_tokens: int) -> list[int]:
    """The greedy completion of one fixed prompt: how the test sees that the weights changed."""
    return parse_completion(router.complete(prompt, max_tokens, 0.0, 0)[0])[0]
