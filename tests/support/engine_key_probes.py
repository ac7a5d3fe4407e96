"""Who may call an engine's routes, probed: one table of requests (``PROBES``), sent without the key and
with it, against the simulator here and against real vLLM CPU engines (as vLLM ships it, and behind the
launcher's key guard); ``expected(guarded)`` is vLLM's rule (``/v1`` only) or the guard's (everything but
``/health``)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from launcher.engines.key_guard import needs_key

KEY = "engine-key-guard-test-key"

# (method, path, JSON body or None): the dev and RL routes an attacker would call, the routes vLLM does
# guard, and the open ones. /pause is followed by /resume so a raw engine that obeyed is left serving.
PROBES: list[tuple[str, str, object]] = [
    ("GET", "/health", None),
    ("GET", "/metrics", None),
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hello"}),
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}),
    ("POST", "/pause?mode=keep", None),
    ("POST", "/resume", None),
    ("GET", "/is_paused", None),
    ("POST", "/abort_requests", {"request_ids": ["chatcmpl-nothing"]}),
    ("POST", "/update_weight_version", {"new_version": "stranger"}),
    ("GET", "/weight_info", None),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/collective_rpc", {"method": "rl_launch_probe_no_such_method"}),
]


def _call(base: str, method: str, path: str, body: object, key: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def refused_without_key(base: str) -> dict[str, bool]:
    """For each probe: True when the engine answered 401 to a caller without the key."""
    return {f"{m} {p}": _call(base, m, p, b, None) == 401 for m, p, b in PROBES}


def expected(guarded: bool) -> dict[str, bool]:
    """vLLM's rule (``/v1`` only) or the guard's (everything but ``/health``)."""
    out = {}
    for method, path, _ in PROBES:
        bare = path.split("?", 1)[0]
        out[f"{method} {path}"] = needs_key(bare) if guarded else bare.startswith("/v1")
    return out
