"""``rl-launch check SPEC``: will this spec run on this site? Asked before the first real allocation.

On the login node (``site``): Slurm answers, the partitions, GPUs per node and account the spec asks for
exist, the container runtime is there when a container is named, the job root is writable. Then one short
probe step per group (``probe_job``), running ``python -m launcher.check.probe`` on a node like the job's:
the launcher there is this one, the job root is shared (each side reads what the other wrote), the GPUs the
step sees, the engines' python imports vLLM, the model is visible, a router port is free. Each verdict is
one line (``outcome.Check``); a failure names its fix. ``run.check_spec`` puts them in order.

This file imports nothing: ``probe`` is started on the nodes as ``-m launcher.check.probe``, and its
package must not pull the spec or Slurm helpers in there.
"""
