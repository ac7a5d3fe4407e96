"""Dynamo tier: everything that needs NVIDIA Dynamo (``RL_LAUNCH_DYNAMO_PYTHON``, etcd, nats-server;
marker ``dynamo``), locally or on the Slurm cluster: the heaviest install, so it outranks the others
when a file needs it."""
