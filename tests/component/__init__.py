"""Component tier: real parts on 127.0.0.1, without a whole job: the router, simulated engines, refits
against them, listeners, the reaper's real processes, a local Ray for an actor. Each test starts what it
needs in-process or as a subprocess and stops it; no ``rl-launch submit``, no Slurm, no vLLM."""
