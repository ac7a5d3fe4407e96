"""``router.kind: builtin``: rl-launch's own router (``gateway``), its spec section and what it declares
(``kind``)."""
