"""Unit tier: pure logic (policies, the fleet-health state machine, kinds, floors, the spec and its sbatch
script, the bench's virtual time) and the CLI's side-effect-free commands (validate, render, --dry-run):
no server and no job, nothing real to wait for, so the whole tier runs in well under a minute anywhere."""
