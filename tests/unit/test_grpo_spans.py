"""The example GRPO trainer weighs each token by the weights that made it (``examples/grpo/rollouts.py``
``token_weights``, from the per-token version spans the builtin router puts on its answers, issue 41):
a token another version made is masked out of the loss, the rest of the sample is kept."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROLLOUTS = Path(__file__).resolve().parents[2] / "examples" / "grpo" / "rollouts.py"


def _rollouts() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grpo_rollouts_spans", ROLLOUTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


rollouts = _rollouts()


def _sample(n: int, version: str | None, spans: list[list[object]] | None) -> object:
    return rollouts.Sample(0, [1, 2], list(range(n)), [-1.0] * n, version, spans=spans)


def test_tokens_of_another_version_are_masked() -> None:
    """An answer that crossed a keep-mode refit from step-1 to step-2 at token 3: in step-2's update
    its first three tokens weigh ``other`` (0 by default), the rest 1."""
    s = _sample(6, "step-1", [["step-1", 0, 2], ["step-2", 3, 5]])
    assert rollouts.token_weights(s, "step-2") == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    assert rollouts.token_weights(s, "step-1", other=0.5) == [1.0, 1.0, 1.0, 0.5, 0.5, 0.5]


def test_without_spans_the_sample_s_version_decides() -> None:
    """A front that gives no spans: the header's version for every token."""
    assert rollouts.token_weights(_sample(3, "step-1", None), "step-1") == [1.0, 1.0, 1.0]
    assert rollouts.token_weights(_sample(3, "step-0", None), "step-1") == [0.0, 0.0, 0.0]
    assert rollouts.token_weights(_sample(3, None, []), "step-1", other=0.25) == [0.25] * 3


def test_a_token_no_span_covers_is_another_version_s() -> None:
    """Spans of an unknown version (``None``: an engine never stamped) and spans past the tokens read."""
    s = _sample(4, "step-1", [[None, 0, 0], ["step-1", 1, 9]])
    assert rollouts.token_weights(s, "step-1") == [0.0, 1.0, 1.0, 1.0]
    assert rollouts.token_weights(_sample(4, "step-1", [["step-1", 2, 3]]), "step-1") == [0.0, 0.0, 1.0, 1.0]
