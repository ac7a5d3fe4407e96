"""An elastic fleet: grow by Slurm jobs of its own, drain and hand nodes back, the tail policy.

``shapes`` (what the CLI and the driver exchange, the state section), ``slurm_ops`` (grow jobs, handing
nodes back), ``holder`` (the grow job's process), ``tail`` (the pure tail policy), ``manager`` (the
driver's side), ``client`` (the CLI's and Python's side).
"""
