"""The router's operations on the fleet of engines behind it: the engine's HTTP contract, one client for
every call to an engine (``engine``), the ``/fleet/*`` refit routes (``api``), the fan-out of one engine
call with its report (``ops``), the engines' counters per step
(``engine_counters``), the fleet-wide cache reset (``cache_reset``) and vllm-router's ``/workers``
membership API with the router's readiness and metrics routes (``admin``), and the LoRA adapters' admin
side: the check of an adapter directory, the adapter refit and its routes (``adapter_check``,
``adapter_refit``, ``adapter_routes``; the table they change is ``router.adapters``). The launcher's
fleet commands and the vllm-router front's fleet endpoint use them too.
"""
