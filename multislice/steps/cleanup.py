"""cleanup: the exit handler. Delete this pipeline run's JobSets that have not completed; nothing else.

Runs after the stages whether they succeeded, failed or were cancelled. It
selects JobSets by this run's ``pipeline/runid`` label, so another run's
JobSets (even of the same run name) are never touched, and it leaves
completed JobSets alone. On the local backend deleting a JobSet stops every
process it started; its state and logs stay on disk. On GKE it deletes,
through the Kubernetes API, the run's JobSets that are not Completed and the
run's Jobs (the verifier's) that have not finished, with foreground
propagation so their pods go too.
"""

from __future__ import annotations

import os
from typing import Any

from multislice import names
from multislice.backends import BackendUnavailable, backend_for
from multislice.config import ClusterSpec, parameters
from multislice.delivery import notify
from multislice.steps import is_local_path, say


def run(
    backend: str,
    output_dir: str,
    run_name: str,
    pipeline_run_id: str,
    pipeline_status: str = "",
    *,
    namespace: str = "default",
    cluster: dict[str, Any] | None = None,
    kube: Any = None,
    unique_run_name: bool = False,
    notify_webhook_url: str = "",
    error_message: str | None = None,
    pipeline_job: str = "",
) -> dict[str, Any]:
    """Delete the run's unfinished JobSets, then post the final status if a webhook is set; returns what it did.

    Takes raw pipeline parameters rather than a plan: an exit handler must run
    even when planning failed. ``namespace`` and ``cluster`` (the profile's
    ``cluster`` section) are for the GKE backend; ``kube`` replaces the API
    client built from them (tests). ``unique_run_name`` gives the run name the
    plan step used (:func:`multislice.config.parameters.unique_run_name`). With
    ``notify_webhook_url``, posts :func:`multislice.delivery.notify.status_payload`
    (``pipeline_status``, the failed step, ``error_message``, ``pipeline_job``);
    the report's ``notified`` is True, or the post's error.

    Raises:
        multislice.backends.gke.retry.ApiUnavailable: (GKE) the API kept failing; the run's JobSets may remain.
    """
    if unique_run_name:
        run_name = parameters.unique_run_name(run_name, pipeline_run_id)
    if backend == "gke":
        result = _run_gke(namespace, cluster or {}, pipeline_run_id, pipeline_status, kube)
        run_dir = f"{output_dir.rstrip('/')}/{run_name}"
        return _notify(result, notify_webhook_url, run_name, run_dir, error_message, pipeline_job)
    if backend == "local" and is_local_path(output_dir) and not os.path.isabs(output_dir):
        output_dir = os.path.abspath(output_dir)
    run_dir = f"{output_dir.rstrip('/')}/{run_name}"
    try:
        jobsets = backend_for(backend, run_dir)
    except BackendUnavailable as error:
        say("cleanup", f"nothing to clean up: {error}")
        result = {"deleted": [], "kept": [], "pipeline_status": pipeline_status}
        return _notify(result, notify_webhook_url, run_name, run_dir, error_message, pipeline_job)
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
    result = {"deleted": deleted, "kept": kept, "pipeline_status": pipeline_status}
    return _notify(result, notify_webhook_url, run_name, run_dir, error_message, pipeline_job)


def _run_gke(
    namespace: str, cluster: dict[str, Any], pipeline_run_id: str, pipeline_status: str, kube: Any
) -> dict[str, Any]:
    from multislice.backends.gke import jobset as jobsets
    from multislice.backends.gke.access import ClusterAccessError

    try:
        kube = kube or backend_for(
            "gke", "", cluster=ClusterSpec.model_validate(cluster), namespace=namespace,
            say=lambda message: say("cleanup", message),
        )  # fmt: skip
    except (ClusterAccessError, ValueError) as error:
        say("cleanup", f"cannot reach the cluster, so nothing was deleted: {error}")
        return {"deleted": [], "kept": [], "pipeline_status": pipeline_status, "error": str(error)}
    selector = jobsets.run_selector(pipeline_run_id)
    deleted, kept = [], []
    for js in kube.list_jobsets(selector):
        name, state = js["metadata"]["name"], jobsets.phase(js)
        if state == "Completed":
            kept.append(name)
            continue
        if jobsets.delete(kube, name):
            deleted.append(f"JobSet {name} ({state})")
    found = kube.call(kube.batch.list_namespaced_job, namespace, label_selector=selector, what="list Jobs")
    for job in found.items:
        finished = any(c.type in ("Complete", "Failed") and c.status == "True" for c in job.status.conditions or [])
        owned = any(ref.kind == "JobSet" for ref in job.metadata.owner_references or [])
        if finished or owned:  # a JobSet's Jobs go with their JobSet
            continue
        kube.call(
            kube.batch.delete_namespaced_job, job.metadata.name, namespace, propagation_policy="Foreground",
            what=f"delete Job {job.metadata.name}",
        )  # fmt: skip
        deleted.append(f"Job {job.metadata.name}")
    say(
        "cleanup",
        f"pipeline {pipeline_status or 'finished'}; namespace {namespace}, pipeline run {pipeline_run_id}: "
        f"deleted {deleted or 'nothing'}; kept completed {kept or 'none'}",
    )
    return {"deleted": deleted, "kept": kept, "pipeline_status": pipeline_status}


def _notify(
    result: dict[str, Any], url: str, run_name: str, run_dir: str, error_message: str | None, pipeline_job: str
) -> dict[str, Any]:
    if not url:
        return result
    state = result["pipeline_status"] or "UNKNOWN"
    step = notify.failed_step(error_message, run_dir) if state != "SUCCEEDED" else None
    problem = notify.post(url, notify.status_payload(run_name, state, error_message, step, pipeline_job))
    say("cleanup", f"notification {'sent' if problem is None else 'not sent: ' + problem}")
    return {**result, "notified": problem is None or problem, "failed_step": step}
