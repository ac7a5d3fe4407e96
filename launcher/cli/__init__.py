"""The ``rl-launch`` command line: one module per command group, the root group in ``main``.

``main`` names every command with the module that defines it and loads it only when it runs, so this
package's ``__init__`` imports nothing: ``rl-launch --help`` and ``validate`` stay free of aiohttp, Ray
and numpy (``tests/unit/test_spec.py`` checks). The commands parse options and print; what they do lives in
the packages they call (``launcher.jobdir`` finds jobs, ``launcher.bench`` replays, ``launcher.submit.job``
submits). ``rl-launch router`` is defined by the router (``router.cli``) and only registered here.
"""
