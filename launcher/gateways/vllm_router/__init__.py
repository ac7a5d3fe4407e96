"""``router.kind: vllm-router``: vLLM Router (PyPI ``vllm-router`` 0.1.17) in front of the fleet.

``gateway`` (the front, managed or external), ``command`` (its command line and ``router.vllm_router``),
``process`` (the managed process in a Ray actor), ``admin`` (its ``/workers`` API), ``bench_arm`` (the
bench's ``vllm-router`` arms), ``kind`` (its spec section and what it declares). The ``/fleet/*`` routes the
driver serves beside it are ``launcher.gateways.fleet_endpoint`` (shared with other kinds).
"""
