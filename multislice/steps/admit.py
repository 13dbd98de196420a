"""admit: submit a stage's JobSet to its queue and wait until it is admitted.

On GKE this will create the JobSet with its Kueue labels and wait for the
Workload's QuotaReserved and Admitted conditions (not built yet). On the
local backend there is no Kueue: the CPU-flavour JobSet is created and is
admitted on creation, which the report says.

A stage whose final checkpoint already exists (a rerun of the same run after
a later stage failed) is not trained again: admit creates nothing and the
stage's later steps pass it through, so the rerun resumes where work was lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from multislice import jobset
from multislice.backends import backend_for
from multislice.plan import Plan
from multislice.steps import is_local_path, latest_committed_step, say, write_report


def already_trained(plan: Plan, stage_name: str) -> bool:
    """True when the stage's final checkpoint exists and was committed (local paths only)."""
    stage = plan.stage(stage_name)
    return is_local_path(stage.checkpoint_dir) and latest_committed_step(stage.checkpoint_dir) == stage.final_step


def run(plan: Plan, stage_name: str, pipeline_run_id: str) -> dict[str, Any]:
    """Create (or adopt) the stage's JobSet and wait for admission; returns the admit report.

    Raises:
        multislice.schema.ManifestInvalid: the rendered JobSet fails CRD validation.
        multislice.backends.local.AlreadyExists: another JobSet holds the name.
    """
    stage = plan.stage(stage_name)
    backend = backend_for(plan.spec.backend, plan.run_dir)
    manifests = Path(plan.run_dir) / "manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    for flavour in ("tpu", "cpu"):
        obj = jobset.render_jobset(plan, stage, flavour=flavour, pipeline_run_id=pipeline_run_id)
        (manifests / f"{stage.jobset}.{flavour}.yaml").write_text(
            yaml.safe_dump(obj, sort_keys=False), encoding="utf-8"
        )
    if already_trained(plan, stage_name):
        say(
            "admit",
            f"final checkpoint {stage.final_step} already exists in {stage.checkpoint_dir}; "
            "not training this stage again",
            stage.name,
        )
        return write_report(
            plan,
            "admit",
            {"jobset": stage.jobset, "skipped": True, "admitted": False, "reason": "final checkpoint exists"},
            stage,
        )
    manifest = jobset.render_jobset(plan, stage, flavour="cpu", pipeline_run_id=pipeline_run_id)
    state = backend.create_jobset(manifest)
    report = {
        "jobset": stage.jobset,
        "skipped": False,
        "admitted": True,
        "local_queue": plan.spec.queue,
        "cluster_queue": plan.spec.cluster_queue,
        "flavors": [plan.spec.slice_type.flavor_name],
        "wait_seconds": 0.0,
        "phase": state.phase,
        "state_dir": str(backend.state_dir(stage.jobset)),
        "note": "local backend: no Kueue; a JobSet is admitted as soon as it is created",
    }
    say(
        "admit",
        f"JobSet {stage.jobset} created and admitted at once (local backend, no Kueue); state in {report['state_dir']}",
        stage.name,
    )
    return write_report(plan, "admit", report, stage)
