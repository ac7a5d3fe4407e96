"""LoRA adapters served by a fleet of engines, on the request path: their plan, their names, their table
(who owns which, which version serves where) and a request's resolution. It imports nothing of
``router.http`` (which calls it) nor ``router.fleet``; the admin side, which changes the table (the
check, the adapter refit, its routes), is in ``router.fleet.adapter_*``."""
