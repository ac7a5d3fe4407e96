"""Floor 5, the login side: ``job`` submits a job (Slurm or here) and follows it, ``fleet`` brings a
standing fleet up and down, ``render`` writes the standalone sbatch script."""
