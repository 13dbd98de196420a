"""cleanup: the exit handler. Delete what this pipeline run left unfinished; then notify.

Runs after the stages whether they succeeded, failed or were cancelled. The
backend (:meth:`multislice.backends.base.Backend.cleanup`) selects by this
run's ``pipeline/runid`` label, so another run's objects (even of the same
run name) are never touched, and leaves completed workloads alone: on GKE the
run's JobSets that are not Completed and its unfinished Jobs (the verifier's,
the AOT compiles'), deleted with foreground propagation so their pods go too;
locally the JobSets' processes (their state and logs stay on disk). Then, with
a webhook set, it posts the run's final status (:mod:`multislice.delivery.notify`).

A cancelled run (state ``CANCELLED``/``CANCELED``) also loses the node pools
provision created for it (:meth:`multislice.backends.base.Backend.release_node_pools`).
The final notification goes out once per run: on GKE the exit handler and the
reaper both claim it first (:meth:`multislice.backends.base.Backend.claim_notification`),
and the exit handler ends the run's hold (the run Lease) last.

:func:`reap_runs` is the same end for a run whose exit handler never came (KFP
Terminate, a killed step): ``multislice reap`` calls it for every run whose
hold expired.
"""

from __future__ import annotations

import contextlib
import datetime
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
        holding = contextlib.ExitStack()
        cancelled = notify.normalize_state(pipeline_status) == "CANCELLED"
        if backend is not None:
            try:  # the reaper leaves a run alone while its exit handler runs
                holding.enter_context(
                    backend.holding_run(identity.run_name, identity.run_dir, pipeline_run_id, "cleanup", tell)
                )
            except UserError as error:
                tell(f"could not hold the run: {error}")
            cancel.point("cleanup:deleting")
            try:
                report.deleted, report.kept = backend.cleanup(pipeline_run_id, tell)
                if cancelled:  # a cancelled run's own node pools go too
                    pools, kept_pools = backend.release_node_pools(pipeline_run_id, tell)
                    report.deleted += [f"node pool {pool}" for pool in pools]
                    report.kept += [f"node pool {pool}" for pool in kept_pools]
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
            if _claimed(backend, pipeline_run_id, state, "cleanup", tell):
                payload = notify.status_payload(identity.run_name, pipeline_status, error_message, step, pipeline_job)
                problem = notify.post(notify_webhook_url, payload)
                say("cleanup", f"notification {'sent' if problem is None else 'not sent: ' + problem}")
                report.notified, report.failed_step = (True if problem is None else problem), step
            else:
                say("cleanup", "notification not sent: the reaper sent this run's already")
                report.notified, report.failed_step = "sent already by the reaper", step
        holding.close()
        if backend is not None:  # (its workloads keep their own Leases: the reaper still removes them if need be)
            try:
                backend.end_run(pipeline_run_id, tell)  # the run is over: the reaper has nothing left to end
            except (UserError, Exception) as error:  # noqa: BLE001 - the Lease then expires; the reaper finds nothing
                tell(f"could not end the run's hold: {error}")
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


def _claimed(backend: Backend | None, pipeline_run_id: str, state: str, by: str, tell) -> bool:
    """Whether this caller posts the run's notification (:meth:`Backend.claim_notification`); True when the
    claim cannot be asked (no backend, an API error): a notification sent twice beats none."""
    if backend is None:
        return True
    try:
        return backend.claim_notification(pipeline_run_id, state, by)
    except Exception as error:  # noqa: BLE001 - best effort, as the post is
        tell(f"could not claim the notification ({error}); sending it")
        return True


def reap_runs(
    backend: Backend,
    *,
    now: datetime.datetime | None = None,
    notify_webhook_url: str = "",
    tell=print,
) -> list[dict[str, Any]]:
    """End every pipeline run whose hold expired (no step renewed it, no exit handler ended it), as the exit
    handler ends a cancelled run; one dict per run ended.

    For each run of :meth:`Backend.expired_runs` (on GKE the run Leases older than ``leaseDurationSeconds``
    after their last renewal): its unfinished workloads (:meth:`Backend.cleanup`: JobSets, RayJobs, Jobs, by
    its ``pipeline/runid`` label), the node pools provision created for it (:meth:`Backend.release_node_pools`),
    the ``CANCELLED`` notification (once: :meth:`Backend.claim_notification`; the payload's step is the one that
    renewed the hold last), then the hold itself (:meth:`Backend.end_run`). Only objects carrying that run's id
    are touched.

    Args:
        now: The reaper's clock (tests inject it); default the current time.
        notify_webhook_url: Where to post (``''``: :func:`multislice.delivery.notify.webhook_url`, the
            environment's ``$MULTISLICE_NOTIFY_WEBHOOK_URL``; none: no post).

    Returns:
        ``[{"pipeline_run_id", "run_name", "step", "deleted", "kept", "notified" (True, an error, or None)}]``.

    Raises:
        multislice.errors.UserError: the cluster or the GKE API kept failing (the runs not ended yet are ended
            by the next reaper run: their Leases stay).
    """
    ended = []
    if not notify_webhook_url:
        notify_webhook_url = notify.webhook_url()[0] or ""
    for run in backend.expired_runs(now):
        run_id = run["pipeline_run_id"]
        tell(
            f"pipeline run {run_id} ({run['run_name']}): its hold expired at {run['expired_at']}, last renewed by "
            f"{run['step'] or 'no step'}, and no exit handler ended it; ending it as cancelled"
        )
        deleted, kept = backend.cleanup(run_id, tell)
        pools, kept_pools = backend.release_node_pools(run_id, tell)
        deleted += [f"node pool {pool}" for pool in pools]
        kept += [f"node pool {pool}" for pool in kept_pools]
        notified: bool | str | None = None
        if notify_webhook_url and _claimed(backend, run_id, "CANCELLED", "reaper", tell):
            message = f"terminated: no step of the run renewed its hold after {run['step'] or 'its start'}"
            payload = notify.status_payload(run["run_name"], "CANCELLED", message, run["step"] or None)
            problem = notify.post(notify_webhook_url, payload)
            tell(f"notification {'sent' if problem is None else 'not sent: ' + problem}")
            notified = True if problem is None else problem
        backend.end_run(run_id, tell)
        ended.append({"pipeline_run_id": run_id, "run_name": run["run_name"], "step": run["step"],
                      "deleted": deleted, "kept": kept, "notified": notified})  # fmt: skip
    return ended
