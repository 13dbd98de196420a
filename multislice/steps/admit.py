"""admit: submit a stage's workload to its queue and wait until it is admitted.

Renders the stage's workload for the backend (a multislice JobSet: TPU pods on
GKE, CPU processes locally), validates it against the JobSet CRD, writes it to
``<run_dir>/manifests/``, submits it (created, or adopted from a retried step
by its spec, or replacing a finished JobSet of the same name that an earlier
pipeline run left: a run continuing that one) and waits for admission: on GKE the Kueue Workload's
QuotaReserved and Admitted conditions, reporting the pending reason at
intervals; on the local backend there is no Kueue and a JobSet is admitted on
creation, which the report says. When admission times out, a workload this
step created is deleted.

A stage whose final checkpoint already exists (a rerun of the same run after
a later stage failed) is not trained again: admit creates nothing and the
stage's later steps pass it through, so the rerun resumes where work was lost.
"""

from __future__ import annotations

from multislice import cancel, storage
from multislice.backends import Backend
from multislice.backends.base import AdmissionTimeout
from multislice.heartbeat import heartbeat
from multislice.plan import Plan, StagePlan
from multislice.render import manifests, schema
from multislice.reports import AdmitReport
from multislice.steps import backend_of, cancellable, say, stage_labels, teller, write_report


def already_trained(stage: StagePlan) -> bool:
    """True when the stage's final checkpoint exists and was committed (local or ``gs://``)."""
    return storage.latest_committed_step(stage.checkpoint_dir) == stage.final_step


def run(plan: Plan, stage: StagePlan, pipeline_run_id: str, *, backend: Backend | None = None) -> AdmitReport:
    """Create (or adopt) the workload of ``stage`` (one of ``plan.stages``) and wait for admission; returns the admit
    report.

    Raises:
        multislice.render.schema.ManifestInvalid: the rendered workload fails CRD validation.
        multislice.backends.base.WorkloadConflict: the name is taken by another spec (an unfinished workload of
            another pipeline run: two runs of one run_name at once).
        multislice.backends.base.AdmissionTimeout: not admitted in time, or at once (AdmissionBlocked) when
            Kueue cannot admit it as configured (a workload this step created is deleted).
    """
    with cancellable("admit", stage, stage_labels(plan, stage, pipeline_run_id), plan) as removal:
        removal.backend = backend = backend_of(plan, backend, "admit", stage)
        manifest = backend.workload_manifest(plan, stage, pipeline_run_id)
        schema.validate(manifest)
        written = storage.join(plan.run_dir, "manifests", f"{stage.workload}.{backend.hardware}.yaml")
        storage.write_text(written, manifests.to_yaml(manifest))
        if already_trained(stage):
            say(
                "admit",
                f"final checkpoint {stage.final_step} already exists in {stage.checkpoint_dir}; "
                "not training this stage again",
                stage.name,
            )
            report = AdmitReport(
                jobset=stage.workload, skipped=True, reason="final checkpoint exists", manifest=written,
                pipeline_run_id=pipeline_run_id,
            )  # fmt: skip
            return write_report(plan, report, stage)
        cancel.point("admit:before-create")
        submitted = backend.submit(manifest)
        cancel.point("admit:created")
        say(
            "admit",
            f"{manifest.get('kind', 'JobSet')} {plan.spec.namespace}/{stage.workload} "
            + (
                "exists with this spec (a retried step): adopted"
                if submitted.adopted
                else f"of pipeline run {submitted.replaced} had finished: replaced for this run"
                if submitted.replaced
                else "created"
            )
            + f"; queue {plan.spec.queue}, priority {plan.spec.priority}",
            stage.name,
        )
        try:
            what = f"waiting for queue {plan.spec.queue} to admit {manifest.get('kind', 'JobSet')} {stage.workload}"
            with (
                backend.holding(stage.workload, "admit", teller("admit", stage)),
                heartbeat(what, teller("admit", stage)) as beat,
            ):
                cancel.point("admit:waiting")
                admission = backend.wait_admitted(plan, stage, beat.tell)
        except AdmissionTimeout as error:
            if submitted.adopted:
                raise
            backend.delete(stage.workload, owner=pipeline_run_id)
            deleted = f"; {manifest.get('kind', 'JobSet')} {stage.workload} (created by this step) was deleted"
            raise type(error)(error.message + deleted, error.fix) from None
        report = AdmitReport(
            jobset=stage.workload,
            admitted=True,
            adopted=submitted.adopted,
            replaced=submitted.replaced,
            pipeline_run_id=pipeline_run_id,
            local_queue=plan.spec.queue,
            cluster_queue=admission.cluster_queue,
            flavors=admission.flavors,
            wait_seconds=admission.wait_seconds,
            workload=admission.workload,
            uid=submitted.uid,
            manifest=written,
            note=admission.note,
        )
        cancel.point("admit:report")
        say(
            "admit",
            f"admitted by ClusterQueue {admission.cluster_queue} (flavors {', '.join(admission.flavors) or 'none'}) "
            f"after {admission.wait_seconds:.1f} s" + (f"; {admission.note}" if admission.note else ""),
            stage.name,
        )
        return write_report(plan, report, stage)
