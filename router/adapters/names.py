"""How an adapter's versions are named on the engines: ``<adapter>@<version>``, one name per version.

vLLM keys its prefix cache (and its adapter cache) by the LoRA request's name. A trainer that reloads
new weights under the name it used before gets KV computed by the old version served to a rollout of
the new one: a request can prefill on version v and decode on v+1 with nothing in the answer to say
so. Each version therefore gets a name of its own on the engines, and the router maps the name a
tenant uses (``model: policy-a``) to its current version's (``policy-a@step-3``): no cache entry ever
crosses versions, and the answer's ``model`` names the version that produced it.
"""

from __future__ import annotations

import re

SEPARATOR = "@"
ADAPTER_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
VERSION_RE = re.compile(r"[A-Za-z0-9._+-]{1,64}")


def check_adapter_name(name: object) -> str:
    """``name`` when it may name an adapter, else ``ValueError`` saying what may."""
    if not isinstance(name, str) or ADAPTER_RE.fullmatch(name) is None:
        raise ValueError(f"adapter name {name!r} must be 1-128 characters of [A-Za-z0-9._-]")
    return name


def check_version(version: object) -> str:
    if not isinstance(version, str) or VERSION_RE.fullmatch(version) is None:
        raise ValueError(f"adapter version {version!r} must be 1-64 characters of [A-Za-z0-9._+-]")
    return version


def served_name(adapter: str, version: str) -> str:
    """The name the engines serve ``version`` of ``adapter`` under."""
    return f"{adapter}{SEPARATOR}{version}"


def split_served(name: str) -> tuple[str, str] | None:
    """``(adapter, version)`` of a served name, or None when ``name`` is not one."""
    adapter, sep, version = name.rpartition(SEPARATOR)
    if not sep or ADAPTER_RE.fullmatch(adapter) is None or VERSION_RE.fullmatch(version) is None:
        return None
    return adapter, version
