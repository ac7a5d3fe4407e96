"""Floor 1: starting processes on the job's nodes, and the job's Ray.

``processes`` (a step: ``srun`` on Slurm, a child in its own session locally), ``reaper`` (a local step
dies with its driver), ``ray_node`` (one node's Ray process, private temp dir and token), ``ray_cluster``
(the job's Ray: head, workers, attach). The fronts, the elastic manager and the bench arms start steps
and reach the job's Ray too, which is why this is not part of the driver."""
