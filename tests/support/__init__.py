"""Helpers shared by the test tiers: fake and simulated engines, recording servers, checkpoints, users."""
