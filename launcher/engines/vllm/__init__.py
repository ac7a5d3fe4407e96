"""``generation.engine: vllm``: one ``vllm serve`` process per engine (``engine``), its spec settings and
what it declares (``kind``)."""
