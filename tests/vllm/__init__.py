"""vLLM tier: everything that needs real vLLM CPU engines (``RL_LAUNCH_VLLM_PYTHON``; marker ``vllm``)
and no Slurm: engine starts cost a minute or more each, so these tests are kept apart from the fast
tiers (and in one xdist lane, see tests/conftest.py)."""
