"""verify_checkpoint: check a stage's final checkpoint before the next stage may start.

The backend runs the checkpoint verifier (:mod:`multislice.trainer.verify`,
trainer image) against the stage's checkpoint directory with the stage's
MaxText arguments, so the expected parameter tree comes from the model
config: locally as a trainer-environment process, on GKE as a Job of the
trainer image; both read its JSON report from its output. For a stage with
``export`` the same process goes on, on a PASS, to export
(:mod:`multislice.trainer.verify_export`): the export step then reads what it
made instead of starting another (:meth:`.Backend.run_verifier`). The report
and its Markdown page go to the run directory (local or ``gs://``). A FAIL
fails the step, so a later stage never starts from an unverified one, and
nothing is exported.
"""

from __future__ import annotations

from multislice import cancel
from multislice.backends import Backend
from multislice.delivery import artifacts
from multislice.errors import RunFailed
from multislice.plan import Plan, StagePlan
from multislice.reports import VerificationReport, report_path
from multislice.steps import backend_of, cancellable, say, stage_labels, teller, write_report


class VerificationFailed(RunFailed):
    """The checkpoint failed a check (or the verifier could not run); the message lists which."""


def run(
    plan: Plan, stage: StagePlan, pipeline_run_id: str = "manual", *, backend: Backend | None = None
) -> VerificationReport:
    """Verify the final checkpoint of ``stage`` (one of ``plan.stages``); returns the verifier's report (verdict PASS).

    ``pipeline_run_id`` labels the verifier's Job on GKE (that of the stage's JobSet when it has one).

    Raises:
        VerificationFailed: verdict FAIL or ERROR, with the failed checks.
        multislice.errors.RunFailed: the verifier left no report.
    """
    with cancellable("verify_checkpoint", stage, stage_labels(plan, stage, pipeline_run_id), plan) as removal:
        removal.backend = backend = backend_of(plan, backend, "verify_checkpoint", stage)
        report = backend.run_verifier(plan, stage, pipeline_run_id, teller("verify_checkpoint", stage))
        cancel.point("verify_checkpoint:report")
        write_report(plan, report, stage)
        result_page(plan, stage, report)  # written before a FAIL raises, so a failed check has its page too
        for check in report.checks:
            say("verify_checkpoint", f"{check.result} {check.name}: {check.detail}", stage.name)
        if report.verdict != "PASS":
            failed = [f"{c.name}: {c.detail}" for c in report.failed_checks]
            raise VerificationFailed(
                f"checkpoint {stage.checkpoint_dir} verdict {report.verdict}: "
                + ("; ".join(failed) or report.error or "no detail")
                + f" (report {report_path(plan, VerificationReport.file_name, stage)})",
                "a stage that fails verification is not followed by the next; rerun the stage (delete its "
                "checkpoints first if they are corrupt)",
            )
        say(
            "verify_checkpoint",
            f"PASS: step {report.latest_step}, {report.parameter_count:,} parameters, "
            f"written with mesh {report.written_mesh}",
            stage.name,
        )
        return report


def result_page(plan: Plan, stage: StagePlan, report: VerificationReport) -> str:
    """The verifier's report as Markdown for the pipelines UI (:func:`.artifacts.verification_markdown`).

    Also written to ``<run_dir>/reports/<stage>/verification.md``.
    """
    text = artifacts.verification_markdown(stage.name, report)
    artifacts.write_text(report_path(plan, "verification.md", stage), text)
    return text
