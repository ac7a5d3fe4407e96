"""LoRA adapters served by a fleet of engines: their plan, their table, their refit, their routes."""
