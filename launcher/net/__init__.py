"""Floor 1: the launcher's own HTTP, out (``http_call``: no redirects, no proxies from the environment)
and in (``listener``: the driver's guarded listeners, the status endpoint and the fleet endpoint).

Both live this low because the fronts, the fleet client, the status reader and the driver all speak
HTTP; when they lived in the driver, the fronts imported the driver to get a listener."""
