"""sbatch and config templates (Jinja2), installed as the package ``launcher.templates``."""
