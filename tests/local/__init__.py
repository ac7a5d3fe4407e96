"""Local tier: whole local jobs (``rl-launch submit`` of a ``cluster: local`` spec, standing fleets, the
README's first command): the driver, a real Ray, the router and simulated engines end to end, as a user
runs them on one machine. Slower (a job each) but needs nothing beyond this venv."""
