"""The router on several processes: the worker processes that share its port (``workers``) and the
routing decisions they ask the parent for (``decisions``). It sits on ``router.http`` and
``router.state``; ``router.server`` starts it when ``RouterConfig.workers > 1``.
"""
