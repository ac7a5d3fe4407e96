"""Slurm tier: everything that needs the local Slurm cluster (``slurm/cluster.sh``; marker ``slurm``),
run on its login node and skipped elsewhere (failed in CI). A file goes here when any of its tests needs
the cluster, so its other tests run here too."""
