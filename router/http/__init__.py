"""The router's HTTP layer: how requests arrive, are checked and reach an engine.

``app`` (the application, its listening socket and server settings), ``auth`` (each route's access mark),
``bodies`` and ``limits`` (what a request may cost), ``connections`` (the connection cap and the head
deadline), ``forwarding`` and ``upstream`` (the proxied request, out to an engine and back) and
``status`` (the error answers). It builds on ``router.state`` and imports nothing above it (the fleet
routes, the worker processes, ``router.server``). Nothing is imported here: ``router.config`` reads
``limits`` and ``status`` and must stay free of aiohttp.
"""
