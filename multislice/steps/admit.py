"""admit: submit a stage's JobSet to its queue and wait until it is admitted.

On GKE it creates the TPU-flavour JobSet (Kueue queue label, this pipeline
run's id label, spec-hash annotation) or adopts its own from a retried step,
finds the Kueue Workload the JobSet owns, and waits for its
QuotaReserved and Admitted conditions, reporting the pending reason at
intervals; on timeout it deletes the JobSet it created. On the local
backend there is no Kueue: the CPU-flavour JobSet is created and is
admitted on creation, which the report says.

A stage whose final checkpoint already exists (a rerun of the same run after
a later stage failed) is not trained again: admit creates nothing and the
stage's later steps pass it through, so the rerun resumes where work was lost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from multislice.backends import backend_for
from multislice.plan import Plan
from multislice.render import jobset, schema
from multislice.steps import gke_api, is_local_path, latest_committed_step, say, write_report


def _write_manifests(plan: Plan, stage_name: str, pipeline_run_id: str) -> None:
    if not is_local_path(plan.run_dir):
        return
    stage = plan.stage(stage_name)
    manifests = Path(plan.run_dir) / "manifests"
    manifests.mkdir(parents=True, exist_ok=True)
    for flavour in ("tpu", "cpu"):
        obj = jobset.render_jobset(plan, stage, flavour=flavour, pipeline_run_id=pipeline_run_id)
        (manifests / f"{stage.jobset}.{flavour}.yaml").write_text(
            yaml.safe_dump(obj, sort_keys=False), encoding="utf-8"
        )


def already_trained(plan: Plan, stage_name: str) -> bool:
    """True when the stage's final checkpoint exists and was committed (local paths only)."""
    stage = plan.stage(stage_name)
    return is_local_path(stage.checkpoint_dir) and latest_committed_step(stage.checkpoint_dir) == stage.final_step


def run(plan: Plan, stage_name: str, pipeline_run_id: str, *, kube: Any = None, timings: Any = None) -> dict[str, Any]:
    """Create (or adopt) the stage's JobSet and wait for admission; returns the admit report.

    Report keys: ``jobset``, ``skipped``, ``admitted``, ``local_queue``,
    ``cluster_queue``, ``flavors``, ``wait_seconds``. ``kube`` and ``timings``
    (GKE backend) replace the API client built from ``plan.spec.cluster`` and the default waits.

    Raises:
        multislice.render.schema.ManifestInvalid: the rendered JobSet fails CRD validation.
        multislice.backends.local.AlreadyExists: another JobSet holds the name (local).
        multislice.backends.gke.jobset.JobSetConflict: the name is taken by another spec (GKE).
        multislice.backends.gke.workload.AdmissionTimeout: Kueue did not admit it in time (GKE; JobSet deleted).
    """
    stage = plan.stage(stage_name)
    if plan.spec.backend == "gke":
        return _run_gke(plan, stage_name, pipeline_run_id, gke_api(plan, "admit", stage, kube, timings))
    backend = backend_for(plan.spec.backend, plan.run_dir)
    _write_manifests(plan, stage_name, pipeline_run_id)
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


def _run_gke(plan: Plan, stage_name: str, pipeline_run_id: str, kube: Any) -> dict[str, Any]:
    from multislice.backends.gke import jobset as jobsets
    from multislice.backends.gke import workload

    stage = plan.stage(stage_name)
    manifest = jobset.render_jobset(plan, stage, flavour="tpu", pipeline_run_id=pipeline_run_id)
    schema.validate(manifest)
    created, adopted = jobsets.create_or_adopt(kube, manifest)
    say(
        "admit",
        f"JobSet {kube.namespace}/{stage.jobset} "
        + ("exists with this spec (a retried step): adopted" if adopted else "created")
        + f"; queue {plan.spec.queue}, priority {plan.spec.priority}",
        stage.name,
    )
    try:
        admitted, waited = workload.wait_admitted(
            kube, stage.jobset, plan.spec.queue, timeout=kube.timings.admit_timeout,
            on_progress=lambda message: say("admit", message, stage.name),
        )  # fmt: skip
    except workload.AdmissionTimeout as error:
        if adopted:
            raise
        jobsets.delete(kube, stage.jobset)
        raise workload.AdmissionTimeout(f"{error}; JobSet {stage.jobset} (created by this step) was deleted") from None
    where = workload.admission(admitted)
    report = {
        "jobset": stage.jobset,
        "skipped": False,
        "admitted": True,
        "adopted": adopted,
        "local_queue": plan.spec.queue,
        "cluster_queue": where["cluster_queue"],
        "flavors": where["flavors"],
        "wait_seconds": round(waited, 2),
        "workload": admitted["metadata"]["name"],
        "uid": created["metadata"].get("uid"),
    }
    say(
        "admit",
        f"admitted by ClusterQueue {where['cluster_queue']} (flavors {', '.join(where['flavors']) or 'none'}) "
        f"after {waited:.1f} s",
        stage.name,
    )
    return write_report(plan, "admit", report, stage)
