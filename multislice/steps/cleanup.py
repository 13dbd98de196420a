"""cleanup: the exit handler. Delete what this pipeline run left unfinished; then notify.

Runs after the stages whether they succeeded, failed or were cancelled. The
backend (:meth:`multislice.backends.base.Backend.cleanup`) selects by this
run's ``pipeline/runid`` label, so another run's objects (even of the same
run name) are never touched, and leaves completed workloads alone: on GKE the
run's JobSets that are not Completed and its unfinished Jobs (the verifier's,
the AOT compiles'), deleted with foreground propagation so their pods go too;
locally the JobSets' processes (their state and logs stay on disk). Then, with
a webhook set, it posts the run's final status (:mod:`multislice.delivery.notify`).
"""

from __future__ import annotations

from typing import Any

from multislice import backends, cancel, ownership, storage
from multislice.backends import Backend
from multislice.delivery import notify
from multislice.errors import UserError
from multislice.identity import run_identity
from multislice.reports import CleanupReport, report_path
from multislice.steps import cancellable, say, teller


def run(
    backend_name: str,
    output_dir: str,
    run_name: str,
    pipeline_run_id: str,
    pipeline_status: str = "",
    *,
    namespace: str = "default",
    cluster: dict[str, Any] | None = None,
    backend: Backend | None = None,
    unique_run_name: bool = False,
    notify_webhook_url: str = "",
    notify_webhook_secret: str = "",
    error_message: str | None = None,
    pipeline_job: str = "",
) -> CleanupReport:
    """Delete the run's unfinished workloads, then post the final status if a webhook is set.

    Takes raw pipeline parameters rather than a plan: an exit handler must run
    even when planning failed. The run's name and directory come from
    :func:`multislice.identity.run_identity`, as the plan step's did.

    Args:
        backend_name: ``local`` or ``gke`` (the ``backend`` parameter).
        namespace, cluster: Where the run's objects are (gke; ``cluster`` is the profile's section).
        backend: Act through this backend instead of one built from the parameters (tests).
        notify_webhook_url: Post :func:`multislice.delivery.notify.status_payload` here (tests; '' to take it
            from :func:`multislice.delivery.notify.webhook_url`: the environment, or ``notify_webhook_secret``).
        notify_webhook_secret: Secret Manager secret version holding the URL (Vertex AI; '' for none).
        error_message, pipeline_job: From the orchestrator's ``PipelineTaskFinalStatus``.

    Returns:
        The report; ``notified`` is True, the post's error, or None without a webhook. A backend that
        cannot be reached is reported (``error``), not raised: nothing is deleted then.

    Raises:
        multislice.backends.gke.retry.ApiUnavailable: (GKE) the API kept failing; the run's objects may remain
            (raised after the notification and the report, which say so).
    """
    identity = run_identity(run_name, output_dir, unique_run_name_from=pipeline_run_id if unique_run_name else "")
    tell = teller("cleanup")
    report = CleanupReport(pipeline_status=pipeline_status)
    given = backend

    def remove_all() -> list[str]:  # cancelled: what this step was to delete goes all the same
        try:
            found = given or backends.create(
                backend_name, run_dir=identity.run_dir, namespace=namespace, cluster=cluster, say=tell
            )
            return found.cleanup(pipeline_run_id, tell)[0]
        except (UserError, ValueError) as error:
            tell(f"cannot reach the {backend_name} backend, so nothing was deleted: {error}")
            return []

    with cancellable("cleanup", remove=remove_all):
        try:
            backend = backend or backends.create(
                backend_name, run_dir=identity.run_dir, namespace=namespace, cluster=cluster, say=tell
            )
        except (UserError, ValueError) as error:
            tell(f"cannot reach the {backend_name} backend, so nothing was deleted: {error}")
            backend, report.error = None, str(error)
        failed: UserError | None = None
        if backend is not None:
            cancel.point("cleanup:deleting")
            try:
                report.deleted, report.kept = backend.cleanup(pipeline_run_id, tell)
            except UserError as error:  # the API kept failing: notify first, then fail the exit handler
                failed, report.error = error, str(error)
            else:
                tell(
                    f"pipeline {pipeline_status or 'finished'}; pipeline run {pipeline_run_id}: deleted "
                    f"{report.deleted or 'nothing'}; kept completed {report.kept or 'none'}"
                )
        problem = None
        if not notify_webhook_url:
            found_url, problem = notify.webhook_url(notify_webhook_secret)
            notify_webhook_url = found_url or ""
        if problem:
            say("cleanup", f"notification not sent: {problem}")
            report.notified = problem
        if notify_webhook_url:
            state = notify.normalize_state(pipeline_status)  # KFP's COMPLETE/CANCELED, Vertex's SUCCEEDED/CANCELLED
            step = notify.failed_step(error_message, identity.run_dir) if state != "SUCCEEDED" else None
            payload = notify.status_payload(identity.run_name, pipeline_status, error_message, step, pipeline_job)
            problem = notify.post(notify_webhook_url, payload)
            say("cleanup", f"notification {'sent' if problem is None else 'not sent: ' + problem}")
            report.notified, report.failed_step = (True if problem is None else problem), step
        if output_dir:  # without one (planning failed on it) there is no run directory to write to
            try:
                if ownership.writable_by(identity.run_dir, pipeline_run_id):  # never over another live run's report
                    storage.write_json(report_path(identity.run_dir, CleanupReport.file_name), report.to_dict())
                    ownership.release(identity.run_dir, run_id=pipeline_run_id)  # this pipeline run's lease ends
            except Exception as error:  # noqa: BLE001 - the exit handler's own report is best effort
                tell(f"report not written to {identity.run_dir}: {error}")
        if failed is not None:
            raise failed
        return report
