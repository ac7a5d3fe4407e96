"""The router's state, one per router whatever the number of processes: the serving set (``backends``),
the routing decision over it (``routing``), the fleet pause (``pause_gate``), the health prober
(``probing``) and the router's metrics (``metrics``). It imports nothing of the HTTP layer above it.
"""
