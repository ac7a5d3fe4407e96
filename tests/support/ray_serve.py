"""What the Ray Serve gateway's tests share (the local refit through Serve and the Slurm gateway tests):
``post_json``, a JSON request that hands back any status (an error too) with its headers and body, since
those tests check refusals as closely as answers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def post_json(url: str, body: dict[str, Any], timeout: float = 60) -> tuple[int, dict[str, str], bytes]:
    """POST ``body`` as JSON: (status, headers with lower-case names, raw body), an HTTP error included."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()
