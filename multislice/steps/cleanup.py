"""cleanup: the exit handler. Delete this pipeline run's JobSets that have not completed; nothing else.

Runs after the stages whether they succeeded, failed or were cancelled. It
selects JobSets by this run's ``pipeline/runid`` label, so another run's
JobSets (even of the same run name) are never touched, and it leaves
completed JobSets alone. On the local backend deleting a JobSet stops every
process it started; its state and logs stay on disk.
"""

from __future__ import annotations

import os
from typing import Any

from multislice import names
from multislice.backends import BackendUnavailable, backend_for
from multislice.steps import is_local_path, say


def run(
    backend: str, output_dir: str, run_name: str, pipeline_run_id: str, pipeline_status: str = ""
) -> dict[str, Any]:
    """Delete the run's unfinished JobSets; returns what was deleted and kept.

    Takes raw pipeline parameters rather than a plan: an exit handler must run
    even when planning failed.
    """
    if backend == "local" and is_local_path(output_dir) and not os.path.isabs(output_dir):
        output_dir = os.path.abspath(output_dir)
    run_dir = f"{output_dir.rstrip('/')}/{run_name}"
    try:
        jobsets = backend_for(backend, run_dir)
    except BackendUnavailable as error:
        say("cleanup", f"nothing to clean up: {error}")
        return {"deleted": [], "kept": [], "pipeline_status": pipeline_status}
    deleted, kept = [], []
    for state in jobsets.list_jobsets({names.LABEL_PIPELINE_RUN_ID: pipeline_run_id}):
        if state.phase == "Completed":
            kept.append(state.name)
            continue
        final = jobsets.delete_jobset(state.name)
        deleted.append(f"{state.name} ({state.phase} -> {final.phase if final else 'gone'})")
    say(
        "cleanup",
        f"pipeline {pipeline_status or 'finished'}; deleted {deleted or 'nothing'}; kept completed {kept or 'none'}",
    )
    return {"deleted": deleted, "kept": kept, "pipeline_status": pipeline_status}
