"""The resolved spec snapshot in a job directory (``JobDir.spec_file``): what the job runs.

``submit`` writes it and the driver runs it, not the YAML file, which the user may edit while the job is
queued. It lives with the spec rather than in ``jobdir`` (floor 1) because reading it validates the whole
spec, which needs every kind's section (floor 2): the job directory names the file, the spec owns its shape.
"""

from __future__ import annotations

import yaml

from launcher.jobdir import JobDir
from launcher.jobdir.atomic import write_text_atomic
from launcher.spec.resolved import ResolvedSpec


def write_spec(job: JobDir, spec: ResolvedSpec) -> None:
    write_text_atomic(job.spec_file, spec.to_yaml())


def read_spec(job: JobDir) -> ResolvedSpec:
    return ResolvedSpec.model_validate(yaml.safe_load(job.spec_file.read_text()))
