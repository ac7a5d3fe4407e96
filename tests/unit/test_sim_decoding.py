"""The simulator's model decodes greedily from the context alone, so a continuation is exact.

The router continues a moved request by sending another engine prompt ids + produced ids (issue 41);
these check the property it relies on at the level of the model and the request planner, with no server.
"""

from __future__ import annotations

from launcher.engines.sim import SimConfig
from launcher.engines.sim.decoding import context_hash, extend, greedy, model_key
from launcher.engines.sim.protocol import parse_generation, plan_output
from launcher.engines.sim.tokens import decode, encode, render_chat


def test_context_hash_extends_token_by_token() -> None:
    ids = encode("a prompt of some length, with more than a few tokens in it")
    h = 0
    for t in ids:
        h = extend(h, t)
    assert h == context_hash(ids)
    assert context_hash(ids[:-1]) != context_hash(ids)


def test_continuation_from_any_point_yields_the_rest() -> None:
    prompt = encode("Write a long story about engines.")
    key = model_key(0, None, None)
    full = greedy(prompt, 300, key)
    assert len(full.tokens) == 300 and not full.stopped
    for k in (1, 17, 150, 299):
        rest = greedy(prompt + full.tokens[:k], 300 - k, key)
        assert rest.tokens == full.tokens[k:]
        assert rest.logprobs == full.logprobs[k:]
        assert rest.text == full.text[4 * k :]
    assert decode(full.tokens) == full.text  # 4 ASCII bytes per token: the text re-tokenizes to the ids


def test_end_of_sequence_and_min_tokens_survive_a_continuation() -> None:
    prompt = encode("Answer briefly.")
    key = model_key(3, 7, None)
    full = greedy(prompt, 4000, key, eos_mean=40, min_tokens=25)
    assert full.stopped and 25 <= len(full.tokens) < 4000
    for k in (1, 10, 24, len(full.tokens) - 1):
        rest = greedy(prompt + full.tokens[:k], 4000 - k, key, 40, max(25 - k, 0))
        assert rest.stopped and rest.tokens == full.tokens[k:]


def test_the_same_context_differs_by_weights_and_seed() -> None:
    prompt = encode("same prompt")
    base = greedy(prompt, 50, model_key(0, None, None)).tokens
    assert greedy(prompt, 50, model_key(0, None, 12345)).tokens != base
    assert greedy(prompt, 50, model_key(0, 9, None)).tokens != base
    assert greedy(prompt, 50, model_key(0, None, None)).tokens == base


def test_a_chat_continues_as_a_completion_of_its_prompt_ids() -> None:
    config = SimConfig(eos_min_tokens=20, eos_max_tokens=200)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Plan the refit."}]
    chat = parse_generation("chat", {"messages": messages, "max_tokens": 500, "seed": 4}, config)
    assert chat.prompt == render_chat(messages)
    out = plan_output(chat, config)
    k = len(out.tokens) // 2
    body = {"prompt": chat.prompt + out.tokens[:k], "max_tokens": 500 - k, "seed": 4}
    rest = plan_output(parse_generation("completion", body, config), config)
    assert rest.tokens == out.tokens[k:] and rest.logprobs == out.logprobs[k:]
    assert rest.finish_reason == out.finish_reason
    # a shorter max_tokens is a prefix, finish "length"
    short = plan_output(
        parse_generation("chat", {"messages": messages, "max_tokens": 5, "seed": 4}, config), config
    )
    assert short.tokens == out.tokens[:5] and short.finish_reason == "length"
