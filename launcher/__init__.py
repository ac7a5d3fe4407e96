"""rl-launch: Slurm-native launcher for RL post-training (allocation, Ray, engines, router, Gym wiring)."""

__version__ = "0.1.0"
