"""A router's ``/metrics`` as ``{'name{labels}': value}``, for tests that count what the router counted."""

from __future__ import annotations

import aiohttp


async def metrics(base: str) -> dict[str, float]:
    """``{'name{labels}': value}`` from the router's /metrics."""
    async with aiohttp.ClientSession() as s:
        async with s.get(base + "/metrics") as r:
            assert r.status == 200
            text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
