"""What the registration-capability tests send a router: the job's keys and one request as a trainer or
Gym makes it.

``ADMIN`` and ``KEY`` are the admin token and the client API key such a router is made with; ``call`` sends
one request (JSON body, the bearer ``token`` only when given, redirects not followed, so a redirect is
seen as the answer it is) and reads a JSON object back, or ``{"raw": text}`` for any other body. One
copy for the router's capability tests and its trainer-owned-engine tests.
"""

from __future__ import annotations

import aiohttp
import orjson

ADMIN = "admin-" + "a" * 24
KEY = "client-" + "k" * 24


async def call(
    method: str, url: str, body: object = None, token: str | None = None
) -> tuple[int, dict[str, object]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = orjson.dumps(body) if body is not None else None
    async with aiohttp.ClientSession() as s:
        async with s.request(method, url, data=data, headers=headers, allow_redirects=False) as r:
            raw = await r.read()
            return r.status, (orjson.loads(raw) if raw[:1] == b"{" else {"raw": raw.decode()})
