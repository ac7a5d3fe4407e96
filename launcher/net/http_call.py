"""The launcher's outbound HTTP calls (urllib): no redirect is ever followed, and no proxy is used.

``urllib.request.urlopen`` follows a 301/302/303/307/308 and copies every header but the content ones onto
the new request, ``Authorization`` included, to whatever host the ``Location`` names. A process that
answers on an address the launcher calls (a restarted engine's old port taken by someone else, an
external front) could thus collect the job's API key or admin token with one redirect. Nothing the
launcher calls redirects on purpose (engines, routers, vllm-router, the driver's own listeners), so a
redirect is answered as what it is: an ``HTTPError`` with the 3xx status, and the target is never called.

The default opener also sends every request through the HTTP proxy named in the environment
(``http_proxy``), which would then see the bearer token of a call to a cluster-internal address: these
calls go only to the job's own addresses, never through a proxy.

aiohttp calls carrying a credential pass ``allow_redirects=False`` instead (aiohttp follows redirects by
default).
"""

from __future__ import annotations

import urllib.error
import urllib.request
from email.message import Message
from typing import IO, Any


class RedirectRefused(urllib.error.HTTPError):
    """A 3xx answer: the redirect was not followed (the request's credentials stay where they were sent)."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str, headers: Message, newurl: str
    ) -> urllib.request.Request | None:
        raise RedirectRefused(
            req.full_url, code, f"{msg}: redirect to {newurl} refused (never followed)", headers, fp
        )


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _RefuseRedirects())


def bearer(token: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer <token>"}``, or ``{}`` without a token."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def open_url(request: urllib.request.Request | str, timeout: float, data: bytes | None = None) -> Any:
    """``urllib.request.urlopen`` without redirects or proxies; raises ``RedirectRefused`` (an
    ``HTTPError``) on a 3xx, ``HTTPError`` on other error statuses, ``OSError`` when unreachable."""
    return _OPENER.open(request, data=data, timeout=timeout)
